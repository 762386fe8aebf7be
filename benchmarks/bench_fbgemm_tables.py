"""The tables' training step against FBGEMM's table-batched embeddings, on the same tables and ids.

    pip install --no-deps fbgemm-gpu-cpu==1.8.0   # the release that loads beside torch 2.13
    python benchmarks/bench_fbgemm_tables.py [--sizes demo,340m-width-small,340m-layer] [--iters 20] [--busy-cores 1]

One iteration is what a training step does to one memory layer's tables: gather the rows of every
position and branch (forward), take a gradient for them (backward), and apply row-wise AdaGrad
to the rows that were read.  Both sides run it on the same tables (one table per branch, the
branch layout of a FactorEngram layer: the unigram table and each hash head's bigram and
trigram table), the same ids (a layer's n-gram addresses of token ids drawn from a Zipf
distribution, so rows repeat as in text) and the same output gradient:

* FBGEMM: ``SplitTableBatchedEmbeddingBagsCodegen`` on the CPU, ``PoolingMode.NONE`` (one row per
  position: sequence embeddings, as the memory reads them) and ``EXACT_ROWWISE_ADAGRAD`` fused into
  the backward.  Its CPU build has no Adam.
* fe_megatron: the layer's tables in one `TableStore` buffer with row gradients kept by row, a
  `StoreLookup` (the gather and its backward, `fe_megatron.ops`), and `RowwiseAdagrad` at the step
  (``optimizer.table_update: rowwise_adagrad``): the code a training run executes.

Before timing, one iteration of each is checked to give the same tables (within 1e-5): the two
implement one rule.  Reported: microseconds per iteration, rows updated per second, and our
speed over FBGEMM's, measured in the same process.

``--busy-cores N`` starts N processes that each keep one core busy for the whole measurement (a host
shared with data loaders and other jobs, as the host tier's rows are in a real run); both sides
then run at torch's default thread count, as a training process would.

Sizes: ``demo`` is ``make demo``'s layer (6 branches of width 32, 73,868 rows, 8 x 128 tokens);
``340m-width-small`` the 340M preset's width (12 branches of 256) with a tenth of its rows;
``340m-layer`` one whole layer of the 340M preset (2.13M rows x 256: 0.55B parameters, 2.2 GB per
copy) at 4,096 tokens.
"""

import argparse
import json
import platform
import time
import warnings

import torch

from host_load import busy_cores  # this folder is on the path when the script runs

warnings.filterwarnings("ignore")

SIZES = {
    "demo": dict(preset="factorengram-tiny", tokens=8 * 128, row_fraction=1.0),
    "340m-width-small": dict(preset="factorengram-340m", tokens=4096, row_fraction=0.1),
    "340m-layer": dict(preset="factorengram-340m", tokens=4096, row_fraction=1.0),
}
LR, EPS = 0.05, 1e-8


def layer_ids(preset: str, tokens: int, row_fraction: float, seed: int = 0):
    """``(rows per branch, width, ids [tokens, branches] local to each branch)`` of one memory layer,
    the token ids Zipf-distributed over the vocabulary."""
    from fe_megatron.config import MemoryConfig
    from fe_megatron.ngram import NgramHasher

    config = MemoryConfig.from_preset(preset)
    layout = NgramHasher(config, config.layers[0]).layouts[0]
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, config.vocab_size + 1, dtype=torch.float64)
    token_ids = torch.multinomial(1.0 / ranks, tokens, replacement=True, generator=gen).view(1, tokens)
    ids = NgramHasher(config, config.layers[0]).indices(token_ids)[0] - torch.tensor(layout.offsets)
    rows = [max(1, int(m * row_fraction)) for m in layout.moduli]
    return rows, config.branch_width, ids % torch.tensor(rows)


def fbgemm_tables(rows: list, width: int, weights: list):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice, OptimType,
                                                                         SplitTableBatchedEmbeddingBagsCodegen)

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, width, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in rows],
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR, eps=EPS, pooling_mode=PoolingMode.NONE,
        device="cpu")
    for table, weight in zip(tbe.split_embedding_weights(), weights):
        table.copy_(weight)
    return tbe


class OurTables:
    """One layer's tables in a store, trained with row-wise AdaGrad (what a training run builds)."""

    def __init__(self, rows: list, width: int, weights: list):
        from fe_megatron.tables.sparse_update import RowwiseAdagrad
        from fe_megatron.tables.store import TableStore

        self.offsets = torch.tensor([sum(rows[:b]) for b in range(len(rows))])
        self.store = TableStore(torch.cat(weights), "device")
        self.store.allocate_row_gradients()
        self.optimizer = RowwiseAdagrad([self.store], lr=LR, eps=EPS)

    def step(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        from fe_megatron.tables.store import StoreLookup

        lookup = StoreLookup(self.store, ids + self.offsets, torch.device("cpu"))
        rows = lookup.rows()  # [tokens, branches, width]
        rows.backward(grad)
        self.optimizer.step()
        self.store.row_gradients.clear()

    def weights(self, rows: list) -> list:
        return list(self.store.weight.split(rows))


def fbgemm_step(tbe, ids: torch.Tensor, grad_table_major: torch.Tensor) -> None:
    flat = ids.t().contiguous().view(-1)  # table-major: every position of table 0, then table 1, ...
    offsets = torch.arange(flat.numel() + 1, dtype=torch.int64)
    out = tbe(flat, offsets)  # [tables x positions, width]
    out.backward(grad_table_major)  # the update runs inside the backward


def measure(size: str, iters: int) -> dict:
    spec = SIZES[size]
    rows, width, ids = layer_ids(spec["preset"], spec["tokens"], spec["row_fraction"])
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(r, width, generator=gen) * 0.1 for r in rows]
    grad = torch.randn(ids.shape[0], ids.shape[1], width, generator=gen)  # [tokens, branches, width]
    grad_table_major = grad.transpose(0, 1).reshape(-1, width).contiguous()
    ours, tbe = OurTables(rows, width, weights), fbgemm_tables(rows, width, weights)
    del weights
    ours.step(ids, grad)  # one checked iteration: the same rule gives the same tables
    fbgemm_step(tbe, ids, grad_table_major)
    worst = max(float((a - b).abs().max()) for a, b in zip(ours.weights(rows), tbe.split_embedding_weights()))
    assert worst < 1e-5, f"fe_megatron and FBGEMM disagree after one step by {worst}"
    unique = int(sum(torch.unique(ids[:, b]).numel() for b in range(ids.shape[1])))
    timings = {}
    runs = (("fbgemm", lambda: fbgemm_step(tbe, ids, grad_table_major)), ("ours", lambda: ours.step(ids, grad)),
            ("fbgemm_again", lambda: fbgemm_step(tbe, ids, grad_table_major)))
    for name, run in runs:
        run()
        start = time.perf_counter()
        for _ in range(iters):
            run()
        timings[name] = (time.perf_counter() - start) / iters
    fbgemm = min(timings["fbgemm"], timings["fbgemm_again"])  # before and after ours: the better of the two
    return {"size": size, "tables": len(rows), "width": width, "rows": sum(rows), "parameters": sum(rows) * width,
            "positions": ids.numel(), "unique_rows": unique, "max_abs_difference_after_one_step": worst,
            "fbgemm_us": round(fbgemm * 1e6, 1), "ours_us": round(timings["ours"] * 1e6, 1),
            "ours_rows_per_s": round(unique / timings["ours"]), "fbgemm_rows_per_s": round(unique / fbgemm),
            "speed_ours_over_fbgemm": round(fbgemm / timings["ours"], 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="demo,340m-width-small,340m-layer")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--busy-cores", type=int, default=0,
                        help="processes that each keep one core busy while both sides are measured")
    parser.add_argument("--allocator", choices=("keep", "system"), default="keep",
                        help="keep: malloc keeps freed host memory, as a training run sets it "
                             "(fe_megatron.tables.host_allocator); system: glibc's defaults")
    args = parser.parse_args()
    try:
        import fbgemm_gpu  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"bench_fbgemm_tables.py needs FBGEMM's CPU build: pip install --no-deps "
                         f"fbgemm-gpu-cpu==1.8.0 (1.9.0 does not load beside torch 2.13) ({err})")
    import fbgemm_gpu

    from fe_megatron.tables.host_allocator import keep_freed_host_memory

    # as a training run with host tables starts (fe_megatron.training.run.begin); both sides then run with it
    allocator = keep_freed_host_memory() if args.allocator == "keep" else "host allocator: the system's"
    for size in args.sizes.split(","):
        with busy_cores(args.busy_cores):
            result = measure(size, args.iters)
        result.update(device=f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
                      busy_cores=args.busy_cores, allocator=allocator,
                      date=time.strftime("%Y-%m-%d"), torch=torch.__version__, fbgemm=fbgemm_gpu.__version__)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
