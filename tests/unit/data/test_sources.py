"""`fe_megatron.data.sources`: the bundled corpus, JSON-lines, text and parquet inputs, and every bad
input named by file and line."""

import sys

import pytest

from fe_megatron.data.sources import DataError, iter_documents, validate_inputs
from tests.helpers.paths import CORPUS


def test_bundled_corpus_is_readable_and_not_eval_data():
    docs = list(iter_documents([CORPUS]))
    assert len(docs) == 233 and all(len(d) > 1000 for d in docs)


def test_txt_and_parquet_inputs(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("first document\n\nsecond document\n")
    assert list(iter_documents([str(txt)])) == ["first document", "second document"]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    pq.write_table(pyarrow.table({"text": ["x y", "z"]}), tmp_path / "b.parquet")
    assert list(iter_documents([str(tmp_path / "b.parquet")])) == ["x y", "z"]


@pytest.mark.parametrize("content, fragment", [
    ('{"text": "ok"}\n{"text": "broken"\n', r"bad.jsonl:2: malformed JSON"),
    ('{"text": "ok"}\n\n{"body": "no text"}\n', r"bad.jsonl:3: no 'text' field \(found: \['body'\]\)"),
    ('{"text": 5}\n', r"bad.jsonl:1: field 'text' is a int, expected a string"),
    ('\n\n', r"empty corpus"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=fragment):
        validate_inputs([str(path)], "text")


def test_hf_error_text(monkeypatch):
    from fe_megatron.data.sources import DataError, validate_inputs

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"reading hf:NAME inputs needs the Hugging Face 'datasets' package, which is "
                                        r"not installed; install it with: pip install 'fe_megatron\[hf\]'"):
        validate_inputs(["hf:some/dataset"], "text")
