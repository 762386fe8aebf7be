"""fe-pretrain's DeepSpeed engine (``training.engine: deepspeed``): the Hugging Face model
(`fe_megatron.hf.FactorEngramForCausalLM`) trained with ``deepspeed.initialize`` under ZeRO stage
0-3, on the data, schedule and logging of the Megatron engine (`fe_megatron.training`).

What each rank does per step, for the ``n`` microbatches of its share of the global batch (the
same samples the Megatron engine reads at the same data-parallel size):

* forward through the DeepSpeed engine; the loss is the masked mean next-token loss plus
  ``lambda`` times the sparsity term (Eq. 13), as Megatron's;
* ``engine.backward`` and ``engine.step`` per microbatch (DeepSpeed accumulates and updates at the
  boundary); the learning rate of each parameter group is set first from `fe_megatron.training.lr_schedule`;
* with the tables outside ZeRO (row-sharded, or whole in stores), their own optimizer runs after
  the boundary (`fe_megatron.deepspeed.tables`), clipped by one norm with ZeRO's parameters
  (`fe_megatron.deepspeed.clipping`); with the host tier each microbatch's rows are fetched one
  microbatch ahead (`fe_megatron.tables.lookahead`).

The optimizer is torch's AdamW with Megatron's parameter groups (no weight decay on biases and
1-D tensors; the tables' learning-rate and weight-decay multipliers), handed to DeepSpeed as a
client optimizer, which ZeRO wraps.  Table modes:

* ``zero`` (or ``replicated`` with fp32 tables on the device and fp32 state): the tables are
  ordinary parameters; ZeRO-3 partitions them and all-gathers each one whole for its layer's
  forward and backward.
* ``rows``: the tables are row-sharded over the data-parallel ranks and stay outside ZeRO.
* ``replicated`` with table stores (bf16 tables, the host tier, bf16 state): whole tables on every
  rank, outside ZeRO.

Checkpoints are DeepSpeed's (``engine.save_checkpoint``, tag ``iter_NNNNNNN``), with
``fe_run.json`` and, for tables outside ZeRO, the tables' checkpoint of every engine (``fe_tables/``,
`fe_megatron.megatron.table_checkpoint`) in the same folder,
committed as the Megatron engine's are (`fe_megatron.checkpoint.commit`) before ``latest`` and the
tracker name them.  They resume at any data-parallel size (`fe_megatron.deepspeed.resize`).
``--load`` also accepts a Hugging Face model directory: its weights start the run at step 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist

from fe_megatron.checkpoint.commit import agree_on_failure, commit, find_checkpoint, start_save
from fe_megatron.checkpoint.files import CheckpointError, has_tables_beside, write_run_info
from fe_megatron.checkpoint.reader import DEEPSPEED_LATEST, find_checkpoint_folder
from fe_megatron.checkpoint.resume import start_run
from fe_megatron.deepspeed.clipping import JointClipping
from fe_megatron.deepspeed.config import resolve, zero_stage
from fe_megatron.deepspeed.resize import needs_universal_copy, remove_universal_copy, universal_copy
from fe_megatron.deepspeed.shm_buffers import FOLDER, remove_dead_buffers, remove_own_buffer
from fe_megatron.tables.lookahead import MEMORY_INPUTS, MicrobatchLookups, microbatch_feed
from fe_megatron.memory.loss import weighted_sparsity
from fe_megatron.tables.plan import TablePlan
from fe_megatron.memory.sharding import ROW_SHARDED
from fe_megatron.training.distributed import current_device, destroy_process_groups, log
from fe_megatron.training.loop import MetricsWriter
from fe_megatron.training.losses import masked_mean, nonfinite_microbatch, nonfinite_report, per_token_cross_entropy
from fe_megatron.training.param_groups import parameter_groups
from fe_megatron.training.lr_schedule import learning_rate
from fe_megatron.training.run import (EngineRun, StepResult, begin, freeze_backbone, microbatches_per_rank,
                                      table_plan, use_bf16)


@dataclasses.dataclass
class DeepSpeedRun(EngineRun):
    """A DeepSpeed run, set up and possibly resumed; the `fe_megatron.training.loop.EngineRun` of
    this engine."""

    engine: object  # deepspeed.DeepSpeedEngine around the FactorEngramForCausalLM
    tables: object  # StoredTables, or None when ZeRO holds the tables
    clipping: object  # JointClipping: the step's norm over the engine and the tables outside ZeRO
    step_index: int = 0  # the next optimizer step (0-based), which sets the learning rate

    def data_parallel_rank(self) -> int:
        return dist.get_rank()  # every rank is a data-parallel rank

    def _set_learning_rates(self) -> None:
        """Every group's rate and weight decay from the schedule in force (``info["schedule"]``:
        the config's, or a resumed checkpoint's), times the group's multipliers."""
        schedule = self.info["schedule"]
        groups = list(self.engine.optimizer.param_groups)
        if self.tables is not None:
            groups += self.tables.optimizer.param_groups
        for group in groups:
            mult = group.get("lr_mult", 1.0)
            group["lr"] = learning_rate(self.step_index, schedule["lr"] * mult, schedule["min_lr"] * mult,
                                        schedule["warmup_steps"], schedule["decay_steps"])
            group["weight_decay"] = schedule["weight_decay"] * group.get("wd_mult", 1.0)

    def _losses(self, batch: dict):
        output = self.engine(input_ids=batch["tokens"], position_ids=batch["position_ids"], use_cache=False,
                             memory_inputs=batch.get(MEMORY_INPUTS))
        lm = masked_mean(per_token_cross_entropy(output.logits, batch["labels"]), batch["loss_mask"])
        memory = self.cfg.memory
        if output.sparsity_loss is None or memory is None:
            return lm, torch.zeros((), device=lm.device)
        return lm, weighted_sparsity(output.sparsity_loss, memory.sparsity_lambda)  # Eq. 13

    def microbatch_feed(self, batches: list) -> MicrobatchLookups:
        """The step's microbatches (the feed both engines share); with the host tier each one's rows
        fetched one microbatch ahead."""
        model = self.engine.module
        return microbatch_feed(
            batches, lambda tokens, positions: model.start_memory_lookups(tokens, current_device(), positions))

    def train_step(self, batches: list) -> StepResult:
        self._set_learning_rates()
        sums = torch.zeros(3, dtype=torch.float64, device=current_device())  # lm, sparsity, non-finite count
        nonfinite = []
        feed = self.microbatch_feed(batches)
        for index, batch in enumerate(feed):
            lm, sparsity = self._losses(batch)
            feed.start_next()  # this microbatch's forward is issued: fetch the next one's rows (host tier)
            loss = lm + sparsity
            if not torch.isfinite(loss):
                nonfinite.append(nonfinite_microbatch(index, float(lm)))
            sums += torch.stack([lm.detach().double(), sparsity.detach().double(),
                                 torch.tensor(float(not torch.isfinite(loss)), dtype=torch.float64,
                                              device=sums.device)])
            self.engine.backward(loss)
            if index == len(batches) - 1:
                dist.all_reduce(sums)  # halt before the update, on every rank alike
                if sums[2] > 0:
                    return self._nonfinite(sums, nonfinite)
                self.clipping.begin_step()  # the tables' norm, which the engine's step clips by too
            self.engine.step()  # updates at the gradient-accumulation boundary only
        norm = self.engine.get_global_grad_norm()
        clip_by, norm = self.clipping.norms(float(norm) if norm is not None else 0.0)
        if self.tables is not None:  # clipped by the one norm of every gradient
            if math.isfinite(norm):
                self.tables.step(clip_by)
            else:  # DeepSpeed skipped its update (or took a zero one): the tables take none
                self.tables.tables.zero_grad()
        count = len(batches) * dist.get_world_size()
        result = StepResult(float(sums[0]) / count, float(sums[1]) / count, norm, True)
        if not math.isfinite(norm):
            tables = ", and the tables outside ZeRO took none" if self.tables is not None else ""
            result.updated, result.nonfinite = False, [
                f"every microbatch's loss is finite but the gradient norm is {norm}; DeepSpeed skipped its update "
                f"or applied a zero gradient (ZeRO clips by an infinite norm; without ZeRO the gradients were "
                f"zeroed){tables}"]
        return result

    def _nonfinite(self, sums, mine: list) -> StepResult:
        count = dist.get_world_size() * self.num_microbatches
        lm = float(sums[0]) / count
        return StepResult(lm, float(sums[1]) / count, float("nan"), False, nonfinite_report(mine, lm, float("nan")))

    def advance_schedule(self) -> None:
        self.step_index += 1

    def learning_rate(self) -> float:
        """The rate of the next step (as Megatron's scheduler reports it after stepping)."""
        schedule = self.info["schedule"]
        return learning_rate(self.step_index, schedule["lr"], schedule["min_lr"], schedule["warmup_steps"],
                             schedule["decay_steps"])

    @torch.no_grad()
    def evaluate(self, dataset, index: int) -> float:
        batches = self.evaluation_batches(dataset, index)
        self.engine.eval()
        try:
            total = torch.zeros(2, dtype=torch.float64, device=current_device())
            for batch in self.microbatch_feed(batches):
                lm, _ = self._losses(batch)
                total += torch.stack([lm.double(), torch.ones((), dtype=torch.float64, device=total.device)])
        finally:
            self.engine.train()
        dist.all_reduce(total)
        return float(total[0] / total[1].clamp_min(1))

    def save(self, step: int) -> None:
        save_checkpoint(self, step)


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(run: DeepSpeedRun, step: int) -> str:
    """DeepSpeed's checkpoint of ``step``, committed like every engine's
    (`fe_megatron.checkpoint.commit`): DeepSpeed's files, then ``fe_run.json`` and the row-sharded
    tables, written under ``iter_NNNNNNN.tmp``, checksummed, renamed, named by DeepSpeed's
    ``latest`` and then by the tracker; older ones beyond ``training.keep_checkpoints`` are deleted."""
    cfg = run.cfg
    tmp = start_save(cfg.save, step)
    error = None
    try:
        run.engine.save_checkpoint(cfg.save, tag=os.path.basename(tmp), client_state={"step": step},
                                   save_latest=False)
        if dist.get_rank() == 0:
            write_run_info(tmp, dict(run.info, step=step))
        if run.tables is not None:
            run.tables.save(tmp)
    except Exception as err:  # noqa: BLE001 - any rank's failure must keep the tracker where it is
        error = err
    agree_on_failure(error, tmp, step)
    folder = commit(tmp, cfg.save, step, cfg.training.keep_checkpoints,
                    before_tracker=lambda final: write_deepspeed_latest(cfg.save, final))
    log(f"saved {folder}")
    return folder


def write_deepspeed_latest(directory: str, folder: str) -> None:
    """Point DeepSpeed's ``latest`` (read by its own tools, e.g. zero_to_fp32) at ``folder``,
    atomically, before the tracker moves: a stop in between leaves both naming complete checkpoints."""
    path = os.path.join(directory, DEEPSPEED_LATEST)
    with open(path + ".tmp", "w") as fh:
        fh.write(os.path.basename(folder))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


def find_deepspeed_checkpoint(cfg):
    """``find(directory)`` for `fe_megatron.checkpoint.resume.start_point`: the tracker's checkpoint,
    verified by all ranks (per ``training.on_corrupt_checkpoint``); for a run saved before
    checkpoints had manifests and a tracker, the one DeepSpeed's ``latest`` names, unverified."""
    def find(directory: str):
        folder = find_checkpoint(directory, cfg.training.on_corrupt_checkpoint, log)
        if folder is None and os.path.isfile(os.path.join(directory, DEEPSPEED_LATEST)):
            folder = find_checkpoint_folder(directory, engine="deepspeed")
            log(f"{folder} was saved before checkpoints had checksums: loading it unverified")
        return folder
    return find


def untie_step_counters(optimizer) -> None:
    """A universal load hands every parameter group's Adam state one shared ``step`` tensor, which
    AdamW then advances once per group and step (skewing the bias correction): give each its own."""
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def saved_data_parallel_size(saved_info, default: int) -> int:
    """The data-parallel size that wrote a checkpoint (its run info's layout), or ``default``
    for one saved before run infos recorded it."""
    return int(((saved_info or {}).get("layout") or {}).get("data", default))


def refuse_table_mode_change(folder: str, saved_info, plan) -> None:
    """Under DeepSpeed the tables are ZeRO parameters, or outside ZeRO in a checkpoint of their own; a
    checkpoint resumes in the mode that wrote it (`TablePlan.saved_mode` against this run's ``plan``;
    the data-parallel size may change).  Outside ZeRO, row-sharded and whole tables load each other's
    checkpoints when those are by global row (``fe_tables/``, `fe_megatron.megatron.table_checkpoint`);
    the per-rank files written before them are read in the mode that wrote them."""
    saved = TablePlan.saved_mode(saved_info)
    if saved is None or plan is None or saved == plan.mode:
        return
    outside_zero = {ROW_SHARDED, "replicated"}
    if {saved, plan.mode} <= outside_zero and has_tables_beside(folder):
        return
    sharding = ((saved_info or {}).get("layout") or {}).get("table_sharding")
    raise CheckpointError(f"{folder} was saved with its tables {_TABLE_MODES[saved]}, and this run keeps them "
                          f"{_TABLE_MODES[plan.mode]}: resume with the table settings it was saved with "
                          f"(parallel.table_sharding={sharding}), or start a new run from its weights "
                          "(fe-convert deepspeed-to-hf, then --load the output)")


_TABLE_MODES = {"zero": "as ZeRO parameters (parallel.table_sharding zero, or replicated with fp32 tables)",
                ROW_SHARDED: "row-sharded outside ZeRO (parallel.table_sharding rows)",
                "replicated": "whole outside ZeRO (parallel.table_sharding replicated with bf16 tables, the host tier, "
                              "bf16 table state or a sparse table update)"}


# ----------------------------------------------------------------------------- model
def build_model(cfg, memory_parallel_group=None):
    """The run's `FactorEngramForCausalLM` (a plain Llama-like model with ``memory: null``), its
    branches row-sharded over ``memory_parallel_group`` when given."""
    from fe_megatron.hf import FactorEngramConfig, FactorEngramForCausalLM
    from fe_megatron.memory import ParallelHooks

    config = FactorEngramConfig.from_fe_megatron(cfg.model, cfg.memory, use_cache=False)
    hooks = None
    if memory_parallel_group is not None:
        hooks = ParallelHooks()
        hooks.memory_parallel_group = memory_parallel_group
    return FactorEngramForCausalLM(config, memory_parallel=hooks)


@torch.no_grad()
def load_hf_weights(model, directory: str) -> None:
    """Copy a Hugging Face directory's weights into ``model``, tensor by tensor (row-sharded tables:
    only this rank's rows are read)."""
    from transformers import AutoConfig

    from fe_megatron.hf.safetensors_stream import SafetensorsSource
    from fe_megatron.memory import MemoryBranch

    theirs = AutoConfig.from_pretrained(directory).to_dict()
    ours = model.config.to_dict()
    if (theirs.get("memory") or {}).get("table_dtype") == "fp8":
        raise CheckpointError(f"--load {directory} stores its tables as fp8, a serving format (fe-convert "
                              "--table-dtype); start from a conversion with fp32 or bf16 tables")
    # the tables' storage is not the model: fp32 weights start a bf16-table run, rounded to nearest
    storage = ("table_dtype", "table_placement")
    theirs, ours = ({**config, "memory": {k: v for k, v in (config.get("memory") or {}).items() if k not in storage}
                     if config.get("memory") is not None else None} for config in (theirs, ours))
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "tie_word_embeddings", "memory")
    differ = [f"{name}: {theirs.get(name)!r} there, {ours.get(name)!r} in this config" for name in fields
              if theirs.get(name) != ours.get(name)]
    if differ:
        raise CheckpointError(f"--load {directory} is a different model:\n  " + "\n  ".join(differ))
    source = SafetensorsSource(directory)
    partitions = {f"{name}.tables.weight": module.row_partition for name, module in model.named_modules()
                  if isinstance(module, MemoryBranch) and module.row_partition is not None}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name not in source:
            raise CheckpointError(f"--load {directory} has no tensor {name}")
        if name in partitions:
            for first, rows, local in partitions[name].slices():
                tensor[local:local + rows].copy_(source.rows(name, first, first + rows))
        else:
            tensor.copy_(source.get(name))
    source.close()


# ----------------------------------------------------------------------------- set-up
# What DeepSpeed prints with print() that tells a user nothing: its shared-memory all-reduce for CPUs,
# compiled on first use, announces itself on every rank; BF16_Optimizer reports the memory in use
# before and after it builds each parameter group (see_memory_usage(force=True)), on rank 0
KNOWN_DEEPSPEED_NOTICES = tuple(re.compile(pattern) for pattern in (
    r"^DeepSpeed \S+ built successfully$",
    r"^(begin bf16_optimizer|end bf16_ optimizer|(before|after) initializing group \d+)$",
    r"^MA [\d.]+ GB\s+Max_MA [\d.]+ GB\s+CA [\d.]+ GB\s+Max_CA [\d.]+ GB\s*$",
    r"^CPU Virtual Memory:  used = [\d.]+ GB, percent = [\d.]+%$",
))


@contextlib.contextmanager
def known_notices_dropped():
    """Run the block with DeepSpeed's `KNOWN_DEEPSPEED_NOTICES` left out of stdout; every other line
    it printed is printed after it, also when it raised (so it appears when the block ends, and not
    at all if the process dies inside it; stderr and DeepSpeed's logger are not held)."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        for line in printed.getvalue().splitlines():
            if not any(notice.match(line) for notice in KNOWN_DEEPSPEED_NOTICES):
                print(line, flush=True)


_ENGINES: list = []  # the engines set_up made in this process, for shut_down


def import_deepspeed():
    """``deepspeed``, told it runs on the CPU when there is no GPU (rather than guessing, and
    warning on every rank that it could not detect one)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    return deepspeed


def _init_distributed(timeout_minutes: float) -> None:
    """The process group from the launcher (torchrun, the deepspeed launcher, srun, or none):
    nccl on GPU, gloo on CPU, failing a collective after ``timeout_minutes`` without its peers;
    DeepSpeed's communication wraps it."""
    deepspeed = import_deepspeed()

    from fe_megatron.training.distributed import init_process_group, launcher_environment

    launcher_environment()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout_minutes)
    if not torch.cuda.is_available() and os.environ.get("LOCAL_RANK", "0") == "0":  # once per node
        removed = remove_dead_buffers()
        if removed:
            print(f"removed {len(removed)} DeepSpeed all-reduce buffer(s) of killed runs from {FOLDER}: "
                  f"{', '.join(removed)}", flush=True)
    with known_notices_dropped():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    # ZeRO's collectives run on DeepSpeed's clone of the world group, which it would create with
    # torch's default timeout (30 minutes under gloo): made here, it gets the run's timeout
    from deepspeed.utils import groups

    if groups._WORLD_GROUP is None:
        groups._WORLD_GROUP = dist.new_group(ranks=list(range(dist.get_world_size())),
                                             timeout=timedelta(minutes=timeout_minutes))


def build_engine(deepspeed, cfg, ds_config: dict, plan, hf_weights: str = None) -> tuple:
    """``(engine, tables, parameters)``: the DeepSpeed engine around the run's model (with the weights
    of the Hugging Face directory ``hf_weights``, when given), the tables' stores outside ZeRO when
    the plan keeps them there (`StoredTables`; None otherwise), and the model's parameter count."""
    from fe_megatron.deepspeed.tables import StoredTables

    t, o = cfg.training, cfg.optimizer
    torch.manual_seed(t.seed)
    outside_zero = plan is not None and plan.mode != "zero"
    model = build_model(cfg, dist.group.WORLD if plan is not None and plan.mode == ROW_SHARDED else None)
    if hf_weights is not None:
        load_hf_weights(model, hf_weights)
    # before .to(device): tables in host memory never reach the GPU
    tables = StoredTables(model, o, plan, current_device(), seed=t.seed) if outside_zero else None
    model.to(current_device())
    if t.recompute == "full":
        model.gradient_checkpointing_enable()
    if t.freeze_backbone:
        freeze_backbone(model)
    parameters = sum(param.numel() for param in model.parameters()) + (tables.numel() if tables else 0)
    optimizer = torch.optim.AdamW(parameter_groups(model, o), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay)
    with known_notices_dropped():
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    _ENGINES.append(engine)
    return engine, tables, parameters


def load_checkpoint(engine, tables, where: str, save: str, resized: bool) -> int:
    """The state of checkpoint ``where`` in ``engine`` and ``tables`` (through a universal copy in
    ``save`` when the data-parallel size changed: ``resized``); returns its step."""
    source = universal_copy(where, save) if resized else where
    multipliers = [(group["lr_mult"], group["wd_mult"]) for group in engine.optimizer.param_groups]
    path, client_state = engine.load_checkpoint(os.path.dirname(source), tag=os.path.basename(source),
                                                load_lr_scheduler_states=False)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {where}")
    # a universal load gives every group the first group's hyperparameters: each group's own back
    for group, (lr_mult, wd_mult) in zip(engine.optimizer.param_groups, multipliers):
        group["lr_mult"], group["wd_mult"] = lr_mult, wd_mult
    if resized:
        untie_step_counters(engine.optimizer)
        remove_universal_copy(save)
    if tables is not None:
        tables.load(where)
    return int(client_state["step"])


def set_up(cfg) -> DeepSpeedRun:
    """Process group, data, model, DeepSpeed engine; resume from ``cfg.load``."""
    deepspeed = import_deepspeed()

    t, p = cfg.training, cfg.parallel
    _init_distributed(p.distributed_timeout_minutes)
    on_gpu = torch.cuda.is_available()
    bf16 = use_bf16(t, on_gpu)
    dp = dist.get_world_size()
    ds_config = resolve(cfg, dp, bf16)
    stage = zero_stage(ds_config)
    plan = table_plan(cfg)
    start = start_run(cfg, "deepspeed", dp, plan, {"engine": "deepspeed", "zero_stage": stage},
                      find_deepspeed_checkpoint(cfg),
                      lambda folder, saved, _info: refuse_table_mode_change(folder, saved, plan))
    kind, where, info = start.start_at.kind, start.start_at.folder, start.info
    resized = kind == "checkpoint" and needs_universal_copy(where, saved_data_parallel_size(start.start_at.saved, dp),
                                                            dp)
    if resized:
        ds_config.setdefault("checkpoint", {})["load_universal"] = True

    engine, tables, parameters = build_engine(deepspeed, cfg, ds_config, plan,
                                              hf_weights=where if kind == "hf" else None)
    step = 0
    if kind == "checkpoint":
        step = load_checkpoint(engine, tables, where, cfg.save, resized)
        saved_by = f", saved by {saved_data_parallel_size(start.start_at.saved, dp)} data-parallel ranks"
        log(f"resumed from {where} at iteration {step}" + (saved_by if resized else ""))
    elif kind == "hf":
        log(f"loaded the weights of {where} (a Hugging Face model); training starts at step 0")

    clipping = JointClipping(engine, tables)
    run = DeepSpeedRun(cfg=cfg, info=info, engine=engine, tables=tables, clipping=clipping, datasets=start.datasets,
                       num_microbatches=microbatches_per_rank(t, dp),
                       metrics=MetricsWriter(cfg.save, cfg.tensorboard_dir, step), start_step=step,
                       parameters=parameters, step_index=step)
    where_tables = "no memory tables"
    if plan is not None:
        where_tables = {"zero": "tables as ZeRO parameters", ROW_SHARDED: "tables row-sharded outside ZeRO",
                        "replicated": "tables whole outside ZeRO"}[plan.mode] + "; " + plan.describe()
    if tables is not None and cfg.optimizer.clip_grad > 0:
        where_tables += "; " + clipping.describe()
    begin(run, f"DeepSpeed ZeRO-{stage} over {dp} ranks, {where_tables}",
          world_size=dp, dp=dp, tp=1, pp=1, engine="deepspeed", zero_stage=stage,
          tables=plan.mode if plan is not None else None)
    return run


def shut_down() -> None:
    """DeepSpeed's engines (their ZeRO-3 hooks and helper threads), then the process groups,
    joined before Python exits (`destroy_process_groups`)."""
    while _ENGINES:
        _ENGINES.pop().destroy()
    remove_own_buffer()  # every rank reached the end: each one's file is mapped by all that need it
    destroy_process_groups()
