"""``fe-data``: train a tokenizer, preprocess a corpus into Megatron indexed datasets."""

import argparse
import json
import sys

from fe_megatron.data.sources import DataError, iter_documents
from fe_megatron.training.third_party_warnings import silence_known_third_party_warnings


DESCRIPTION = """\
Prepare pretraining data: train a sentencepiece tokenizer, and tokenize documents into a
Megatron indexed dataset (PREFIX.bin / PREFIX.idx) that fe-pretrain reads (data.train_data).

inputs: .txt (one document per line), .jsonl / .jsonl.gz (one JSON object per line, the text
under --text-key), .parquet, or hf:NAME[:SUBSET] for a Hugging Face dataset (streamed; needs
the datasets package: pip install 'fe_megatron[hf]').

examples:
  fe-data train-tokenizer --input my_text.jsonl --output-prefix data/tok --vocab-size 32000
  fe-data preprocess --input my_text.jsonl --tokenizer-model data/tok.model --output-prefix data/my_text
"""


def main(argv=None) -> int:
    silence_known_third_party_warnings()
    parser = argparse.ArgumentParser(prog="fe-data", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("train-tokenizer", help="train a sentencepiece BPE model",
                         description="Train a sentencepiece BPE tokenizer (byte fallback, digits split).")
    tok.add_argument("--input", nargs="+", required=True, help="txt / jsonl / jsonl.gz / parquet files, or hf:NAME")
    tok.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    tok.add_argument("--vocab-size", type=int, default=32000, help="pieces in the vocabulary (default 32000)")
    tok.add_argument("--text-key", default="text", help="the JSON field (or parquet column) holding the text")
    tok.add_argument("--max-documents", type=int, default=None, help="train on at most this many documents")
    pre = sub.add_parser("preprocess", help="tokenize into PREFIX.bin / PREFIX.idx",
                         description="Tokenize documents, each followed by the end-of-document token, into a "
                                     "Megatron indexed dataset. Nothing is written under PREFIX on bad input.")
    pre.add_argument("--input", nargs="+", required=True, help="txt / jsonl / jsonl.gz / parquet files, or hf:NAME")
    pre.add_argument("--tokenizer-model", required=True, help="a sentencepiece .model file")
    pre.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    pre.add_argument("--text-key", default="text", help="the JSON field (or parquet column) holding the text")
    pre.add_argument("--hf-split", default="train", help="the split of an hf: dataset (default train)")
    pre.add_argument("--max-documents", type=int, default=None, help="stop after this many documents")
    pre.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        if args.command == "train-tokenizer":
            from fe_megatron.data.sources import validate_inputs
            from fe_megatron.data.tokenizer import train_sentencepiece

            validate_inputs(args.input, args.text_key)

            def limited():
                for i, text in enumerate(iter_documents(args.input, args.text_key)):
                    if args.max_documents is not None and i >= args.max_documents:
                        return
                    yield text

            path = train_sentencepiece(limited(), args.output_prefix, args.vocab_size)
            print(json.dumps({"tokenizer_model": path, "vocab_size": args.vocab_size}))
        else:
            from fe_megatron.data.preprocess import preprocess

            stats = preprocess(args.input, args.tokenizer_model, args.output_prefix, args.text_key, args.hf_split,
                               args.max_documents, progress=not args.no_progress)
            print(json.dumps(stats))
    except (DataError, FileNotFoundError, ValueError) as err:
        print(f"fe-data: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
