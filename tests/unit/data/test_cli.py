"""fe-data (`fe_megatron.data.cli`): its counts, its options' help, and bad input refused before anything is
written. The command without third-party noise, as a user runs it, is tests/integration/test_commands.py's."""

import json
import sys

import pytest

from fe_megatron.data.cli import main as fe_data
from fe_megatron.data.sources import DataError, validate_inputs


def test_preprocess_reports_counts(small_data, tmp_path, capsys):
    assert fe_data(["preprocess", "--input", small_data["subset"], "--tokenizer-model", small_data["tokenizer"],
                    "--output-prefix", str(tmp_path / "again"), "--no-progress"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["documents"] == 40 and stats["tokens"] > 100_000 and stats["tokens_per_second"] > 0


def test_bad_input_fails_before_writing(tmp_path, small_data, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    rc = fe_data(["preprocess", "--input", str(bad), "--tokenizer-model", small_data["tokenizer"],
                  "--output-prefix", str(tmp_path / "out"), "--no-progress"])
    assert rc == 2 and "bad.jsonl:2: malformed JSON" in capsys.readouterr().err
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())
    assert fe_data(["preprocess", "--input", str(tmp_path / "missing.jsonl"), "--tokenizer-model",
                    small_data["tokenizer"], "--output-prefix", str(tmp_path / "o")]) == 2
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="x.csv: unknown format"):
        validate_inputs([str(tmp_path / "x.csv")], "text")


@pytest.mark.parametrize("subcommand", ["train-tokenizer", "preprocess"])
def test_every_fe_data_option_explains_itself(subcommand):
    import argparse

    from fe_megatron.data import cli

    captured = {}
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        captured["parser"] = self
        return original(self, args, namespace)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(SystemExit):
            cli.main([subcommand, "--help"])
    sub = next(a for a in captured["parser"]._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[subcommand]
    assert parser.description
    for action in parser._actions:
        assert action.help, f"fe-data {subcommand} {action.option_strings} has no help text"


def test_hf_input_without_datasets_names_the_extra_and_writes_nothing(tmp_path, monkeypatch, small_data):
    from fe_megatron.data.cli import main as fe_data

    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    prefix = tmp_path / "out" / "fineweb"
    rc = fe_data(["preprocess", "--input", "hf:HuggingFaceFW/fineweb-edu:sample-10BT", "--tokenizer-model",
                  small_data["tokenizer"], "--output-prefix", str(prefix), "--no-progress"])
    assert rc == 2
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
