"""Hash, forward gather and table backward of every built backend against the torch reference.

The problem is the paper's 340M configuration (``factorengram-340m``: 2 insertion layers x
12 branches, s_b = 256, 2.13M table rows per layer) on one microbatch of a 64 x 8K batch
as a GPU sees it (``--micro-batch`` sequences of ``--seq`` tokens).  Token ids follow a
Zipf law (exponent 1.1, ranks shuffled over the vocabulary) so duplicate rows and hot rows
look like text.  Everything is measured in the same run, on the same inputs:

* ``copy``: the machine's copy bandwidth (``dst.copy_(src)`` of 1 GiB), the ceiling for a gather;
* per backend: hash, forward gather, backward into ``main_grad`` (how Megatron's DDP trains)
  and backward into a fresh dense gradient (plain autograd), and the full hash + gather +
  backward path;
* ``stock autograd``: ``F.embedding`` whose dense table gradient DDP then adds into
  ``main_grad`` (what a model does without these kernels);
* ``table AdamW``: the table optimizer's update of one rank's share of one layer's table
  (``--update-ranks``, default 32: rows sharded over 32 ranks) with rows, gradient and moments in
  ``--dtype``, what is bf16 stochastically rounded (`fe_megatron.ops.table_adamw_`), per backend
  that has the fused kernel against the torch reference.

    python benchmarks/bench_kernels.py [--micro-batch 4] [--seq 8192] [--dtype float32] [--repeats 5]
"""

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from fe_megatron import ops
from fe_megatron.config import MemoryConfig
from fe_megatron.megatron.main_grad import accumulate_into_main_grad  # Megatron's main_grad, as a run registers it
from fe_megatron.ngram import NgramHasher


def timer(device):
    """Seconds of ``fn()``: median of ``repeats`` runs after one warm-up."""
    def measure(fn, repeats):
        fn()
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - begin)
        return statistics.median(samples)
    return measure


def copy_bandwidth(measure, device, repeats) -> float:
    """GB/s of ``dst.copy_(src)`` for 1 GiB: bytes read plus bytes written."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / measure(lambda: dst.copy_(src), repeats) / 1e9


def zipf_token_ids(vocab: int, shape, exponent: float = 1.1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probabilities = ranks.pow(-exponent)
    samples = torch.multinomial(probabilities / probabilities.sum(), int(torch.tensor(shape).prod()), replacement=True,
                                generator=generator)
    return torch.randperm(vocab, generator=generator)[samples].view(shape)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="factorengram-340m")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--update-ranks", type=int, default=32, help="the table AdamW rows: one layer's over N ranks")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    measure = timer(device)
    config = MemoryConfig.from_preset(args.preset)
    hasher = NgramHasher(config)
    width = config.branch_width
    tokens = args.micro_batch * args.seq
    ids = zipf_token_ids(config.vocab_size, (args.micro_batch, args.seq)).to(device)
    tables = {layer: torch.randn(hasher.total_rows(layer), width, device=device).to(dtype) for layer in hasher.layers}
    main_grads = {layer: torch.zeros(t.shape, dtype=torch.float32, device=device) for layer, t in tables.items()}
    element = torch.tensor([], dtype=dtype).element_size()
    with ops.use_backend("torch"):
        indices = hasher.indices_per_layer(ids, validate=False)
    flat = {layer: idx.reshape(-1) for layer, idx in indices.items()}
    lookups = sum(f.numel() for f in flat.values())
    unique_rows = sum(int(f.unique().numel()) for f in flat.values())
    grads = {layer: torch.randn(f.numel(), width, device=device).to(dtype) for layer, f in flat.items()}
    table_rows = sum(t.shape[0] for t in tables.values())

    # bytes each kernel must move at least (docs/kernels.md)
    bytes_hash = tokens * 8 + lookups * 8
    bytes_gather = lookups * 8 + 2 * lookups * width * element
    bytes_backward_main = lookups * 8 * 3 + lookups * width * element + 2 * unique_rows * width * 4
    bytes_backward_dense = (lookups * 8 * 3 + lookups * width * element
                            + (table_rows + 2 * unique_rows) * width * element)

    copy_gbs = copy_bandwidth(measure, device, args.repeats)

    print(f"# {platform.node()} ({platform.processor() or platform.machine()}), "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else f'{torch.get_num_threads()} CPU threads'}, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(json.dumps(dict(preset=args.preset, tokens=tokens, dtype=args.dtype, lookups=lookups,
                          unique_rows=unique_rows, table_rows=table_rows, copy_gbs=round(copy_gbs, 1))))

    def row(backend, name, seconds, nbytes, baseline=None):
        record = dict(backend=backend, op=name, ms=round(seconds * 1e3, 3))
        if nbytes:
            record.update(gbs=round(nbytes / seconds / 1e9, 2), of_copy=round(nbytes / seconds / 1e9 / copy_gbs, 3))
        if baseline:
            record["speedup_vs_torch"] = round(baseline / seconds, 2)
        print(json.dumps(record))
        return seconds

    def gather_all():
        return [ops.gather_rows(tables[layer], indices[layer]) for layer in hasher.layers]

    def backward_into(output_of_layer):
        kernels = ops.get_backend(ops.current_backend(device, dtype)).module
        for layer in hasher.layers:
            kernels.gather_rows_backward(grads[layer], flat[layer], output_of_layer(layer), True)

    def backward_main():
        backward_into(main_grads.get)

    def backward_dense():
        backward_into(lambda layer: torch.zeros_like(tables[layer]))

    ops.register_weight_gradient_sink(accumulate_into_main_grad)  # as a Megatron run installs it in its scope

    def full_path():
        per_layer = hasher.indices_per_layer(ids, validate=False)
        for layer in hasher.layers:
            weight = tables[layer].requires_grad_(True)
            weight.main_grad, weight.grad_added_to_main_grad = main_grads[layer], False
            rows = ops.gather_rows(weight, per_layer[layer])
            rows.backward(grads[layer].view(rows.shape))
            weight.grad = None

    baseline = {}
    for backend in ops.available_backends():
        if device.type not in ops.get_backend(backend).devices:
            continue
        with ops.use_backend(backend):
            times = dict(
                hash=row(backend, "hash", measure(lambda: hasher.indices_per_layer(ids, validate=False),
                                                  args.repeats), bytes_hash, baseline.get("hash")),
                gather=row(backend, "forward gather", measure(gather_all, args.repeats), bytes_gather,
                           baseline.get("gather")),
                main=row(backend, "backward into main_grad", measure(backward_main, args.repeats),
                         bytes_backward_main, baseline.get("main")),
                dense=row(backend, "backward into a dense grad", measure(backward_dense, args.repeats),
                          bytes_backward_dense, baseline.get("dense")),
                full=row(backend, "hash + gather + backward (main_grad)", measure(full_path, args.repeats), None,
                         baseline.get("full")),
            )
        baseline = baseline or times

    def stock_autograd():
        with ops.use_backend("torch"):
            per_layer = hasher.indices_per_layer(ids, validate=False)
        for layer in hasher.layers:
            weight = tables[layer].requires_grad_(True)
            rows = F.embedding(per_layer[layer], weight)
            rows.backward(grads[layer].view(rows.shape))
            main_grads[layer].add_(weight.grad)
            weight.grad = None

    row("stock autograd", "hash + F.embedding + dense grad + main_grad.add_", measure(stock_autograd, args.repeats),
        None, baseline.get("full"))

    shard_rows = tables[hasher.layers[0]].shape[0] // args.update_ranks
    state = [tables[hasher.layers[0]][:shard_rows].clone()] + [
        torch.randn(shard_rows, width, device=device).to(dtype) * scale for scale in (1.0, 0.01, 1e-4)]
    update_args = (torch.arange(shard_rows, device=device) * args.update_ranks, 0, width,
                   torch.tensor([[1, 2], [3, 4], [5, 6]]), 1e-4, 0.9, 0.95, 1e-8, 0.01)
    bytes_update = shard_rows * width * element * 7  # read rows, gradient, 2 moments; write rows, 2 moments
    reference_seconds = None
    for backend in ["torch"] + [b for b in ops.available_backends() if b != "torch"]:
        kernels = ops.get_backend(backend)
        if device.type not in kernels.devices or (backend != "torch" and not hasattr(kernels.module, "table_adamw_")):
            continue
        seconds = measure(lambda: ops.table_adamw_(*state, *update_args, step=10, backend=backend), args.repeats)
        reference_seconds = reference_seconds or seconds
        row(backend, f"table AdamW, {shard_rows * width / 1e6:.0f}M elements ({args.dtype} rows, gradient and moments)",
            seconds, bytes_update, reference_seconds if backend != "torch" else None)


if __name__ == "__main__":
    main()
