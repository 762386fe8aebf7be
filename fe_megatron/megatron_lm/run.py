"""``megatron.training.pretrain`` with the memory branch: what ``pretrain_gpt.py``'s and
``pretrain_hybrid.py``'s mains do, plus the FactorEngram pieces (see `fe_megatron.megatron_lm.pretrain_gpt`
and `fe_megatron.megatron_lm.pretrain_hybrid`). ``family`` names the model: ``gpt`` or ``hybrid``.

Everything the run replaces in megatron.training, megatron-core and torch (the trainer's hooks,
`fe_megatron.megatron.compat.trainer`; the CPU backend on a host without CUDA; the tables' gradients into
``main_grad``) goes into the run's `fe_megatron.megatron.patches.PatchScope` and is undone when `run`
returns or raises."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from functools import partial

import torch

from fe_megatron.megatron import patches
from fe_megatron.megatron.cpu_backend import enable_cpu_backend
from fe_megatron.megatron.patches import PatchScope
from fe_megatron.training.distributed import destroy_process_groups
from fe_megatron.training.error_file import tell_the_launcher

# Megatron-LM's pretrain_gpt.py features this entry point does not carry (use that script for them)
NOT_CARRIED = {"sft": "--sft", "fim_data": "--fim-data", "hybrid_context_parallel": "--hybrid-context-parallel",
               "dataloader_inter_document_masking": "--dataloader-inter-document-masking"}


FAMILIES = {"gpt": "pretrain_gpt", "hybrid": "pretrain_hybrid"}
MISSING_PATTERN = ("--hybrid-layer-pattern is missing: fe_megatron.megatron_lm.pretrain_hybrid builds megatron-core's "
                   "HybridModel from a layer pattern (e.g. '*-*-*-*-' for four GPT layers; the deprecated "
                   "--hybrid-attention-ratio/--hybrid-mlp-ratio are not taken)")


def run(argv: list, family: str = "gpt") -> int:
    """Megatron-LM's trainer on ``argv`` (a ``pretrain_<family>.py`` command line with the ``--fe-*``
    arguments); its exit status. What it patches lasts until it returns (`PatchScope`)."""
    with PatchScope("Megatron-LM's trainer") as scope:
        return _run(argv, family, scope)


def _run(argv: list, family: str, scope: PatchScope) -> int:
    on_host = set_up_host(scope)
    from megatron.training.arguments import parse_and_validate_args

    from fe_megatron.megatron import compat
    from fe_megatron.megatron_lm.arguments import add_factorengram_arguments

    unknown = unknown_options(argv)
    if family == "hybrid" and not any(token.split("=", 1)[0] in ("--hybrid-layer-pattern", "--hybrid-override-pattern")
                                      for token in argv):  # before megatron.training's validation asks for layers
        unknown.append(MISSING_PATTERN)
    if unknown:
        return refuse_arguments(unknown, rank=int(os.environ.get("RANK", "0")))
    sys.argv = [sys.argv[0]] + list(argv)  # megatron.training's parser reads sys.argv
    held_dump = []  # megatron's argument dump, printed once this run's own checks have passed
    with compat.argument_dump_held(held_dump):
        args = parse_and_validate_args(extra_args_provider=add_factorengram_arguments,
                                       args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    try:
        model_config, state = prepare_trainer(args, on_host, family, scope)
    except ArgumentsRefused as refused:
        return refuse_arguments(refused.problems, args.rank)
    compat.print_argument_dump(held_dump)
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    return _pretrain(pretrain_cfg_container_from_args(args, model_config), state)


def set_up_host(scope: PatchScope = None) -> bool:
    """Megatron-LM's trainer on this machine, until ``scope`` (default: the innermost open one) closes: on a
    host without CUDA, the CPU backend answers its CUDA assumptions (returns True there); the dataset
    helpers are used as the wheel ships them built."""
    scope = scope or patches.active()
    on_host = enable_cpu_backend(trainer=True, scope=scope)
    from fe_megatron.megatron import compat

    if on_host:
        compat.run_trainer_on_host(scope)
    compat.use_built_dataset_helpers(scope)
    return on_host


class ArgumentsRefused(ValueError):
    """The command line asks what the run cannot honor: ``problems``, one entry per argument."""

    def __init__(self, problems: list):
        super().__init__("\n".join(problems))
        self.problems = problems


def prepare_trainer(args, on_host: bool, family: str = "gpt", scope: PatchScope = None):
    """``(model_config, state)``: Megatron-LM's model configuration of ``family`` (``gpt`` or ``hybrid``)
    for ``args`` (validated arguments, with the ``--fe-*`` ones), with the memory branch where they ask
    for it, and the `TrainerState` the trainer's callbacks share; megatron.training's hooks (the table
    member of the optimizer chain, the log entries, the checkpoint seal, the loader on torch's Adam) are
    installed into ``scope`` (default: the innermost open one) until it closes (`install_trainer_hooks`).
    Raises `ArgumentsRefused` with everything the run cannot honor (`start_up_check`)."""
    scope = scope or patches.active()
    checked = start_up_check(args, on_host, family)
    if checked.problems:
        raise ArgumentsRefused(checked.problems)
    announce(args, checked.plan, host_allocator(checked.plan, on_host))
    model_config = model_config_of(args, checked.memory, on_host, family)
    state = TrainerState(args, checked.memory, checked.config, checked.plan, family)
    if state.memory is not None and state.plan.in_stores:
        # as fe-pretrain's Megatron engine: the tables move into stores before the trainer wraps the model in
        # DDP, and the table optimizer joins the chain the trainer builds (`install_trainer_hooks`)
        model_config.tables_into_stores = state.take_tables
    model_config.post_wrap_hooks.append(state.remember_model)
    install_trainer_hooks(scope, args, state)
    return model_config, state


def host_allocator(plan, on_host: bool):
    """The host allocator that keeps freed blocks for the tables' host work (see host_allocator), where the
    tables live on the host or the run does; None otherwise."""
    if plan is None or not (plan.placement == "host" or on_host):
        return None
    from fe_megatron.tables.host_allocator import keep_freed_host_memory

    return keep_freed_host_memory()


def announce(args, plan, allocator) -> None:
    """On rank 0: who trains the tables, the host allocator, and whether checkpoints convert to Hugging Face."""
    if args.rank != 0:
        return
    if plan is not None:
        print(f"fe_megatron: {plan.describe()}", flush=True)
    if allocator is not None:
        print(f"fe_megatron: {allocator}", flush=True)
    print(f"fe_megatron: {conversion_notice(args)}", flush=True)


def model_config_of(args, memory, on_host: bool, family: str):
    """Megatron-LM's model configuration of ``family`` for ``args``, with ``memory``'s branch (None: none)."""
    if family == "hybrid":
        from megatron.training.argument_utils import hybrid_config_from_args

        from fe_megatron.megatron_lm.model import FactorEngramHybridModelConfig

        # always the project's class: its builder takes megatron-core's local layers where Transformer Engine
        # is missing, which the stock builder cannot
        model_config = hybrid_config_from_args(args, model_config_cls=FactorEngramHybridModelConfig)
    else:
        from megatron.training.argument_utils import gpt_config_from_args

        from fe_megatron.megatron_lm.model import FactorEngramGPTModelConfig

        if memory is None and not (on_host and args.sequence_parallel):
            return gpt_config_from_args(args)
        # with memory; or on the host under SP, which megatron's torch norm refuses and the project's norm takes
        model_config = gpt_config_from_args(args, model_config_cls=FactorEngramGPTModelConfig)
    if memory is not None:
        model_config.memory_config = memory
        model_config.table_sharding = args.fe_table_sharding
    return model_config


def install_trainer_hooks(scope: PatchScope, args, state) -> None:
    """megatron.training's hooks for this run, in ``scope``: the tables' gradients into ``main_grad``, their
    parameter group and optimizer member, the log entries, the Megatron-FSDP checkpoint's wrappers, the
    checkpoint seal and the loader on torch's Adam (`fe_megatron.megatron.compat.trainer`)."""
    from fe_megatron.megatron import compat
    from fe_megatron.megatron.checkpointing import adopt_loaded_adam_step_counts, give_fresh_adam_states_a_step
    from fe_megatron.megatron.main_grad import use_main_grad_accumulation

    use_main_grad_accumulation(scope)
    if state.memory is not None:
        compat.add_trainer_param_group_overrides(scope, _table_group_overrides(args))
        if state.family == "hybrid":
            compat.repair_gpt_to_hybrid_memory_load(scope)  # a GPT checkpoint with memory loads into this model
        if state.plan.in_stores:
            compat.extend_trainer_optimizer(scope, state.add_table_member)
    compat.add_training_log_entries(scope, state.log_entries)
    if getattr(args, "use_megatron_fsdp", False) and args.ckpt_format == "fsdp_dtensor":
        from fe_megatron.megatron_lm.fsdp_checkpoint import fsdp_checkpointing

        compat.repair_fsdp_dtensor_swiglu_lookup(scope)
        tables_beside = state.plan is not None and not state.plan.tables_in_model_state_dict
        compat.wrap_trainer_checkpointing(scope, *fsdp_checkpointing(args, tables_beside))
    compat.after_each_save(scope, state.seal_checkpoint)  # after the wrappers above: seals what they wrote too
    # megatron-core's distributed optimizer on torch's Adam (no Apex or Transformer Engine: a CPU machine)
    # cannot build the state dict a checkpoint loads into from a fresh optimizer, and leaves that fresh step
    # count in place; fe-pretrain's loader does the same around megatron-core's
    compat.around_trainer_loads(scope, give_fresh_adam_states_a_step, adopt_loaded_adam_step_counts)


def unknown_options(argv: list) -> list:
    """The options of ``argv`` that neither Megatron-LM nor fe_megatron knows, each with the closest
    known one (argparse names them only after everything else parsed, with no suggestion)."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from fe_megatron.megatron_lm.arguments import add_factorengram_arguments, unknown_option_problems

    parser = add_factorengram_arguments(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    return unknown_option_problems(argv, parser)


@dataclasses.dataclass
class StartUpCheck:
    """Everything this command line asks that the run cannot honor, for the memory branch or for this
    machine (``problems``: each names the argument, why, and what to use instead), and, with memory,
    the run in fe-pretrain's terms (``config``) and who trains its tables (``plan``)."""

    problems: list = dataclasses.field(default_factory=list)
    memory: object = None
    config: object = None
    plan: object = None


def start_up_check(args, on_host: bool, family: str = "gpt") -> StartUpCheck:
    """The one check before training: all of what `StartUpCheck` lists, gathered in one pass, so that
    a command line is corrected once rather than one failure at a time."""
    from fe_megatron.megatron_lm.arguments import memory_config_from_args, refused_on_this_host

    checked = StartUpCheck()
    problems = checked.problems
    problems += refused_on_this_host(args, has_cuda=not on_host)
    problems += family_problems(args, family)
    problems += [f"{flag}: not carried over from Megatron-LM's {FAMILIES[family]}.py; use that script for it"
                 for name, flag in NOT_CARRIED.items() if getattr(args, name, False)]
    problems += data_problems(args)
    problems += schedule_problems(args)
    try:
        checked.memory = memory_config_from_args(args)
    except ValueError as error:
        problems.append(str(error))
        return checked
    if checked.memory is None:
        return checked
    from fe_megatron.megatron_lm.arguments import refused_combinations, refused_with_stores
    from fe_megatron.megatron_lm.run_info import train_config_of

    memory_problems = refused_combinations(args, checked.memory)
    if family == "hybrid":
        memory_problems += refused_in_hybrid(args, checked.memory)
    if not memory_problems:
        try:
            checked.config = train_config_of(args, checked.memory)
        except ValueError as error:  # the run in fe-pretrain's terms fails its checks (ConfigError)
            memory_problems.append(str(error))
        else:
            checked.plan = table_plan_of(checked.config, fsdp=getattr(args, "use_megatron_fsdp", False),
                                         stage_without_memory=bool(stages_without_memory_of(args, checked.memory)))
    if checked.plan is not None and checked.plan.in_stores:
        memory_problems += refused_with_stores(args)
    if not memory_problems and args.load is not None:
        memory_problems += refused_resume(args, checked.plan)
    problems += memory_problems
    return checked


def family_problems(args, family: str) -> list:
    """A GPT command line with a hybrid pattern, or a hybrid one without one, or with layers the stack it
    will be built on cannot build."""
    from fe_megatron.megatron_lm.arguments import hybrid_pattern_of

    pattern = hybrid_pattern_of(args)
    if family == "gpt":
        return ["--hybrid-layer-pattern: a hybrid model; train it with fe_megatron.megatron_lm.pretrain_hybrid"] \
            if pattern else []
    if not pattern:
        return [MISSING_PATTERN]
    import importlib.util

    from fe_megatron.megatron.hybrid_specs import local_pattern_problems

    if args.transformer_impl == "local" or importlib.util.find_spec("transformer_engine") is None:
        return [problem + " (--transformer-impl local, or no Transformer Engine here)"
                for problem in local_pattern_problems(pattern.split("/")[0])]
    return []


def refused_in_hybrid(args, memory) -> list:
    """What the memory cannot do in the hybrid model yet: each entry names the argument and what to do."""
    from fe_megatron.megatron_lm.arguments import hybrid_pattern_of

    refused = []
    if "/" in hybrid_pattern_of(args):
        refused.append(f"--hybrid-layer-pattern {hybrid_pattern_of(args)!r}: multi-token prediction layers ('/') "
                       "are not supported with memory layers; drop the '/' part")
    if memory.placement != "before_attn":
        refused.append(f"placement={memory.placement!r} (--fe-memory-config): the hybrid model places the memory "
                       "before the attention of its attention layers ('before_attn'); the FFN placements are "
                       "in the GPT model (pretrain_gpt)")
    return refused


def stages_without_memory_of(args, memory) -> set:
    """The pipeline stages that hold no memory layer: the GPT model's even split of its blocks, or the hybrid
    pattern's segments."""
    from fe_megatron.megatron_lm.arguments import hybrid_pattern_of
    from fe_megatron.memory.sharding import stages_without_memory

    pattern = hybrid_pattern_of(args)
    return set(stages_without_memory(memory.layers, args.num_layers, args.pipeline_model_parallel_size,
                                     pattern.split("/")[0] if pattern else None,
                                     args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers))


def schedule_problems(args) -> list:
    """What megatron-core's `OptimizerParamScheduler` would stop on with a bare assertion, by the flags that
    set it: a warm-up at least as long as the decay, a decay of no step, a minimum above the peak rate,
    a warm-up that starts above it. The steps are counted as megatron.training's
    ``get_optimizer_param_scheduler`` counts them (samples: iterations times the global batch)."""
    problems = []
    if args.train_iters:
        if args.lr_decay_iters is not None:
            decay_flag, decay_given = "--lr-decay-iters", args.lr_decay_iters
        else:
            decay_flag, decay_given = "--train-iters (the decay's default)", args.train_iters
        decay = decay_given * args.global_batch_size
        warmup = args.lr_warmup_iters * args.global_batch_size
        warmup_given = f"--lr-warmup-iters {args.lr_warmup_iters}"
    elif args.train_samples:
        if args.lr_decay_samples is not None:
            decay_flag, decay_given = "--lr-decay-samples", args.lr_decay_samples
        else:
            decay_flag, decay_given = "--train-samples (the decay's default)", args.train_samples
        decay = decay_given
        warmup, warmup_given = args.lr_warmup_samples, f"--lr-warmup-samples {args.lr_warmup_samples}"
    else:
        return problems  # megatron.training's validation asks for one of them
    if args.lr_warmup_fraction is not None:
        warmup, warmup_given = args.lr_warmup_fraction * decay, f"--lr-warmup-fraction {args.lr_warmup_fraction}"
    if decay <= 0:
        problems.append(f"{decay_flag} {decay_given}: the learning rate decays over no step; give it at least one")
    elif warmup >= decay:
        problems.append(f"{warmup_given} with {decay_flag} {decay_given}: the warm-up ({warmup:g} samples) must end "
                        f"before the decay does ({decay:g} samples); shorten the warm-up or lengthen the decay")
    if args.lr is None:
        return problems  # megatron.training's validation asks for it
    if args.min_lr > args.lr:
        problems.append(f"--min-lr {args.min_lr} with --lr {args.lr}: the minimum learning rate is above the peak; "
                        "lower --min-lr")
    if args.lr_warmup_init > args.lr:
        problems.append(f"--lr-warmup-init {args.lr_warmup_init} with --lr {args.lr}: the warm-up starts above the "
                        "peak learning rate; lower --lr-warmup-init")
    return problems


def data_problems(args) -> list:
    """What Megatron-LM's dataset builder or model would fail on later, or never return from: a
    ``--data-path`` prefix without its files, a ``--split`` that leaves a part asked for samples without
    a document (megatron.core then loops forever), and token ids the tokenizer or vocabulary cannot hold
    (data made with another tokenizer)."""
    if args.mock_data or not args.data_path:
        return []
    from megatron.training.utils import get_blend_and_blend_per_split

    from fe_megatron.data.datasets import every_split_problems, missing_dataset_files
    from fe_megatron.data.sources import DataError

    blend, _ = get_blend_and_blend_per_split(args)
    if blend is None or args.split is None:
        return []
    prefixes = blend[0]
    missing = missing_dataset_files(prefixes)
    if missing:
        return [f"--data-path {prefix}: {path} does not exist; make it with fe-data preprocess (or Megatron-LM's "
                "tools/preprocess_data.py)" for prefix, path in missing]
    evaluates = args.eval_iters > 0 and not getattr(args, "skip_train", False)
    sizes = [1, 1 if evaluates else 0, 1 if args.eval_iters > 0 else 0]
    problems = []
    try:
        every_split_problems(prefixes, args.split, sizes, split_flag="--split")
    except DataError as error:
        problems.append(str(error))
    try:  # data made with another tokenizer would fail only at the first forward, on a token id
        from megatron.training import get_tokenizer

        from fe_megatron.data.vocab_check import check_token_ids_fit

        check_token_ids_fit(prefixes, args.padded_vocab_size, args.tokenizer_model or args.vocab_file,
                            get_tokenizer().vocab_size, tokenizer_setting="--tokenizer-model",
                            vocab_setting="--vocab-size (padded)")
    except DataError as error:
        problems.append(str(error))
    return problems


def conversion_notice(args) -> str:
    """Whether this run's checkpoints will convert to Hugging Face (``fe-convert mcore-to-hf``), and why not."""
    from fe_megatron.megatron_lm.run_info import hf_conversion_problems

    problems = hf_conversion_problems(args)
    if problems:
        return ("its checkpoints will not convert to Hugging Face (fe-convert mcore-to-hf): the Hugging Face model is "
                f"RoPE, RMSNorm, SwiGLU without biases, and this run would need {', '.join(problems)}")
    if args.tokenizer_model is None:
        return ("its checkpoints will convert to Hugging Face once given a tokenizer: this run names none "
                "(--tokenizer-model), so fe-convert mcore-to-hf needs --tokenizer")
    return "its checkpoints will convert to Hugging Face with fe-convert mcore-to-hf"


def _pretrain(full_config, state) -> int:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    from fe_megatron.megatron_lm import steps

    datasets = partial(steps.train_valid_test_datasets, state=state)
    datasets.is_distributed = True  # as Megatron-LM's provider: built on the ranks that read data
    from fe_megatron.megatron import compat

    try:
        pretrain(full_config, datasets, ModelType.encoder_or_decoder, partial(steps.forward_step, state=state),
                 get_embedding_ranks=steps.get_embedding_ranks)
    except SystemExit:  # Megatron-LM's own exits (exit interval, duration, signal): a finished run too
        compat.finish_fsdp_param_gathers(state.model_chunks)
        destroy_process_groups()
        raise
    # joined now: left to Python's exit, gloo's threads can abort a finished run (docs/operations.md);
    # not after an error, where the process fails anyway and its peers may sit in a collective
    compat.finish_fsdp_param_gathers(state.model_chunks)
    destroy_process_groups()
    return 0


def refuse_arguments(problems: list, rank: int) -> int:
    """Every problem in one message, on global rank 0 (process groups do not exist yet), and exit
    status 2. Under torchrun the message also goes to the error file torchrun reads, so that its
    closing summary, the end of the log, shows it instead of a bare exit code."""
    message = (f"fe_megatron.megatron_lm: this command line cannot run here as given ({len(problems)} "
               f"argument{'s' if len(problems) > 1 else ''} to change):\n" +
               "\n".join(f"  - {problem}" for problem in problems))
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    tell_the_launcher(message)
    return 2


def table_plan_of(config, fsdp: bool = False, stage_without_memory: bool = None):
    """The `TablePlan` of ``config`` (the run in fe-pretrain's terms), by the rules of fe-pretrain's
    Megatron engine; ``fsdp``: the backbone is under Megatron-FSDP (``--use-megatron-fsdp``);
    ``stage_without_memory``: whether a pipeline stage holds no memory layer (None: as the GPT model splits
    ``config``'s blocks)."""
    from fe_megatron.memory.sharding import stages_without_memory
    from fe_megatron.tables.plan import TablePlan

    stage_without = stage_without_memory
    if stage_without is None:
        stage_without = bool(stages_without_memory(config.memory.layers, config.model.num_layers,
                                                   config.parallel.pipeline))
    return TablePlan.for_run(config, bf16_run=config.training.precision == "bf16",
                             stage_without_memory=stage_without, sharded_backbone=fsdp)


def refused_resume(args, plan) -> list:
    """fe-pretrain's table guard for ``--load``: with the distributed optimizer, a checkpoint whose tables
    were trained the other way (as parameters, or in stores: ``fe_run.json``'s ``tables``; checkpoints
    before this record trained them as parameters) keeps their optimizer state in a layout this run
    cannot read."""
    from fe_megatron.checkpoint.files import CheckpointError, iteration_dir, read_run_info, read_tracker
    from fe_megatron.megatron.table_optimizer import refuse_table_optimizer_change

    try:
        iteration = read_tracker(args.load) if os.path.isdir(args.load) else None
    except CheckpointError:  # e.g. a "release" tracker: Megatron-LM's loader reads what it names
        return []
    saved = read_run_info(iteration_dir(args.load, iteration)) if iteration is not None else None
    if saved is None:
        return []  # nothing to resume, or a checkpoint of Megatron-LM's own (no run info): Megatron-LM decides
    # what the guard reads of this run's info (the whole one needs the process group, not up yet)
    current = {"tables": plan.mode, "config": {"parallel": {"distributed_optimizer": args.use_distributed_optimizer}}}
    try:
        refuse_table_optimizer_change(iteration_dir(args.load, iteration), saved, current)
    except CheckpointError as error:
        return [str(error)]
    return []


def _table_group_overrides(args) -> dict:
    from fe_megatron.megatron.builder import table_group_overrides

    return table_group_overrides(args.lr, args.min_lr, args.fe_table_lr_mult, args.fe_table_weight_decay_mult)


class TrainerState:
    """What the trainer's callbacks share: the arguments, the memory configuration, this rank's
    model chunks (known once Megatron-LM has built them), and the run info its checkpoints carry."""

    def __init__(self, args, memory, config=None, plan=None, family: str = "gpt"):
        self.args = args
        self.family = family  # the model: "gpt" or "hybrid" (`FAMILIES`)
        self.memory = memory
        self.config = config  # the run in fe-pretrain's terms (`train_config_of`); None without memory
        self.plan = plan  # who trains the tables (`table_plan_of`); None without memory
        self.tables = None  # this stage's tables in stores (take_tables), where the plan puts them there
        self.table_member_added = False
        self.model_chunks = []
        self.step_loss_tokens = 0.0  # under per-token loss: this rank's loss tokens of the step's microbatches
        self._run_info = None
        self.metrics = None  # <save>/metrics.jsonl, on the rank that holds the losses (the last)
        if args.save is not None and args.rank == args.world_size - 1:
            os.makedirs(args.save, exist_ok=True)
            self.metrics = open(os.path.join(args.save, "metrics.jsonl"), "a")

    def stage_holds_memory(self) -> bool:
        from megatron.core import mpu

        return mpu.get_pipeline_model_parallel_rank() not in stages_without_memory_of(self.args, self.memory)

    def take_tables(self, model) -> None:
        """Move this stage's tables into stores, as the plan says (before the trainer wraps ``model``)."""
        from fe_megatron.megatron.table_optimizer import manage_tables
        from fe_megatron.training.distributed import current_device

        if self.tables is not None:
            raise ValueError("the tables of this pipeline stage were already taken into stores: the memory branch "
                             "is built for one model chunk per stage")
        self.tables = manage_tables(model, self.config.optimizer, self.plan, current_device(), self.args.seed)

    def add_table_member(self, optimizer):
        """The trainer's optimizer chain with the tables' `TableOptimizer` as a member."""
        from fe_megatron.megatron import compat
        from fe_megatron.megatron.builder import check_group_identifiers, with_table_member

        self.table_member_added = True
        chain = with_table_member(optimizer, self.tables, self.args.fe_table_lr_mult,
                                  self.args.fe_table_weight_decay_mult)
        return check_group_identifiers(chain, compat.loader_group_identifier,
                                       "change --fe-table-lr-mult or --fe-table-weight-decay-mult")

    def remember_model(self, model_chunks: list) -> list:
        self.model_chunks = list(model_chunks)
        return model_chunks

    def log_entries(self, loss_dict: dict, iteration: int) -> dict:
        """``sparsity loss`` (lambda x L_sparsity, Eq. 12-13) for the trainer's log, from every stage;
        each step's losses also go to ``<save>/metrics.jsonl`` (as fe-pretrain writes them)."""
        entries = {}
        if self.plan is not None and self.plan.in_stores and not self.table_member_added:
            raise RuntimeError("the tables are in stores but the trainer's optimizer was built without their "
                               "member (megatron.training no longer builds it through "
                               "training.get_megatron_optimizer): the tables would not train; see "
                               "fe_megatron.megatron.compat.extend_trainer_optimizer")
        if self.memory is not None:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            from fe_megatron.megatron.step import pop_sparsity_loss
            from fe_megatron.training.distributed import current_device

            per_token = bool(getattr(self.args, "calculate_per_token_loss", False))
            value = pop_sparsity_loss(self.model_chunks, get_num_microbatches(),
                                      self.step_loss_tokens if per_token else None)
            self.step_loss_tokens = 0.0
            # on the trainer's device: its training_log adds the entries to running sums made on the GPU
            entries["sparsity loss"] = torch.tensor([value], dtype=torch.float32, device=current_device())
        if self.metrics is not None and "lm loss" in loss_dict:
            record = {"step": iteration, "lm_loss": float(loss_dict["lm loss"])}
            if "sparsity loss" in entries:
                record["sparsity_loss"] = float(entries["sparsity loss"])
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        return entries

    def seal_checkpoint(self, iteration: int) -> None:
        """Record the run info in the checkpoint Megatron-LM just wrote, with a manifest of its files
        (what fe-convert reads and verifies)."""
        from fe_megatron.checkpoint.commit import seal
        from fe_megatron.checkpoint.files import iteration_dir
        from fe_megatron.megatron_lm.run_info import run_info_of, train_config_of

        if self.args.tokenizer_model is None:
            return  # a run info names the tokenizer file (--tokenizer-model); without one there is nothing to convert
        if self._run_info is None:
            config = self.config or train_config_of(self.args, self.memory)  # the stock model's: built here
            self._run_info = run_info_of(self.args, config, self.plan)
        seal(iteration_dir(self.args.save, iteration), iteration, self._run_info)
