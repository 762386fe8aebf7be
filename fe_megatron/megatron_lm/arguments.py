"""FactorEngram's arguments on a Megatron-LM command line, and the combinations refused at start-up.

`add_factorengram_arguments` is an ``extra_args_provider`` for megatron.training's parser. The
memory configuration comes from a file (``--fe-memory-config``) or a preset (``--fe-memory-preset``);
with neither, the command line trains the stock GPT model. The backbone is the command line's: the
memory configuration's own ``model:``/``backbone`` section is replaced by the one the Megatron
arguments describe (`backbone_from_megatron_args`), so a preset fits any model size.

With ``--hybrid-layer-pattern`` (``pretrain_hybrid``) the backbone's layers are the pattern's attention
layers, the GPT model's blocks, and ``--fe-memory-layers`` takes the pattern's layer numbers, each an
attention (``*``) layer (`fe_megatron.hybrid_pattern`).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from typing import Optional

from fe_megatron.config import TABLE_PLACEMENTS, BackboneConfig, MemoryConfig
from fe_megatron.suggest import did_you_mean
from fe_megatron.tables.update_rules import TABLE_UPDATES
from fe_megatron.training.config import TABLE_STATE_DTYPES, OptimizerArgs, ParallelArgs

TABLE_SHARDINGS = ("replicated", "rows", "node")


def add_factorengram_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="FactorEngram (fe_megatron)")
    group.add_argument("--fe-memory-config", default=None, metavar="YAML",
                       help="the memory branch: a YAML file of MemoryConfig fields, or an fe-pretrain config "
                            "(its memory: section). The backbone fields come from this command line")
    group.add_argument("--fe-memory-preset", default=None, choices=MemoryConfig.preset_names(),
                       help="the memory branch from a preset (e.g. factorengram-340m, engram-340m)")
    group.add_argument("--fe-memory-layers", default=None, type=int, nargs="+", metavar="INDEX",
                       help="0-based layers that carry the memory branch (overrides the config's layers; the "
                            "paper's layers 10 and 12 of 24 are 10 12). With --hybrid-layer-pattern: the pattern's "
                            "layer numbers (0-based, '|' not counted), each an attention ('*') layer")
    group.add_argument("--fe-table-sharding", default=ParallelArgs.table_sharding, choices=TABLE_SHARDINGS,
                       help="replicated: whole tables on every data-parallel rank; rows: the rows sharded over the "
                            "data-parallel (x context-parallel) ranks, looked up with an all-to-all; node: split as "
                            "rows, each node's rows kept once in shared host memory that its ranks read directly "
                            "(needs --fe-table-placement host)")
    group.add_argument("--fe-shared-table-folder", default=ParallelArgs.shared_table_folder, metavar="DIR",
                       help="--fe-table-sharding node: the tmpfs folder of each node's shared tables "
                            "(default %(default)s)")
    group.add_argument("--fe-table-dtype", default=None, choices=("fp32", "bf16"),
                       help="the tables' storage dtype (overrides the config's table_dtype)")
    group.add_argument("--fe-table-placement", default=None, choices=TABLE_PLACEMENTS,
                       help="device, or host: the tables and their optimizer state in host memory (overrides the "
                            "config's table_placement)")
    group.add_argument("--fe-table-state-dtype", default=OptimizerArgs.table_state_dtype, choices=TABLE_STATE_DTYPES,
                       help="the tables' gradient accumulators and optimizer moments (default %(default)s)")
    group.add_argument("--fe-table-update", default=OptimizerArgs.table_update, choices=TABLE_UPDATES,
                       help="adamw: every row, every step (the paper's); the others: only the rows a step touched "
                            "(docs/tables.md; default %(default)s)")
    group.add_argument("--fe-table-lr-mult", default=OptimizerArgs.table_lr_mult, type=float,
                       help="the tables' learning rate = this x the learning rate (default %(default)s)")
    group.add_argument("--fe-table-weight-decay-mult", default=OptimizerArgs.table_weight_decay_mult, type=float,
                       help="the tables' weight decay = this x --weight-decay (default %(default)s, the paper's; 0 is "
                            "Engram's exemption of the tables)")
    repair_help_strings(parser)
    return parser


def repair_help_strings(parser: argparse.ArgumentParser) -> None:
    """Escape a lone ``%`` in the help of any argument whose help argparse cannot format: megatron-core
    0.19.2's ``--moe-paged-stash-buffer-size-factor-cuda`` reads "(e.g. 1.10 = 10%)", which made
    ``--help`` fail with "unsupported format character" before printing anything."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.help or action.help is argparse.SUPPRESS:
            continue
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError, KeyError):
            action.help = re.sub(r"(?<!%)%(?!\(\w+\)[sdfr]|%)", "%%", action.help)


def unknown_option_problems(argv: list, parser: argparse.ArgumentParser) -> list:
    """One entry per ``--option`` in ``argv`` that ``parser`` does not know, each with the closest
    known option (argparse itself names the unknown ones only, and only after the known ones parsed)."""
    known = [option for action in parser._actions for option in action.option_strings]
    problems = []
    for token in argv:
        if not token.startswith("--") or token == "--":
            continue
        option = token.split("=", 1)[0]
        if option in known:
            continue
        hint = did_you_mean(option, known) or (
            "; the FactorEngram options are listed under --help" if option.startswith("--fe-") else "")
        problems.append(f"{option}: unknown argument{hint}")
    return problems


def uses_memory(args) -> bool:
    return args.fe_memory_config is not None or args.fe_memory_preset is not None


def hybrid_pattern_of(args) -> Optional[str]:
    """The command line's ``--hybrid-layer-pattern`` (None: a GPT model)."""
    return getattr(args, "hybrid_layer_pattern", None)


def backbone_from_megatron_args(args) -> BackboneConfig:
    """The backbone a Megatron-LM command line describes, in fe_megatron's terms (``args`` after
    megatron.training's validation, which fills ``padded_vocab_size`` and ``ffn_hidden_size``). A hybrid
    model's layers are its pattern's attention layers (the GPT model's blocks)."""
    from fe_megatron.hybrid_pattern import attention_layers

    pattern = hybrid_pattern_of(args)
    num_layers = len(attention_layers(pattern)) if pattern else args.num_layers
    return BackboneConfig(
        vocab_size=args.padded_vocab_size, hidden_size=args.hidden_size, num_layers=num_layers,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length, init_std=args.init_method_std,
        norm_eps=args.layernorm_epsilon, rope_base=float(args.rotary_base),
        tie_embeddings=not args.untie_embeddings_and_output_weights, dropout=args.hidden_dropout)


def memory_config_from_args(args) -> Optional[MemoryConfig]:
    """The memory configuration of the command line, on its backbone (None: the stock model). Its
    ``layers`` are blocks: with ``--hybrid-layer-pattern``, the attention layers ``--fe-memory-layers`` names."""
    if not uses_memory(args):
        return None
    if args.fe_memory_config is not None and args.fe_memory_preset is not None:
        raise ValueError("give --fe-memory-config or --fe-memory-preset, not both")
    overrides = {}
    pattern = hybrid_pattern_of(args)
    if args.fe_memory_layers is not None and pattern:
        from fe_megatron.hybrid_pattern import memory_blocks_of_layers

        overrides["layers"] = memory_blocks_of_layers(pattern, args.fe_memory_layers)
    elif args.fe_memory_layers is not None:
        overrides["layers"] = list(args.fe_memory_layers)
    if args.fe_table_dtype is not None:
        overrides["table_dtype"] = args.fe_table_dtype
    if args.fe_table_placement is not None:
        overrides["table_placement"] = args.fe_table_placement
    backbone = backbone_from_megatron_args(args)
    if args.fe_memory_config is not None:
        return MemoryConfig.from_yaml(args.fe_memory_config, backbone=backbone, **overrides)
    return MemoryConfig.from_dict({"preset": args.fe_memory_preset, **overrides}, backbone=backbone)


def refused_combinations(args, memory: MemoryConfig) -> list:
    """Why the memory branch cannot honor this command line (empty: it can). Each entry names the
    argument and what to do instead."""
    refused = []
    if args.fe_table_sharding in ("rows", "node") and args.context_parallel_size > 1:
        refused.append(f"--fe-table-sharding {args.fe_table_sharding} with --context-parallel-size > 1: use "
                       "fe-pretrain, or replicated tables")
    if args.fe_table_sharding == "node" and memory.table_placement != "host":
        refused.append(f"--fe-table-sharding node keeps the tables in host memory, and the tables' placement is "
                       f"{memory.table_placement!r}: add --fe-table-placement host")
    if getattr(args, "mtp_num_layers", None):
        refused.append(f"--mtp-num-layers {args.mtp_num_layers}: the multi-token prediction block's layers get no "
                       "memory inputs; train without it")
    if args.virtual_pipeline_model_parallel_size is not None:
        refused.append("--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank: "
                       "the memory branch is built for one model chunk per pipeline stage")
    if args.context_parallel_size > 1 and args.sequence_parallel:
        refused.append("--context-parallel-size > 1 with --sequence-parallel: the memory branch cannot combine "
                       "them yet")
    if args.calculate_per_token_loss and args.recompute_granularity == "full" and \
            args.pipeline_model_parallel_size > 1:
        refused.append("--calculate-per-token-loss with --recompute-granularity full and "
                       "--pipeline-model-parallel-size > 1: each microbatch's sparsity term is weighted by its "
                       "tokens when its layer runs, and a pipelined recompute runs it after later microbatches "
                       "started; use selective recompute, or no per-token loss")
    if getattr(args, "moe_use_upcycling", False):
        refused.append("--moe-use-upcycling: it builds a second, dense model beside the run's, and the memory "
                       "branch's tables are built once per pipeline stage; upcycle without the memory branch")
    if args.num_experts and getattr(args, "expert_tensor_parallel_size", None) not in (
            None, args.tensor_model_parallel_size):
        refused.append(f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size} differs from "
                       f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: the experts' data-parallel "
                       "group then spans tensor-parallel ranks, over which the tables' columns differ; keep them "
                       "equal")
    if memory.table_dtype not in ("fp32", "bf16"):
        refused.append(f"table_dtype={memory.table_dtype}: fp8 tables are for serving (fe-convert --table-dtype); "
                       "train fp32 or bf16 tables")
    return refused


def refused_with_stores(args) -> list:
    """What the tables' stores (the table plan's, `fe_megatron.tables.plan`) cannot run beside: each entry
    names the argument and what to do instead (empty: nothing)."""
    refused = []
    if args.fp16 or args.loss_scale is not None:
        refused.append("--fp16 / --loss-scale: the tables in stores take unscaled gradients (fe-pretrain trains in "
                       "bf16 or fp32 without loss scaling); train with --bf16 and no --loss-scale")
    checkpoints = args.save is not None or args.load is not None
    fsdp = getattr(args, "use_megatron_fsdp", False)  # (Megatron-LM asserts --ckpt-format fsdp_dtensor for it)
    if not fsdp and getattr(args, "ckpt_format", "torch_dist") != "torch_dist" and checkpoints:
        refused.append(f"--ckpt-format {args.ckpt_format}: the tables in stores and their optimizer state are saved "
                       "in the distributed checkpoint format; use --ckpt-format torch_dist")
    if fsdp and getattr(args, "non_persistent_save_interval", None):
        refused.append("--non-persistent-save-interval with --use-megatron-fsdp: the tables in stores are saved "
                       "beside persistent checkpoints only; use --save-interval")
    if getattr(args, "data_parallel_random_init", False):
        refused.append("--data-parallel-random-init: DDP broadcasts parameters only, and tables in stores are not "
                       "parameters, so replicated tables would differ across data-parallel ranks")
    for name, flag in (("use_layer_wise_distributed_optimizer", "--use-layer-wise-distributed-optimizer"),
                       ("use_torch_fsdp2", "--use-torch-fsdp2")):
        if getattr(args, name, False):
            refused.append(f"{flag}: the tables' optimizer joins Megatron's optimizer chain, which this option "
                           "replaces; use the (distributed) optimizer of the default path")
    if getattr(args, "init_model_with_meta_device", False):
        refused.append("--init-model-with-meta-device: tables move into stores as soon as the model is built, "
                       "which needs their values; build the model without it")
    decoupled_lr = getattr(args, "decoupled_lr", None)
    decoupled_min_lr = getattr(args, "decoupled_min_lr", None)
    if decoupled_lr is not None and decoupled_lr == args.lr and (decoupled_min_lr is None
                                                                 or decoupled_min_lr == args.min_lr):
        # megatron-core (0.19 on) tells the decoupled groups from the others by their rates only
        given = f"--decoupled-lr {decoupled_lr}" + (f" and --decoupled-min-lr {decoupled_min_lr}"
                                                    if decoupled_min_lr is not None else "")
        refused.append(f"{given}: the same rates as --lr {args.lr} and --min-lr {args.min_lr}, so the embedding's and "
                       "output layer's parameter groups are the same as the others to megatron-core's checkpoint "
                       "loader, which pairs groups by their rates (the tables' optimizer joins that chain); drop "
                       "--decoupled-lr and --decoupled-min-lr, which trains the same schedule, or give them other "
                       "rates")
    return refused


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _missing_gpu_kernels(args, has_te: bool) -> list:
    """On a GPU machine: the fused kernels Megatron-LM's defaults ask for whose library is not installed
    (each has a --no-* flag). Megatron-Core fails on each at its first use: the softmax in bf16, the
    gradient accumulation when its linear layers are built, the rope at the first forward."""
    from fe_megatron.megatron.compat import fused_softmax_available

    refused = []
    if getattr(args, "masked_softmax_fusion", False) and (args.bf16 or args.fp16) and not fused_softmax_available():
        refused.append("masked-softmax-fusion (on by default): Megatron's fused softmax kernels "
                       "(scaled_masked_softmax_cuda, from Megatron-LM's megatron/fused_kernels or Apex) are not "
                       "installed here, and bf16 and fp16 runs ask for them; add --no-masked-softmax-fusion")
    te_layers = has_te and args.transformer_impl == "transformer_engine"
    if getattr(args, "gradient_accumulation_fusion", False) and not te_layers \
            and not _installed("fused_weight_gradient_mlp_cuda"):
        refused.append("gradient-accumulation-fusion (on by default): its kernel comes from Apex "
                       "(fused_weight_gradient_mlp_cuda) or Transformer Engine's layers, neither used here; add "
                       "--no-gradient-accumulation-fusion")
    if getattr(args, "apply_rope_fusion", False) and args.position_embedding_type == "rope" and not has_te:
        refused.append("rope-fusion (on by default): the fused rope comes from Transformer Engine, which is not "
                       "installed here; add --no-rope-fusion")
    return refused


def refused_on_this_host(args, has_cuda: bool) -> list:
    """What this machine cannot run (empty on a GPU machine with Transformer Engine): each entry names
    the argument, why, and what to use instead. Megatron-LM would otherwise fail on each of them in
    turn, deep in a kernel or a library call, one run at a time."""
    refused = []
    has_te, has_apex = _installed("transformer_engine"), _installed("apex")
    if args.transformer_impl == "transformer_engine" and not has_te:
        refused.append("--transformer-impl transformer_engine (the default): Transformer Engine is not installed "
                       "here; use --transformer-impl local")
    if getattr(args, "fp8", None) and not has_te:
        refused.append(f"--fp8-format {args.fp8}: fp8 needs Transformer Engine, which is not installed here; train in "
                       "bf16 or fp32 (drop --fp8-format, --fp8-amax-history-len, --fp8-amax-compute-algo, "
                       "--fp8-param-gather)")
    if getattr(args, "layernorm_zero_centered_gamma", False) and not (has_te or has_apex):  # --apply-layernorm-1p
        refused.append("--apply-layernorm-1p: the zero-centered norm comes from Transformer Engine or Apex, neither "
                       "installed here (the torch norm has no such option); drop it")
    if has_cuda:
        return refused + _missing_gpu_kernels(args, has_te)
    if args.distributed_backend != "gloo":
        refused.append(f"--distributed-backend {args.distributed_backend}: this machine has no GPU; use "
                       "--distributed-backend gloo")
    if getattr(args, "profile", False):
        refused.append("--profile: Megatron-LM's profiler drives the CUDA profiler, and this machine has no GPU; "
                       "drop --profile (and --profile-step-start/--profile-step-end)")
    # fused kernels Megatron-LM's defaults ask for, which are CUDA-only (each has a --no-* flag), where this
    # model would run them: the SwiGLU one only in a SwiGLU MLP (megatron.training gives a GeLU MLP
    # --bias-gelu-fusion instead), the rope one only with rotary embeddings (its validation turns it off
    # for the others)
    fused = {"--no-gradient-accumulation-fusion": args.gradient_accumulation_fusion,
             "--no-persist-layer-norm": not args.no_persist_layer_norm,
             "--no-masked-softmax-fusion": args.masked_softmax_fusion,
             "--no-bias-swiglu-fusion": args.bias_swiglu_fusion and getattr(args, "swiglu", False),
             "--no-rope-fusion": args.apply_rope_fusion}
    for flag, asked in fused.items():
        if asked:
            refused.append(f"{flag[len('--no-'):]} (on by default): a fused CUDA kernel, and this machine has no GPU; "
                           f"add {flag}")
    if getattr(args, "use_megatron_fsdp", False):
        if getattr(args, "gradient_reduce_div_fusion", False):
            refused.append("gradient-reduce-div-fusion (on by default with --use-megatron-fsdp): NCCL's pre-multiplied "
                           "sum, which gloo has not; add --no-gradient-reduce-div-fusion")
        for name, flag in (("nccl_ub", "--use-nccl-ub"), ("fsdp_manual_registration", "--fsdp-manual-registration")):
            if getattr(args, name, False):
                refused.append(f"{flag}: NCCL's user buffers, and this machine has no GPU; drop it")
    if not getattr(args, "use_cpu_initialization", False):
        refused.append("weights initialized on the GPU (Megatron-LM's default), and this machine has none; add "
                       "--use-cpu-initialization")
    return refused
