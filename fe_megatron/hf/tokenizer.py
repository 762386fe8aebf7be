"""A run's sentencepiece model as a Hugging Face tokenizer that gives sentencepiece's ids for every text.

`save_tokenizer` writes ``tokenizer.json`` (a `tokenizers` pipeline), ``tokenizer_config.json`` (a
stock ``PreTrainedTokenizerFast``: no custom code) and the model itself as ``tokenizer.model``.  The
pipeline is read from the model's own ``ModelProto``:

* normalizer: the model's ``precompiled_charsmap`` (``normalizers.Precompiled``, made exact by
  `charsmap_normalizers`; ``nmt_nfkc``, what ``fe-data train-tokenizer`` trains with: NFKC, tabs and
  newlines to spaces, control characters removed), then sentencepiece's white-space rules from
  ``normalizer_spec``: ``remove_extra_whitespaces`` (leading and trailing spaces dropped, runs
  collapsed), ``add_dummy_prefix`` (a ``▁`` before any non-empty text), ``escape_whitespaces``;
* model: BPE over the same pieces and ids, one merge per split of a piece into two pieces, ranked
  by the piece's score (transformers' ``generate_merges``; control, unknown, unused and byte pieces
  are never formed), with byte fallback and the unknown piece; or Unigram with the pieces' scores.
  No pre-tokenizer: sentencepiece segments the whole normalized text, so whitespace-only pieces
  (``▁▁▁▁``) are found as it finds them;
* control pieces (``<s>``, ``</s>``, ``<pad>``) and ``<unk>`` are special tokens that are never read
  from text (``split_special_tokens``): sentencepiece, and so ``fe-data``, reads ``</s>`` in a
  document as ``<``, ``/``, ``s``, ``>``.  No BOS or EOS is added (fe-pretrain's documents carry none);
* decoder: ``▁`` to space, byte pieces to their bytes.  The leading space is kept:
  ``pipeline("text-generation")`` decodes the new tokens alone and appends them to the prompt, so
  ``prompt + decode(new)`` reads as sentencepiece's decoding of the whole sequence.  Hence
  ``decode(encode("Hi")) == " Hi"`` (sentencepiece drops the dummy-prefix space at the start).

Text with an unpaired surrogate is refused by both (``fe-data`` names the document; sentencepiece
raises ``RuntimeError``, this tokenizer ``TypeError``).

Why this is assembled here rather than by transformers' converters: ``SpmConverter`` strips text on
the right and turns runs of spaces into one ``▁`` (not ``remove_extra_whitespaces``), splits at every
``▁`` with a ``Metaspace`` pre-tokenizer (so ``▁▁▁▁`` pieces are never found), loses characters in
``Precompiled`` (see `charsmap_normalizers`), and in transformers 5 its BPE branch calls
``SentencePieceExtractor.extract`` with the wrong arguments (AttributeError); ``LlamaConverter`` drops
the charsmap and ``remove_extra_whitespaces``; both decoders strip the first space of every decoded
text.  Used as they are: transformers' ``import_protobuf`` and ``generate_merges``, and the
`tokenizers` components.

Not reproduced exactly (none met in the measured corpora, nor by the tests' random text):
normalizing a combining mark after a compatibility character that expands to several ("ﬁ" + acute:
sentencepiece "fi" + acute, here "fí"), after a character the charsmap deletes, or composing with
the letter past another mark that shares a decomposition with it; characters newer than the
charsmap that NFC composes (Unicode 16's Kirat Rai); in a Unigram model, text spelling a control or
byte piece ("<s>", "<0x41>"), which the `tokenizers` lattice matches; ``user_defined`` pieces (the
dummy prefix is added after each); pieces of equal score whose merges overlap (sentencepiece merges
the leftmost first, `tokenizers` by rank; never seen with the 32K model's whitespace pieces).  In
decoding, ``<unk>`` gives nothing with ``skip_special_tokens`` (sentencepiece " ⁇ "), and a run of
byte pieces that is not valid UTF-8 as a whole gives U+FFFD for every byte (``ByteFallback``),
where sentencepiece keeps the valid characters in it.
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import unicodedata

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # ModelProto.SentencePiece.Type
UNIGRAM, BPE = 1, 2  # TrainerSpec.ModelType


def load_model_proto(model_file: str):
    """The sentencepiece ``ModelProto`` of ``model_file``."""
    from transformers.convert_slow_tokenizer import import_protobuf

    proto = import_protobuf().ModelProto()
    with open(model_file, "rb") as fh:
        proto.ParseFromString(fh.read())
    return proto


def build_normalizer(spec):
    """sentencepiece's ``Normalizer::Normalize`` for ``normalizer_spec`` ``spec``, as a `tokenizers`
    normalizer (None for an identity spec that adds nothing)."""
    from tokenizers import Regex, normalizers

    if spec.normalization_rule_tsv and not spec.precompiled_charsmap:
        raise ValueError("a sentencepiece model with normalization rules but no precompiled charsmap")
    space = SPACE if spec.escape_whitespaces else " "
    steps = []
    if spec.precompiled_charsmap:
        steps += charsmap_normalizers(spec.precompiled_charsmap)
    if spec.remove_extra_whitespaces:
        # Only U+0020 counts: other white space has been mapped to it by the charsmap, or is kept.
        steps += [normalizers.Replace(Regex(r"\A +"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:  # not to empty text (Prepend leaves it empty)
        steps.append(normalizers.Prepend(space))
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", SPACE))
    if spec.remove_extra_whitespaces:
        # sentencepiece drops trailing (escaped) spaces last, so a trailing literal ▁ goes too
        steps.append(normalizers.Replace(Regex(f"{space}+\\z"), ""))
    return normalizers.Sequence(steps) if steps else None


def charsmap_normalizers(charsmap: bytes) -> list:
    """sentencepiece's charsmap rewriting as `tokenizers` normalizers.

    sentencepiece rewrites the longest prefix of the text that is a charsmap entry, then goes on
    after it.  ``normalizers.Precompiled`` looks a whole grapheme cluster up instead and, if the
    cluster is under 6 bytes and any prefix of it is an entry, replaces all of it by the *shortest*
    such entry's value: a + diaeresis + acute becomes "ä", the acute lost (tokenizers 0.23); only
    single characters are looked up exactly.  So:

    1. a character that the charsmap deletes (nmt_nfkc: U+0001) goes beside every non-ASCII
       character, which makes each its own grapheme cluster; Precompiled maps each exactly (and
       deletes those again);
    2. NFC then redoes the entries of several characters: a letter with the marks of a
       decomposition, in that order (e + circumflex + acute), a half-width kana + voiced mark,
       compatibility jamo (the entries hold NFKC of the sequence);
    3. but NFC also composes what no entry holds, and sentencepiece leaves: a composed letter with a
       further mark (Vietnamese "ê" + acute, Å + dot below, Hangul LV syllable + final jamo), two
       marks out of canonical order (Arabic shadda + fatha, Hebrew shin dot + qamats: NFC reorders
       them), a letter with a mark past another mark.  The deleted character, which Precompiled
       can no longer output, goes there to block NFC, and is removed after it.

    A charsmap that deletes no control character (e.g. plain ``nfkc``) gets U+E0FFF instead, an
    unassigned code point that breaks grapheme clusters too, removed after Precompiled; text that
    holds U+E0FFF itself then loses it."""
    from tokenizers import Regex, normalizers

    precompiled = normalizers.Precompiled(charsmap)
    deleted = (c for c in map(chr, range(1, 32)) if precompiled.normalize_str(f"a{c}b{c}") == "ab")
    breaker = next(deleted, "\U000E0FFF")
    # Two ASCII characters are two grapheme clusters (but CR LF), so the breaker goes only beside
    # other characters, and never first: a deletion at the very start is not applied by Precompiled.
    clusters = r"(?<=[^\x00-\x0C\x0E-\x7F])|(?<=[\s\S])(?=[^\x00-\x7F])"
    return [normalizers.Replace(Regex(clusters), breaker), precompiled, normalizers.Replace(breaker, ""),
            normalizers.Replace(Regex(_no_composition_pattern()), breaker), normalizers.NFC(),
            normalizers.Replace(breaker, "")]


@functools.lru_cache(maxsize=1)
def _no_composition_pattern() -> str:
    """A regex for the places where sentencepiece's charsmap composes nothing but NFC may: between a
    character with a canonical decomposition (of two or more characters) and a character that
    ends a canonical composition, and between two combining marks that follow each other in no
    canonical or compatibility decomposition (counting a mark's canonical equivalents, such as
    U+0341 for U+0301).  Built from Python's `unicodedata`."""
    marks, composed, seconds, equivalents, decomposable = set(), set(), set(), {}, []
    for code in range(0x30000):  # no mark and no decomposition lies above U+2FFFF
        char = chr(code)
        if unicodedata.combining(char):
            marks.add(char)
        decomposition = unicodedata.decomposition(char)
        if decomposition:
            decomposable.append(char)
            nfd = unicodedata.normalize("NFD", char)
            if len(nfd) == 1:
                equivalents.setdefault(nfd, {nfd}).add(char)
            else:
                composed.add(char)
            parts = decomposition.split()
            if len(parts) == 2 and not parts[0].startswith("<"):
                seconds.add(chr(int(parts[1], 16)))
    composed.update(map(chr, range(0xAC00, 0xD7A4)))  # Hangul syllables (decomposed by rule)
    seconds.update(map(chr, range(0x1161, 0x1176)), map(chr, range(0x11A8, 0x11C3)))  # medial, final jamo
    pairs = set()
    for char in decomposable:
        for form in ("NFD", "NFKD"):
            parts = unicodedata.normalize(form, char)
            for first, second in zip(parts, parts[1:]):
                if first in marks and second in marks:
                    pairs.update(itertools.product(equivalents.get(first, {first}),
                                                   equivalents.get(second, {second})))
    followers = {}  # mark -> the marks it may be followed by without a block
    for first, second in pairs:
        followers.setdefault(first, set()).add(second)
    groups = {}
    for mark in marks:
        groups.setdefault(frozenset(followers.get(mark, ())), set()).add(mark)
    mark_cases = "|".join(f"(?<={_char_class(before)})(?={_char_class(marks - allowed)})"
                          for allowed, before in sorted(groups.items(), key=lambda item: -len(item[1])))
    # the first test fails quickly almost everywhere
    return (f"(?={_char_class(marks | seconds)})(?:(?<={_char_class(composed)})(?={_char_class(seconds)})"
            f"|(?<={_char_class(marks)})(?={_char_class(marks)})(?:{mark_cases}))")


def _char_class(chars) -> str:
    codes, ranges = sorted(map(ord, chars)), []
    for code in codes:
        if ranges and ranges[-1][1] == code - 1:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])
    return "[" + "".join(f"\\x{{{a:X}}}" if a == b else f"\\x{{{a:X}}}-\\x{{{b:X}}}" for a, b in ranges) + "]"


def build_model(proto):
    """The `tokenizers` model over ``proto``'s pieces, with its ids."""
    from tokenizers.models import BPE as BPEModel
    from tokenizers.models import Unigram
    from transformers.tokenization_utils_base import generate_merges

    trainer = proto.trainer_spec
    pieces = [(p.piece, p.score) for p in proto.pieces]
    unk_id = trainer.unk_id
    if trainer.model_type == BPE:
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        # sentencepiece's BPE only forms normal and user-defined pieces
        never = {p.piece for p in proto.pieces if p.type in (UNKNOWN, CONTROL, UNUSED, BYTE)}
        merges = generate_merges(vocab, pieces, skip_tokens=never)
        return BPEModel(vocab=vocab, merges=merges, unk_token=proto.pieces[unk_id].piece, fuse_unk=True,
                        byte_fallback=trainer.byte_fallback, dropout=None)
    if trainer.model_type == UNIGRAM:
        return Unigram(pieces, unk_id=unk_id, byte_fallback=trainer.byte_fallback)
    raise ValueError(f"sentencepiece model type {trainer.model_type} (only BPE and Unigram are converted)")


def build_decoder():
    """Pieces to text as sentencepiece's ``DecodeIds``, but the first space is kept (module docstring)."""
    from tokenizers import decoders

    return decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])


def backend_tokenizer(model_file: str):
    """The `tokenizers.Tokenizer` (what ``tokenizer.json`` holds) for the sentencepiece model
    ``model_file``."""
    from tokenizers import AddedToken, Tokenizer

    proto = load_model_proto(model_file)
    if proto.trainer_spec.treat_whitespace_as_suffix:
        raise ValueError(f"{model_file}: a sentencepiece model with treat_whitespace_as_suffix is not converted")
    tokenizer = Tokenizer(build_model(proto))
    normalizer = build_normalizer(proto.normalizer_spec)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.decoder = build_decoder()
    # control pieces and <unk> are special (never read from text: see split_special_tokens);
    # user-defined pieces are read from the raw text, as sentencepiece does
    tokenizer.add_tokens([AddedToken(p.piece, normalized=False, special=p.type != USER_DEFINED)
                          for p in proto.pieces if p.type in (UNKNOWN, CONTROL, USER_DEFINED)])
    return tokenizer


def _piece(proto, index: int):
    return proto.pieces[index].piece if 0 <= index < len(proto.pieces) else None


PLAIN_CHAT_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plain_chat_template.jinja")


def build_tokenizer(sentencepiece_model: str, model_max_length: int = None):
    """A transformers tokenizer (`PreTrainedTokenizerFast`) equal to the sentencepiece model, with the plain
    chat template (`PLAIN_CHAT_TEMPLATE`: a pretrained model has no chat format of its own)."""
    from transformers import PreTrainedTokenizerFast

    proto = load_model_proto(sentencepiece_model)
    trainer = proto.trainer_spec
    special = dict(unk_token=_piece(proto, trainer.unk_id), bos_token=_piece(proto, trainer.bos_id),
                   eos_token=_piece(proto, trainer.eos_id), pad_token=_piece(proto, trainer.pad_id))
    kwargs = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend_tokenizer(sentencepiece_model), split_special_tokens=True,
        add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False,
        chat_template=open(PLAIN_CHAT_TEMPLATE).read(), **{k: v for k, v in special.items() if v is not None},
        **kwargs)


def save_tokenizer(sentencepiece_model: str, directory: str, model_max_length: int = None):
    """Save the sentencepiece model as a Hugging Face tokenizer in ``directory`` (``tokenizer.json``,
    ``tokenizer_config.json`` and the model itself as ``tokenizer.model``); returns it.  Rewriting a
    directory from its own ``tokenizer.model`` upgrades one written by an older converter."""
    os.makedirs(directory, exist_ok=True)
    kept = os.path.join(directory, "tokenizer.model")  # the sentencepiece model itself stays beside it
    if not os.path.exists(kept) or not os.path.samefile(sentencepiece_model, kept):
        shutil.copyfile(sentencepiece_model, kept)
    tokenizer = build_tokenizer(kept, model_max_length)
    tokenizer.save_pretrained(directory)
    return tokenizer
