"""lm-evaluation-harness tasks over local multiple-choice files (no hub access).

Writes one task YAML per set, reading the jsonl files of a local evaluation folder through the
``json`` dataset builder, plus a group ``fe_mc`` of all three:

* ``fe_social_iqa`` and ``fe_arc_like``: ``{"context_question", "choices", "label"}`` items,
  scored by the log-likelihood of each choice after ``Question: ... Answer:`` (``acc`` and the
  length-normalized ``acc_norm``);
* ``fe_winogrande``: ``{"sentence", "option1", "option2", "label"}`` pairs, scored as
  lm-evaluation-harness scores WinoGrande: each option fills the blank, and the model scores the
  rest of the sentence after it (partial scoring).

    python -m fe_megatron.hf.lm_eval_tasks --data EVAL_DIR --output TASK_DIR
    lm_eval --model hf --model_args pretrained=HF_DIR,trust_remote_code=True \\
        --include_path TASK_DIR --tasks fe_mc --device cpu
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

_QUESTION_CHOICES = {"doc_to_text": "Question: {{context_question}}\nAnswer:", "doc_to_choice": "{{choices}}",
                     "doc_to_target": "{{label}}"}
TASKS = {
    "fe_social_iqa": ("social_iqa.jsonl", _QUESTION_CHOICES, ["acc", "acc_norm"]),
    "fe_arc_like": ("arc_like.jsonl", _QUESTION_CHOICES, ["acc", "acc_norm"]),
    "fe_winogrande": ("winogrande_pairs.jsonl", {
        "doc_to_text": "{{label - 1}}",  # a number: the choices are contexts, the target is shared
        "doc_to_choice": "{{[sentence.split('_')[0] + option1, sentence.split('_')[0] + option2]}}",
        "doc_to_target": "{{sentence.split('_', 1)[1].strip()}}"}, ["acc"]),
}
GROUP = "fe_mc"


def write_tasks(data_dir: str, output: str) -> list:
    """Write the task YAMLs for the files of ``data_dir`` that exist; returns the task names."""
    os.makedirs(output, exist_ok=True)
    written = []
    for task, (file_name, templates, metrics) in TASKS.items():
        path = os.path.abspath(os.path.join(data_dir, file_name))
        if not os.path.isfile(path):
            continue
        spec = {"task": task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": path}},
                "test_split": "test", "output_type": "multiple_choice", **templates,
                "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in metrics],
                "metadata": {"version": 1.0}}
        with open(os.path.join(output, f"{task}.yaml"), "w") as fh:
            yaml.safe_dump(spec, fh, sort_keys=False)
        written.append(task)
    if not written:
        raise FileNotFoundError(f"{data_dir} holds none of {[spec[0] for spec in TASKS.values()]}")
    with open(os.path.join(output, f"{GROUP}.yaml"), "w") as fh:
        yaml.safe_dump({"group": GROUP, "task": written,
                        "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}],
                        "metadata": {"version": 1.0}}, fh, sort_keys=False)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fe_megatron.hf.lm_eval_tasks",
                                     description="write lm-evaluation-harness tasks over local multiple-choice files")
    parser.add_argument("--data", required=True, help="folder with social_iqa.jsonl, arc_like.jsonl, "
                                                      "winogrande_pairs.jsonl")
    parser.add_argument("--output", required=True, help="folder for the task YAMLs (lm_eval --include_path)")
    args = parser.parse_args(argv)
    try:
        tasks = write_tasks(args.data, args.output)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(tasks)} and the group {GROUP} to {args.output}; run e.g.\n  lm_eval --model hf "
          f"--model_args pretrained=HF_DIR,trust_remote_code=True --include_path {args.output} --tasks {GROUP}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
