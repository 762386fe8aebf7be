"""What an engine's run is to the training loop, and the set-up both engines share.

An engine (`fe_megatron.megatron.engine`, `fe_megatron.deepspeed.engine`) builds its run object,
an `EngineRun`, in its ``set_up``, in the same order in both:

1. its process groups;
2. `table_plan`, then `fe_megatron.checkpoint.resume.start_run`: the tokenizer against the
   embedding, the run info, where the run starts, the resume guards, the schedule in force and
   the datasets;
3. its model, the tables' store when the plan says so (before the model moves to the device),
   a frozen backbone (`freeze_backbone`), its optimizer with the tables as a member (the
   parameter groups of `fe_megatron.training.param_groups`) and its schedule
   (`fe_megatron.training.lr_schedule`);
4. the checkpoint's state, when it resumes;
5. `begin`: the start record.

`fe_megatron.training.loop.train` then drives the run.  Nothing here imports megatron or deepspeed.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from fe_megatron.tables.host_allocator import keep_freed_host_memory
from fe_megatron.tables.lookahead import HOST_POSITION_IDS, HOST_TOKENS
from fe_megatron.tables.plan import TablePlan
from fe_megatron.training.distributed import current_device, log

REQUEUE_MARKER = "requeue_requested"


@dataclasses.dataclass
class StepResult:
    """One optimizer step: the LM and sparsity losses (global means), the gradient norm, whether the
    update was applied, and, when the loss or the gradient norm was not finite, where."""

    lm_loss: float
    sparsity_loss: float
    grad_norm: float
    updated: bool
    nonfinite: list = dataclasses.field(default_factory=list)  # "rank R microbatch M: lm loss nan", ...

    def __iter__(self):  # lm, sparsity, grad_norm, updated = train_step(...)
        return iter((self.lm_loss, self.sparsity_loss, self.grad_norm, self.updated))


@dataclasses.dataclass
class EngineRun:
    """What `train` needs of an engine's run (set up, possibly resumed).  An engine's run is a
    dataclass that adds its own fields (model, optimizer, ...) to these and implements the
    methods below that raise NotImplementedError; the data each rank reads is the same for
    every engine."""

    cfg: object  # the resolved TrainConfig
    info: dict  # the run info saved with every checkpoint (`fe_megatron.checkpoint.run_info`)
    datasets: tuple  # train, validation, test
    num_microbatches: int  # per data-parallel rank and step
    metrics: object  # the MetricsWriter
    start_step: int
    parameters: int  # of the whole model, every shard counted once

    @property
    def samples_per_rank(self) -> int:
        return self.num_microbatches * self.cfg.training.micro_batch_size

    def data_parallel_rank(self) -> int:
        raise NotImplementedError

    def batch_attention_mask(self):
        """The attention mask every batch carries (None: the model makes its own causal mask)."""
        return None

    def batches(self, dataset, first_sample: int, num_microbatches: int) -> list:
        """``num_microbatches`` microbatches of this data-parallel rank, from global sample ``first_sample``."""
        from fe_megatron.data.datasets import microbatches

        t = self.cfg.training
        start = first_sample + self.data_parallel_rank() * self.samples_per_rank
        batches = microbatches(dataset, start, num_microbatches, t.micro_batch_size, self.batch_attention_mask())
        device = current_device()
        on_device = [{k: v.to(device) for k, v in b.items() if v is not None} for b in batches]
        if self.fetches_rows_ahead:  # the host tier hashes each microbatch on the host, from these ids
            for batch, host in zip(on_device, batches):
                batch[HOST_TOKENS], batch[HOST_POSITION_IDS] = host["tokens"], host["position_ids"]
        return on_device

    @property
    def fetches_rows_ahead(self) -> bool:
        """Whether each microbatch's table rows are fetched from host memory one microbatch ahead
        (`fe_megatron.tables.lookahead`): the table plan's decision (`TablePlan.lookahead`)."""
        plan = table_plan(self.cfg)
        return plan is not None and plan.lookahead

    def evaluation_batches(self, dataset, index: int) -> list:
        """This rank's microbatches of the ``index``-th window of ``eval_steps`` global batches of
        ``dataset``: of each global batch, this rank's share, as in training.  Over all ranks that is
        the same samples in the same microbatches at every layout, so the validation loss is too."""
        t = self.cfg.training
        first = index * t.global_batch_size * t.eval_steps
        return [batch for step in range(t.eval_steps)
                for batch in self.batches(dataset, first + step * t.global_batch_size, self.num_microbatches)]

    def train_step(self, batches: list) -> StepResult:
        raise NotImplementedError

    def advance_schedule(self) -> None:
        raise NotImplementedError

    def learning_rate(self) -> float:
        raise NotImplementedError

    def evaluate(self, dataset, index: int) -> float:
        raise NotImplementedError

    def save(self, step: int) -> None:
        raise NotImplementedError


def table_plan(cfg, bf16_run: bool = False, stage_without_memory: bool = False):
    """fe-pretrain's `TablePlan` of the run, None without memory."""
    return None if cfg.memory is None else TablePlan.for_run(cfg, bf16_run, stage_without_memory, fe_pretrain=True)


def load_run_tokenizer(cfg):
    """The run's tokenizer, refused when the embedding does not cover it."""
    from fe_megatron.data.sources import DataError
    from fe_megatron.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.data.tokenizer_model)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(f"data.tokenizer_model {cfg.data.tokenizer_model} has {tokenizer.vocab_size} tokens but "
                        f"model.vocab_size={cfg.model.vocab_size}; the embedding must cover the tokenizer "
                        f"(set model.vocab_size >= {tokenizer.vocab_size})")
    return tokenizer


def run_datasets(cfg, tokenizer, data_parallel_size: int) -> tuple:
    """Train, validation and test datasets sized for the whole run (every engine reads the same
    samples: global batch ``i`` is samples ``[i B, (i + 1) B)``, split over data-parallel ranks in
    rank order)."""
    from fe_megatron.data.datasets import build_datasets

    t, m = cfg.training, cfg.model
    if t.global_batch_size % (t.micro_batch_size * data_parallel_size):
        raise ValueError(f"training.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size x "
                         f"data-parallel size = {t.micro_batch_size} x {data_parallel_size}")
    evals = t.train_steps // max(t.eval_interval, 1) + 2
    sizes = [t.train_steps * t.global_batch_size, evals * t.eval_steps * t.global_batch_size,
             t.eval_steps * t.global_batch_size]
    return build_datasets(cfg.data.train_data, tokenizer, m.seq_length, cfg.data.split, sizes, t.seed,
                          cfg.data.cache_dir, cfg.data.reset_position_ids, cfg.data.reset_attention_mask)


def freeze_backbone(model) -> None:
    """``training.freeze_backbone``: train the memory branches only (after a graft onto a pretrained
    model); every other weight keeps its value and gets no gradient or optimizer state."""
    trainable = 0
    for name, param in model.named_parameters():
        param.requires_grad = ".memory." in name
        trainable += param.numel() if param.requires_grad else 0
    if not trainable:
        raise ValueError("training.freeze_backbone=true but the model has no memory branch to train "
                         "(memory: null); set freeze_backbone=false")


def use_bf16(training, on_gpu: bool) -> bool:
    """``training.precision``: bf16, fp32, or (``auto``) bf16 on GPUs and fp32 on CPUs."""
    return training.precision == "bf16" or (training.precision == "auto" and on_gpu)


def microbatches_per_rank(training, data_parallel_size: int) -> int:
    """Microbatches each data-parallel rank runs per step (`run_datasets` checked the division)."""
    return training.global_batch_size // (training.micro_batch_size * data_parallel_size)


def begin(run: "EngineRun", summary: str, **event) -> None:
    """The start of a set-up run, for both engines: answer an earlier stop's requeue request
    (remove its marker), write the ``start`` record and log ``summary``."""
    cfg = run.cfg
    if cfg.save and torch.distributed.get_rank() == 0 and os.path.exists(os.path.join(cfg.save, REQUEUE_MARKER)):
        os.remove(os.path.join(cfg.save, REQUEUE_MARKER))
    run.metrics.write({"event": "start", "kind": cfg.model_kind, "parameters": run.parameters,
                       "start_step": run.start_step, **event})
    log(f"model {cfg.model_kind}: {run.parameters:,} parameters; {summary}; {run.num_microbatches} microbatch{'es' if run.num_microbatches != 1 else ''} of "
        f"{cfg.training.micro_batch_size} x {cfg.model.seq_length} tokens per rank and step")
    if cfg.memory is not None and (cfg.memory.table_placement == "host" or not torch.cuda.is_available()):
        log(keep_freed_host_memory())  # the tables' host work allocates large buffers every step
    log(conversion_notice(cfg))


def conversion_notice(cfg) -> str:
    """Whether the run's checkpoints will convert to Hugging Face, and why not (said at start-up, not
    first by fe-convert after the run)."""
    converter = "deepspeed-to-hf" if cfg.training.engine == "deepspeed" else "mcore-to-hf"
    if cfg.model.num_experts:
        return (f"checkpoints will not convert to Hugging Face: the backbone has {cfg.model.num_experts} experts per "
                "layer (model.num_experts) and the Hugging Face model's FFN is dense")
    return f"checkpoints convert to Hugging Face with fe-convert {converter}"
