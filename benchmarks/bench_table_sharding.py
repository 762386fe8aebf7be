"""Training tokens/s and per-rank table memory at DP=N: whole tables against row-sharded ones.

    torchrun --nproc_per_node 2 benchmarks/bench_table_sharding.py [--size small] [--steps 5]

Four runs in the same processes, on the same batches, with the same Megatron DDP + Adam path as
fe-pretrain: ``replicated`` (whole tables, their gradients all-reduced), ``rows`` (rows sharded,
looked up by all-to-all, every memory layer of the stage in one exchange started at the start of
the microbatch, `fe_megatron.tables.row_exchange.StageRowExchange`), ``rows-per-layer`` (each
layer's own exchange started at the start of the microbatch, as before the stage exchange), and
``rows-no-prefetch`` (each layer starts its own exchange when it needs the rows).  The backbone
and table sizes keep the paper's ratio of table to backbone parameters (about 3 to 1).  Each run
also counts the all-to-alls per microbatch and the bytes they move per rank.
"""

import argparse
import json
import platform
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

SIZES = {
    # 6 x d512 backbone (36M parameters) and 119M table parameters: the 340M model's 3:1 ratio
    "small": dict(backbone=dict(vocab_size=32000, hidden_size=512, num_layers=6, num_attention_heads=8,
                                ffn_hidden_size=1408, seq_length=256),
                  memory=dict(preset="factorengram-340m", table_capacity=[32000, 100_000, 100_000], coeff_width=768,
                              memory_dim=768, layers=[2, 3]), micro_batch=2, microbatches=2),
    # the demo's model
    "tiny": dict(backbone=dict(preset="tiny"), memory=dict(preset="factorengram-tiny"), micro_batch=8,
                 microbatches=2),
}
MODES = (("replicated", "replicated", True), ("rows", "rows", True), ("rows-per-layer", "rows", True),
         ("rows-no-prefetch", "rows", False))


def start_each_layer_alone(branches: dict, addresses: dict, device=None) -> dict:
    """The lookups as they were started before the stage exchange: each layer its own exchange."""
    return {index: branches[index].start_lookup(value, device) for index, value in addresses.items()}


class AllToAllCounter:
    """Counts ``dist.all_to_all_single`` calls and the bytes each rank sends through them."""

    def __init__(self):
        self.calls, self.bytes, self._real = 0, 0, dist.all_to_all_single

    def __enter__(self):
        def counted(output, input, *args, **kwargs):
            self.calls += 1
            self.bytes += input.numel() * input.element_size()
            return self._real(output, input, *args, **kwargs)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._real


def size_of(size: dict) -> tuple:
    """``(sequence length, micro-batch size)`` of a size's runs."""
    from fe_megatron.config import BackboneConfig

    return BackboneConfig.from_dict(size["backbone"]).seq_length, size["micro_batch"]


def build_training(size: dict, table_sharding: str, prefetch: bool = True, table_placement: str = "device",
                   shared_table_folder: str = "/dev/shm"):
    """``(model, ddp, optimizer, stores, plan, batches)``: the GPT model of ``size`` with its memory, its tables
    kept as the run's `TablePlan` says, Megatron DDP + Adam as in fe-pretrain, and this data-parallel rank's
    random microbatches (the same in every layout).  `bench_node_tables.py` builds its runs with it too."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.config import BackboneConfig, MemoryConfig
    from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.engine import transformer_config_for
    from fe_megatron.megatron.parallel import initialize
    from fe_megatron.megatron.step import causal_mask
    from fe_megatron.megatron.table_optimizer import manage_tables
    from fe_megatron.tables.plan import TablePlan
    from fe_megatron.training.config import OptimizerArgs, ParallelArgs, TrainConfig
    from fe_megatron.training.distributed import current_device

    backbone = BackboneConfig.from_dict(size["backbone"])
    initialize(seed=1)
    memory = MemoryConfig.from_dict(dict(size["memory"], table_placement=table_placement), backbone=backbone)
    optimizer_args = OptimizerArgs(lr=1e-4)
    cfg = TrainConfig(model=backbone, memory=memory, optimizer=optimizer_args,
                      parallel=ParallelArgs(table_sharding=table_sharding, shared_table_folder=shared_table_folder))
    tconfig = transformer_config_for(cfg, on_gpu=torch.cuda.is_available())
    model = build_gpt_model(tconfig, backbone.vocab_size, backbone.seq_length, memory, table_sharding=table_sharding,
                            prefetch_table_rows=prefetch)
    stores, plan = None, TablePlan.for_run(cfg, tconfig.bf16)
    if plan.in_stores:  # rows: the table optimizer trains them (docs/tables.md)
        stores = manage_tables(model, optimizer_args, plan, current_device(), seed=1)
    ddp = wrap_ddp(model, tconfig)
    opt = build_optimizer([ddp], OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0), tables=stores)
    connect_schedule_hooks(tconfig, [ddp], opt)
    seq, mbs = backbone.seq_length, size["micro_batch"]
    gen = torch.Generator().manual_seed(100 + parallel_state.get_data_parallel_rank())
    batches = []
    for _ in range(size["microbatches"]):
        tokens = torch.randint(0, backbone.vocab_size, (mbs, seq + 1), generator=gen)
        batches.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(mbs, seq),
                            position_ids=torch.arange(seq).expand(mbs, -1), attention_mask=causal_mask(seq)))
    return model, ddp, opt, stores, plan, batches


def run(size: dict, table_sharding: str, prefetch: bool, steps: int, per_layer: bool = False) -> dict:
    from megatron.core import parallel_state

    from fe_megatron.memory import inputs as memory_inputs
    from fe_megatron.megatron.step import train_step

    model, ddp, opt, stores, _, batches = build_training(size, table_sharding, prefetch)
    seq, mbs = size_of(size)
    stage_lookups = memory_inputs.start_lookups
    if per_layer:
        memory_inputs.start_lookups = start_each_layer_alone
    for _ in range(2):
        train_step([ddp], opt, batches, seq, mbs)
    dist.barrier()
    with AllToAllCounter() as counter:
        start = time.perf_counter()
        for _ in range(steps):
            train_step([ddp], opt, batches, seq, mbs)
        dist.barrier()
        elapsed = time.perf_counter() - start
    memory_inputs.start_lookups = stage_lookups
    tables = [layer.memory.tables.weight for layer in model.stage_memory_layers]
    state = [opt.chained_optimizers[-1].optimizer.state.get(t, {}) for t in tables]
    gradients = [layer.memory.tables.store.main_grad if stores is not None else t.main_grad
                 for layer, t in zip(model.stage_memory_layers, tables)]
    table_bytes = sum(t.numel() * 4 + g.numel() * 4 for t, g in zip(tables, gradients)) + sum(
        v.numel() * v.element_size() for s in state for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    tokens_per_step = size["microbatches"] * mbs * seq * dist.get_world_size()
    microbatches = steps * size["microbatches"]
    result = {"tokens_per_s": tokens_per_step * steps / elapsed, "table_bytes_per_rank": table_bytes,
              "step_s": elapsed / steps, "all_to_alls_per_microbatch": counter.calls / microbatches,
              "exchange_MB_per_microbatch": counter.bytes / microbatches / 2 ** 20}
    parallel_state.destroy_model_parallel()
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    results = {name: run(SIZES[args.size], sharding, prefetch, args.steps, per_layer=name == "rows-per-layer")
               for name, sharding, prefetch in MODES}
    if dist.get_rank() == 0:
        base = results["replicated"]
        print(json.dumps({"size": args.size, "ranks": dist.get_world_size(), "date": time.strftime("%Y-%m-%d"),
                          "device": f"{platform.machine()} CPU, {torch.get_num_threads()} threads per rank",
                          **{f"{name}_tokens_per_s": round(r["tokens_per_s"]) for name, r in results.items()},
                          **{f"{name}_table_MB_per_rank": round(r["table_bytes_per_rank"] / 2 ** 20)
                             for name, r in results.items()},
                          **{f"{name}_step_s": round(r["step_s"], 3) for name, r in results.items()},
                          **{f"{name}_all_to_alls_per_microbatch": r["all_to_alls_per_microbatch"]
                             for name, r in results.items() if name != "replicated"},
                          **{f"{name}_exchange_MB_per_microbatch": round(r["exchange_MB_per_microbatch"], 2)
                             for name, r in results.items() if name != "replicated"},
                          "stage_over_per_layer": round(results["rows"]["tokens_per_s"] /
                                                        results["rows-per-layer"]["tokens_per_s"], 3),
                          "rows_over_replicated": round(results["rows"]["tokens_per_s"] / base["tokens_per_s"], 3),
                          "prefetch_gain": round(results["rows"]["tokens_per_s"] /
                                                 results["rows-no-prefetch"]["tokens_per_s"], 3)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
