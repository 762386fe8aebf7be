"""`fe_megatron.hf.lm_eval_tasks`: the example files of ``examples/eval/`` render through the tasks it writes
for lm-evaluation-harness."""

import ast
import os

import pytest

from fe_megatron.evaluation import tasks
from tests.helpers.paths import ROOT


EXAMPLES = os.path.join(ROOT, "examples", "eval")


def test_the_example_files_render_through_the_lm_eval_tasks(tmp_path):
    import yaml

    from fe_megatron.hf.lm_eval_tasks import write_tasks

    apply_template = pytest.importorskip("lm_eval.utils").apply_template
    assert write_tasks(EXAMPLES, str(tmp_path)) == ["fe_social_iqa", "fe_arc_like", "fe_winogrande"]
    for task in ("fe_social_iqa", "fe_arc_like", "fe_winogrande"):
        spec = yaml.safe_load(open(tmp_path / f"{task}.yaml"))
        for _, doc in tasks.iter_json_records(spec["dataset_kwargs"]["data_files"]["test"]):
            text = apply_template(spec["doc_to_text"], doc)
            choices = ast.literal_eval(apply_template(spec["doc_to_choice"], doc))
            target = apply_template(spec["doc_to_target"], doc)
            assert len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)
            if task == "fe_winogrande":  # the text is the index of the right context; the target is shared
                assert int(text) in (0, 1) and choices[int(text)].endswith(doc[f"option{doc['label']}"])
                assert target and target == doc["sentence"].split("_", 1)[1].strip()
            else:
                assert text.startswith("Question: ") and text.endswith("\nAnswer:")
                assert choices == doc["choices"] and 0 <= int(target) < len(choices)
