"""Deduplication and the row exchange's bytes on real text, at a preset's table shapes.

Each memory layer of a row-sharded run looks up ``micro_batch x seq x branches`` rows per
microbatch; it sends one request per *distinct* row to the row's owner, receives the row, and
sends its gradient back (`fe_megatron.tables.row_exchange`).  This script tokenizes real text,
hashes it with the preset's addressing, and counts, per microbatch and layer, the positions and
the distinct rows, and the bytes a rank sends and receives for them with ``N`` data-parallel
ranks (a fraction ``(N - 1) / N`` of the rows lives elsewhere): 8 bytes per request id, and
``s_b / tp`` fp32 values per row and per row gradient.

    python benchmarks/bench_row_exchange.py --tokenizer TOKENIZER.model --input a.jsonl.gz b.jsonl.gz \
        [--preset factorengram-340m] [--micro-batch 1 4] [--seq 8192] [--ranks 8] [--tp 1]

The corpora's documents are shuffled and cut into consecutive ``micro_batch x seq`` token
windows, documents joined by the end-of-document token, as a pretraining dataset serves them.
"""

import argparse
import json
import platform
import random
import time

import torch

from fe_megatron.config import MemoryConfig
from fe_megatron.data.sources import iter_documents
from fe_megatron.data.tokenizer import SentencePieceTokenizer
from fe_megatron.ngram import NgramHasher


def token_stream(inputs, tokenizer, limit, seed=0):
    """``limit`` tokens of the corpora's documents in shuffled order (as Megatron's GPTDataset
    serves them), each followed by the end-of-document token."""
    documents = list(iter_documents(inputs))
    random.Random(seed).shuffle(documents)
    ids = []
    for text in documents:
        ids.extend(tokenizer.tokenize(text).tolist())
        ids.append(tokenizer.eod)
        if len(ids) >= limit:
            break
    return torch.tensor(ids[:limit], dtype=torch.int64)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True, help="a sentencepiece .model within the preset's vocabulary")
    parser.add_argument("--input", nargs="+", required=True, help="txt / jsonl / jsonl.gz corpora")
    parser.add_argument("--preset", default="factorengram-340m")
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--ranks", type=int, default=8, help="data-parallel ranks the rows are sharded over")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--windows", type=int, default=16, help="microbatches measured per size")
    args = parser.parse_args()
    config = MemoryConfig.from_preset(args.preset)
    tokenizer = SentencePieceTokenizer(args.tokenizer)
    if tokenizer.vocab_size > config.vocab_size:
        raise SystemExit(f"the tokenizer has {tokenizer.vocab_size} tokens; {args.preset} addresses {config.vocab_size}")
    hasher = NgramHasher(config)
    width = config.branch_width // args.tp
    off_rank = (args.ranks - 1) / args.ranks
    print(f"# {platform.node()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; preset {args.preset}: "
          f"{config.num_branches} branches x {len(config.layers)} layers, s_b/tp = {width}, N = {args.ranks}")
    for micro_batch in args.micro_batch:
        tokens = token_stream(args.input, tokenizer, args.windows * micro_batch * args.seq)
        windows = tokens.numel() // (micro_batch * args.seq)
        positions = unique = 0
        per_order = {n: [0, 0] for n in config.ngram_orders}
        orders = torch.tensor(config.branch_orders)
        for window in tokens[:windows * micro_batch * args.seq].view(windows, micro_batch, args.seq):
            for indices in hasher.indices_per_layer(window).values():
                positions += indices.numel()
                unique += torch.unique(indices).numel()
                for n in config.ngram_orders:
                    rows = indices[..., orders == n]
                    per_order[n][0] += rows.numel()
                    per_order[n][1] += torch.unique(rows).numel()
        per_row = 8 + 2 * 4 * width  # request id, the row, its gradient
        without = positions / windows * off_rank * per_row
        with_dedup = unique / windows * off_rank * per_row
        print(json.dumps({"micro_batch": micro_batch, "seq": args.seq, "microbatches": windows,
                          "positions_per_microbatch": positions // windows,
                          "distinct_rows_per_microbatch": unique // windows,
                          "dedup_ratio": round(positions / unique, 3),
                          "dedup_ratio_per_order": {n: round(p / u, 2) for n, (p, u) in per_order.items()},
                          "exchange_MB_per_microbatch_without_dedup": round(without / 1e6, 1),
                          "exchange_MB_per_microbatch_with_dedup": round(with_dedup / 1e6, 1)}))


if __name__ == "__main__":
    main()
