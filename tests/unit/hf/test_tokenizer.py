"""The converted Hugging Face tokenizer (`fe_megatron.hf.tokenizer`): sentencepiece's ids for every
text, decoding that keeps the space between a prompt and its continuation, and old converted
directories. Loading without custom code, in a fresh interpreter, is tests/integration/test_hf_loading.py's."""

import json
import os

import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.paths import ROOT
from tests.helpers.tokenizers import train_fe_data_tokenizer

# a real 32K sentencepiece model (Mistral 7B's, Apache-2.0), bundled in data/tokenizers/
MISTRAL = os.path.join(ROOT, "data", "tokenizers",
                       "mistral_32k.model")

# Text sentencepiece normalizes specially: runs of white space, NFKC (full-width letters,
# ligatures, compatibility characters), characters nmt_nfkc deletes or turns into spaces, decomposed
# letters, marks sentencepiece leaves alone that NFC would reorder or compose (Arabic shadda +
# fatha, Hebrew points, a composed Vietnamese letter + tone mark), emoji, control pieces' spellings.
ARABIC = "\u0645\u064f\u062d\u064e\u0645\u0651\u064e\u062f\u064c"  # shadda before fatha
HEBREW = "\u05e9\u05c1\u05b8\u05dc\u05d5\u05b9\u05dd"  # shin dot before qamats
FRAGMENTS = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "\u3000", "\u00a0", "\u2009",
             "\u200b", "\ufeff", "\u00ad", "\x00", "\x01", "\x1b", "\x7f", "ﬁ", "ﬂ", "ﬃ", "Ｈｅｌｌｏ", "ＡＢＣ１２３",
             "①", "½", "™", "㎏", "ǅ", "ﷺ", "e\u0301", "a\u0308\u0304", "e\u0323\u0302", "tie\u0302\u0301ng",
             "Vi\u00ea\u0323t", "\u00c5\u0323", ARABIC, HEBREW, "ｶﾞｷﾞ", "ㄱㅏ", "\u1100\u1161\u11a8", "한국어", "ㅋㅋ",
             "中文", "😀", "👍🏽", "👨\u200d👩\u200d👧", "🇺🇸", "❤️", "—", "’", "\u2581", "</s>", "<s>", "<pad>",
             "<unk>", "<0x41>", "1234567", "3.14", "The", " the", "  They", "State of the Union"]
# Random characters are not combining marks: a mark after an arbitrary character hits the cases
# the module docstring lists as not reproduced (e.g. "ﬁ" + acute: sentencepiece "fi" + acute,
# NFC "fí").  Unpaired surrogates have their own test.
CHARACTERS = st.characters(exclude_categories=("Cs", "Mn", "Mc", "Me"))
TEXTS = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(CHARACTERS, max_size=6)), max_size=24).map("".join)


@pytest.fixture(scope="module", params=["fe-data", "mistral_32k"])
def converted(request, tmp_path_factory):
    """``(directory, transformers tokenizer loaded from it, SentencePieceProcessor)``."""
    from transformers import AutoTokenizer

    from fe_megatron.hf import save_tokenizer

    base = tmp_path_factory.mktemp("tok")
    if request.param == "fe-data":
        model = train_fe_data_tokenizer(str(base))
    else:
        model = MISTRAL
    directory = str(base / "hf")
    save_tokenizer(model, directory)
    return directory, AutoTokenizer.from_pretrained(directory), spm.SentencePieceProcessor(model_file=model)


def test_the_directory_holds_a_plain_tokenizer(converted):
    directory, hf, sp = converted
    with open(os.path.join(directory, "tokenizer_config.json")) as fh:
        config = json.load(fh)
    assert "auto_map" not in config and config["split_special_tokens"] is True
    assert len(hf) == sp.get_piece_size() and hf.get_vocab() == {sp.id_to_piece(i): i for i in range(len(hf))}
    assert (hf.unk_token_id, hf.bos_token_id, hf.eos_token_id) == (sp.unk_id(), sp.bos_id(), sp.eos_id())
    assert hf.pad_token_id == (sp.pad_id() if sp.pad_id() >= 0 else None)
    assert hf("Hello world")["input_ids"] == sp.encode("Hello world")  # no BOS, no EOS
    # the plain chat template, so that a server's chat endpoint and apply_chat_template work as they are
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who spoke?"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "System: Be brief.\nUser: Who spoke?\nAssistant:"


@pytest.mark.parametrize("text", ["—  They said", "The  state of the Union\t\tis\n\n   strong.  ", "  lead",
                                  "trail  ", "", " ", "\n", "def f(x):\n    return x  # two  spaces\n",
                                  "Ｈｅｌｌｏ ﬁne ①", "tie\u0302\u0301ng Vi\u00ea\u0323t", ARABIC, HEBREW,
                                  "a</s>b<s><pad><unk>", "x\u2581", "\u2581", "\x01 a \x01", "ｶﾞ ㄱㅏ"])
def test_known_texts_get_sentencepieces_ids(converted, text):
    _, hf, sp = converted
    assert hf.encode(text, add_special_tokens=False) == sp.encode(text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_any_text_gets_sentencepieces_ids(converted, text):
    _, hf, sp = converted
    assert hf.encode(text, add_special_tokens=False) == sp.encode(text)
    assert hf(text, add_special_tokens=False)["input_ids"] == sp.encode(text)  # the batch path too


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=st.text(CHARACTERS, max_size=5), after=st.text(CHARACTERS, max_size=5))
def test_unpaired_surrogates_are_refused_like_fe_data_refuses_them(converted, tmp_path, before, after):
    from fe_megatron.data.sources import DataError, iter_jsonl

    _, hf, sp = converted
    text = before + "\ud83d" + after
    path = tmp_path / "doc.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n")  # escaped as \ud83d in the JSON
    with pytest.raises(DataError, match="unpaired surrogate"):
        list(iter_jsonl(str(path), "text"))
    with pytest.raises(RuntimeError):
        sp.encode(text)
    with pytest.raises(TypeError):
        hf.encode(text, add_special_tokens=False)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=TEXTS.filter(lambda t: t.strip()),
       parts=st.lists(st.one_of(st.integers(min_value=0), TEXTS), max_size=8))
def test_prompt_plus_decoded_continuation_reads_as_the_whole_sequence(converted, prompt, parts):
    """What pipeline("text-generation") does: the prompt, then the new tokens decoded alone.  The new
    tokens: any pieces but <unk> (sentencepiece: " ⁇ ") and the ids of texts, so that every run of
    byte pieces is valid UTF-8 (see the module docstring for invalid runs)."""
    _, hf, sp = converted
    prompt_ids = sp.encode(prompt)
    if not sp.decode(prompt_ids):
        return  # sentencepiece drops the leading spaces of a sequence: nothing before the continuation
    pieces = [i for i in range(sp.get_piece_size()) if not (sp.is_unknown(i) or sp.is_byte(i))]
    new = []
    for part in parts:
        new += [pieces[part % len(pieces)]] if isinstance(part, int) else sp.encode(part)
    whole = sp.decode(prompt_ids + new)
    assert sp.decode(prompt_ids) + hf.decode(new, skip_special_tokens=True) == whole


def test_an_old_converted_directory_still_loads_and_can_be_rewritten(converted_directory, tmp_path):
    """A directory written by the LlamaTokenizer-based converter (before this module)."""
    from transformers import AutoTokenizer, LlamaTokenizer

    from fe_megatron.data.tokenizer import HFTokenizer
    from fe_megatron.hf import save_tokenizer

    _, model_file = converted_directory
    sp = spm.SentencePieceProcessor(model_file=model_file)
    old = tmp_path / "old"
    old.mkdir()
    kept = old / "tokenizer.model"
    kept.write_bytes(open(model_file, "rb").read())
    LlamaTokenizer.from_pretrained(str(old), add_bos_token=False, add_eos_token=False).save_pretrained(str(old))
    assert json.loads((old / "tokenizer_config.json").read_text())["tokenizer_class"] == "LlamaTokenizer"
    assert AutoTokenizer.from_pretrained(str(old)).encode("Hello", add_special_tokens=False) == sp.encode("Hello")
    assert HFTokenizer(str(old)).eod == sp.eos_id()
    save_tokenizer(str(kept), str(old))  # rewritten from its own tokenizer.model
    assert AutoTokenizer.from_pretrained(str(old)).encode("—  They", add_special_tokens=False) == sp.encode("—  They")
    assert HFTokenizer(str(old)).tokenize("—  They").tolist() == sp.encode("—  They")


def test_text_generation_pipeline_keeps_the_space_before_the_continuation(converted_directory):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    import fe_megatron.hf  # noqa: F401  (registers the model class)

    directory, model_file = converted_directory
    sp = spm.SentencePieceProcessor(model_file=model_file)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    generate = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    words = [i for i in range(sp.get_piece_size())  # new tokens: words that start with a space
             if sp.id_to_piece(i).startswith("\u2581") and len(sp.id_to_piece(i)) > 1 and not sp.is_control(i)]
    suppress = sorted(set(range(sp.get_piece_size())) - set(words))
    for prompt in ("The state of the Union is", "Fellow-citizens  of the Senate"):
        settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, suppress_tokens=suppress)
        text = generate(prompt, **settings)[0]["generated_text"]
        ids = generate(prompt, return_tensors=True, **settings)[0]["generated_token_ids"]
        ids = [int(i) for i in ids]
        prompt_ids = sp.encode(prompt)
        assert ids[:len(prompt_ids)] == prompt_ids and len(ids) == len(prompt_ids) + 6
        continuation = sp.decode(ids)[len(sp.decode(prompt_ids)):]  # sentencepiece's, of the whole sequence
        assert text == prompt + continuation and continuation.startswith(" ")
        assert continuation == " " + sp.decode(ids[len(prompt_ids):])


def test_the_tokenizer_matches_sentencepiece(small_data, tmp_path):
    from fe_megatron.hf import save_tokenizer

    hf = save_tokenizer(small_data["tokenizer"], str(tmp_path))
    sp = spm.SentencePieceProcessor(model_file=small_data["tokenizer"])
    text = "The Congress shall have Power To lay and collect Taxes, 1787 ü and naïve -- 3.14"
    assert hf.encode(text, add_special_tokens=False) == sp.encode(text)
    assert len(hf) == sp.get_piece_size() and hf.eos_token_id == sp.eos_id()
