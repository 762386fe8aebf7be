"""Every console script's --help, as a new user meets it: plain text, no reStructuredText quoting."""

import pytest

from tests.helpers.commands import command, run


@pytest.mark.parametrize("name, expected", [
    ("fe-pretrain", ["Pretrain a FactorEngram, Engram or plain Transformer GPT",
                     "  torchrun --nproc_per_node 8 -m fe_megatron.train \\\n"
                     "      --config examples/configs/paper_340m_factorengram.yaml --save checkpoints/run1"]),
    ("fe-plan", ["Print the parameter budget of a memory preset or a YAML config"]),
    ("fe-data", ["Prepare pretraining data: train a sentencepiece tokenizer",
                 "pip install 'fe_megatron[hf]'"]),
    ("fe-demo", ["Pretrain a small FactorEngram model and the same-size Transformer"]),
    ("fe-convert", ["fe-convert: Megatron checkpoints to Hugging Face and back"]),
    ("fe-eval", ["fe-eval: evaluate a trained model"]),
    ("fe-inspect", ["fe-inspect: what the memory of a trained model does on a text",
                    "which checkpoint of a run directory", "read the text's first tokens up to about this many"]),
])
def test_help_texts_read_as_plain_text(name, expected):
    out = run(command(name) + ["--help"]).stdout
    for text in expected:
        assert text in out
    assert "``" not in out  # no reStructuredText quoting leaks into --help
