"""What each use of megatron-core's non-public API expects of the installed release (`CONTRACTS`), so
that an upstream change fails one named check (``tests/unit/megatron/test_compat.py``) instead of a
training run, and what fe-pretrain says when megatron-core is outside the supported range."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable

from fe_megatron.megatron.compat.cpu import CPU_BACKEND_REQUIRED, optional_module
from fe_megatron.megatron.compat.layers import default_block_norm
from fe_megatron.megatron.compat.optimizer import (STRUCTURAL_GROUP_KEYS, chained_optimizer_class,
                                                   fp32_optimizer_class, param_group_identifier_keys)
from fe_megatron.megatron.compat.versions import (NEWEST_TESTED, OLDEST_TESTED, SUPPORTED_MEGATRON_CORE,
                                                  has_hybrid_model, has_megatron_lm_trainer, is_supported_version,
                                                  megatron_core_version)


class UpstreamMoved(RuntimeError):
    """A megatron-core internal that fe_megatron relies on is not where, or not what, it was."""


def unsupported_version_message() -> str | None:
    """None where the installed megatron-core is in the supported range, else what to do."""
    version = megatron_core_version()
    if is_supported_version(version):
        return None
    problems = broken_contracts()
    moved = ("; the internals fe_megatron relies on are where it expects them" if not problems
             else ". Internals that moved: " + " | ".join(problems))
    return (f"megatron-core {version} is outside the range fe_megatron supports and was tested on "
            f"({', '.join(SUPPORTED_MEGATRON_CORE)}; {OLDEST_TESTED} to {NEWEST_TESTED}){moved}")


@dataclass(frozen=True)
class Contract:
    """What one use of megatron-core's internals expects of it; ``check`` raises `UpstreamMoved` if it is not so."""

    name: str
    used_by: str
    check: Callable[[], None]


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise UpstreamMoved(f"megatron-core {megatron_core_version()}: {what}; fe_megatron/megatron/compat/ "
                            "must be adapted to this release")


def _has_parameters(function, names: tuple, where: str) -> None:
    present = set(inspect.signature(function).parameters)
    missing = [name for name in names if name not in present]
    _require(not missing, f"{where} no longer takes {missing} (it takes {sorted(present)})")


def _check_layer_steps():
    """The FFN placements (``before_ffn``, ``inside_ffn``) read the residual stream between the attention's
    residual add and the pre-MLP norm, and ``before_ffn`` adds the memory's output to that residual, outside
    the MLP's dropout. No public slot of megatron-core 0.16's ``TransformerLayer`` reaches it: a module in the
    MLP slot sees the normed stream and its output passes the hidden dropout, and only 0.19's pre-MLP norm may
    hand back a residual. So the layer runs ``_forward_attention``, then ``_forward_mlp`` (or the pre-MLP
    norm and ``_forward_post_mlp``) itself. ``before_attn``, the default, calls the public ``forward``."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for step in ("_forward_attention", "_forward_mlp", "_forward_pre_mlp_layernorm"):
        _require(callable(getattr(TransformerLayer, step, None)), f"TransformerLayer.{step} is gone")
    _has_parameters(TransformerLayer._forward_attention, ("hidden_states", "attention_mask", "context"),
                    "TransformerLayer._forward_attention")
    _has_parameters(TransformerLayer._forward_mlp, ("hidden_states", "inference_context"),
                    "TransformerLayer._forward_mlp")
    # _forward_post_mlp may be missing: post_mlp then does its bias-dropout-add itself


def _check_mlp_internals():
    """``inside_ffn`` adds the memory to SwiGLU's up branch inside megatron-core's ``MLP.forward``, which runs
    as it is: a forward hook on ``linear_fc1`` adds ``[0 | m]`` to its output, so the output's last axis must
    hold the gate columns, then the up columns (``torch.chunk(x, 2, dim=-1)``: gate, then up), added before
    the activation; and the layer recomputes the MLP where it does (``recompute_mlp``). No public MLP entry
    point takes an addend to the up branch."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    source = inspect.getsource(MLP.forward)
    _require("self.linear_fc1" in source and "self.linear_fc2" in source, "MLP.forward no longer runs linear_fc1 "
             "and linear_fc2")
    _require("x_glu, x_linear = torch.chunk(x, 2, dim=-1)" in source,
             "MLP.forward no longer splits linear_fc1's output into gate, then up halves (torch.chunk(x, 2, dim=-1))")
    _require("self.recompute_mlp" in inspect.getsource(TransformerLayer.__init__),
             "TransformerLayer no longer sets recompute_mlp")


def _check_layer_constructor():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    _has_parameters(TransformerLayer.__init__, ("config", "submodules", "layer_number", "hidden_dropout",
                                                "pg_collection", "vp_stage"), "TransformerLayer.__init__")


def _check_block():
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlock, get_num_layers_to_build

    _has_parameters(get_num_layers_to_build, ("config", "vp_stage", "pp_rank"), "get_num_layers_to_build")
    _has_parameters(TransformerBlock.forward, ("hidden_states", "attention_mask"), "TransformerBlock.forward")
    _has_parameters(GPTModel.forward, ("input_ids", "position_ids", "attention_mask", "extra_block_kwargs"),
                    "GPTModel.forward")
    _require(default_block_norm() is not None, "transformer_block.LayerNormImpl is gone")


def _check_sharded_state_dict_helpers():
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    _has_parameters(make_sharded_tensors_for_checkpoint, ("state_dict", "prefix", "tensor_parallel_layers_axis_map",
                                                          "sharded_offsets", "tp_group", "dp_cp_group"),
                    "make_sharded_tensors_for_checkpoint")
    _require(callable(ensure_metadata_has_dp_cp_group), "transformer.utils.ensure_metadata_has_dp_cp_group is gone")


def _check_optimizer_internals():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    chained, fp32 = chained_optimizer_class(), fp32_optimizer_class()
    for method in ("prepare_grads", "get_grad_norm", "step_with_ready_grads", "get_parameters",
                   "get_grad_stats_parallel_group"):
        _require(callable(getattr(chained, method, None)), f"ChainedOptimizer.{method} is gone")
        _require(callable(getattr(fp32, method, None)), f"FP32Optimizer.{method} is gone")
    # the tables' member reduces its norm over its own groups (get_grad_stats_parallel_group() is None),
    # which the chain then sums as the square root of the members' squares
    _require(callable(getattr(chained, "grads_states_parallel_group_is_shared", None)),
             "ChainedOptimizer.grads_states_parallel_group_is_shared is gone")
    _has_parameters(fp32.__init__, ("optimizer", "config", "init_state_fn"), "FP32Optimizer.__init__")
    _has_parameters(clip_grad_by_total_norm_fp32, ("parameters", "max_norm", "total_norm"),
                    "clip_grad_by_total_norm_fp32")
    keys = param_group_identifier_keys()
    _require(set(STRUCTURAL_GROUP_KEYS) <= set(keys),
             f"param_group_identifier_keys is {keys}; the tables' group and resuming with another schedule rely "
             f"on {STRUCTURAL_GROUP_KEYS} among them")
    from megatron.core.optimizer import distrib_optimizer

    _require(hasattr(distrib_optimizer, "HAVE_APEX_OR_TE"), "distrib_optimizer.HAVE_APEX_OR_TE is gone")
    from megatron.core.dist_checkpointing import optimizer as dist_optimizer

    _require(callable(getattr(dist_optimizer, "get_param_id_to_sharded_param_map", None)),
             "dist_checkpointing.optimizer.get_param_id_to_sharded_param_map is gone")


def _check_checkpoint_writer_queue():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _require(hasattr(filesystem_async, "_results_queue"),
             "dist_checkpointing.strategies.filesystem_async._results_queue is gone")


def _check_cpu_backend_targets():
    for name in CPU_BACKEND_REQUIRED:
        module = optional_module(name)
        _require(module is not None, f"module {name} is gone")
        _require(getattr(module, "torch", None) is not None, f"{name} no longer imports torch at module level")
    from megatron.core.tensor_parallel import random as mcore_random

    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state", "get_cuda_rng_tracker"):
        _require(callable(getattr(mcore_random, name, None)), f"tensor_parallel.random.{name} is gone")
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    _has_parameters(moe_utils.maybe_move_tensor_to_cpu, ("tensor", "as_numpy", "record_stream"),
                    "moe_utils.maybe_move_tensor_to_cpu")
    _require(getattr(token_dispatcher, "maybe_move_tensor_to_cpu", None) is not None
             and "maybe_move_tensor_to_cpu(" in inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher),
             "the all-to-all token dispatcher no longer moves its split sizes with maybe_move_tensor_to_cpu")


def _check_trainer():
    if not has_megatron_lm_trainer():
        return  # fe_megatron.megatron_lm refuses to start and says which release it needs
    _check_trainer_model_builders()
    _check_trainer_start_up()
    _check_trainer_optimizer_log_and_checkpoints()
    _check_trainer_fsdp_checkpointing()
    _check_trainer_batch()


def _check_trainer_model_builders():
    """The builders construct GPTModel and HybridModel by name (`trainer.building_gpt_model_as`), and a hybrid
    run retargets a GPT checkpoint through the interop function `checkpoints.repair_gpt_to_hybrid_memory_load`
    replaces."""
    from megatron.training.models import gpt

    _require(inspect.getsource(gpt.GPTModelBuilder.build_model).count("GPTModel(") == 1,
             "megatron.training.models.gpt.GPTModelBuilder.build_model no longer constructs GPTModel by that name")
    if not has_hybrid_model():
        return
    from megatron.training.models import hybrid

    _require(inspect.getsource(hybrid.HybridModelBuilder.build_model).count("HybridModel(") == 1,
             "megatron.training.models.hybrid.HybridModelBuilder.build_model no longer constructs HybridModel by "
             "that name")
    from megatron.core.dist_checkpointing import gpt_checkpoint_interop as interop

    _has_parameters(interop.retarget_sharded_state_dict_to_gpt_checkpoint, ("sharded_state_dict", "layer_maps"),
                    "gpt_checkpoint_interop.retarget_sharded_state_dict_to_gpt_checkpoint")
    for name in ("_DECODER_LAYER_KEY_RE", "_GPT_FINAL_NORM_KEY_MAP", "_GPT_OMITTED_LOCAL_KEYS", "ShardedBase",
                 "LocalNonpersistentObject", "dict_list_map_inplace", "gpt_compatible_layer_maps"):
        _require(hasattr(interop, name), f"gpt_checkpoint_interop.{name} is gone")
    from megatron.training import checkpointing

    # imported where it is called, so that the repaired function is the one called
    _require(re.search(r"^\s+from megatron\.core\.dist_checkpointing\.gpt_checkpoint_interop import \(\s*"
                       r"retarget_sharded_state_dict_to_gpt_checkpoint", inspect.getsource(checkpointing),
                       re.MULTILINE) is not None,
             "megatron.training.checkpointing no longer retargets a hybrid run's state dict at a GPT checkpoint "
             "through gpt_checkpoint_interop.retarget_sharded_state_dict_to_gpt_checkpoint")


def _check_trainer_start_up():
    """What `trainer.run_trainer_on_host`, `trainer.use_built_dataset_helpers` and `trainer.argument_dump_held`
    replace: initialization without CUDA, the JIT warm-up, the data loaders, the dataset helpers' build and
    the argument dump."""
    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import arguments, initialize, training
    from megatron.training.datasets import data_samplers

    _has_parameters(initialize.initialize_megatron, ("allow_no_cuda",), "initialize_megatron")
    _require(callable(getattr(initialize, "_warmup_jit_function", None)), "initialize._warmup_jit_function is gone")
    _require(callable(getattr(training, "initialize_megatron", None)), "training.initialize_megatron is gone")
    _has_parameters(data_samplers.build_pretraining_data_loader, ("dataset", "consumed_samples"),
                    "data_samplers.build_pretraining_data_loader")
    _require("build_pretraining_data_loader(" in inspect.getsource(training.build_train_valid_test_data_loaders),
             "training.build_train_valid_test_data_loaders no longer builds its loaders with "
             "build_pretraining_data_loader")
    _has_parameters(training.pretrain, ("cfg_container", "train_valid_test_dataset_provider", "model_type",
                                        "forward_step_func"), "megatron.training.pretrain")
    _require(callable(getattr(dataset_utils, "compile_helpers", None)), "datasets.utils.compile_helpers is gone")
    _has_parameters(arguments._print_args, ("title", "args"), "megatron.training.arguments._print_args")
    _require("_print_args(" in inspect.getsource(arguments.validate_args),
             "megatron.training.arguments.validate_args no longer prints its arguments with _print_args")


def _check_trainer_optimizer_log_and_checkpoints():
    """What the trainer's optimizer, log, save and load hooks replace in ``megatron.training.training``."""
    from megatron.training import training

    _require(callable(getattr(training, "get_megatron_optimizer_config", None)),
             "megatron.training.training.get_megatron_optimizer_config is gone")
    _require("get_megatron_optimizer_config(args)" in inspect.getsource(training.setup_model_and_optimizer),
             "setup_model_and_optimizer no longer builds its optimizer config with get_megatron_optimizer_config")
    _require("get_megatron_optimizer(" in inspect.getsource(training.setup_model_and_optimizer),
             "setup_model_and_optimizer no longer builds its optimizer with training.get_megatron_optimizer")
    _has_parameters(training.training_log, ("loss_dict", "total_loss_dict", "learning_rate", "iteration"),
                    "training.training_log")
    _has_parameters(training.save_checkpoint, ("iteration",), "training.save_checkpoint")
    _has_parameters(training.load_checkpoint, ("ddp_model", "optimizer"), "training.load_checkpoint")


def _check_trainer_fsdp_checkpointing():
    """Megatron-FSDP's ``fsdp_dtensor`` checkpoints (`trainer.repair_fsdp_dtensor_swiglu_lookup`,
    `trainer.finish_fsdp_param_gathers`), where this install has Megatron-FSDP."""
    from megatron.training import checkpointing

    if not getattr(checkpointing, "HAVE_MEGATRON_FSDP", False):
        return
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

    _require(callable(getattr(MegatronFSDP, "synchronize_param_gather", None)),
             "MegatronFSDP.synchronize_param_gather is gone")
    _has_parameters(checkpointing.handle_swiglu_in_state_dict, ("model",),
                    "megatron.training.checkpointing.handle_swiglu_in_state_dict")
    _require("handle_swiglu_in_state_dict(" in inspect.getsource(checkpointing.preprocess_fsdp_dtensor_state_dict),
             "preprocess_fsdp_dtensor_state_dict no longer splits SwiGLU with handle_swiglu_in_state_dict")


def _check_trainer_batch():
    """The batch helpers `fe_megatron.megatron_lm.batch` calls."""
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank

    _has_parameters(get_batch_on_this_tp_rank, ("batch", "has_cu_seqlens", "is_hybrid_cp", "broadcast_src_rank",
                                                "pipeline_model_parallel_size", "mtp_on_this_rank"),
                    "megatron.core.utils.get_batch_on_this_tp_rank")
    _has_parameters(get_batch_on_this_cp_rank, ("batch", "is_hybrid_cp", "cp_group"),
                    "megatron.core.utils.get_batch_on_this_cp_rank")


CONTRACTS = (
    # the FFN placements run between the attention and MLP steps (before the attention: the public forward)
    Contract("TransformerLayer forward steps", "megatron/transformer_layer.py (before_ffn, inside_ffn)",
             _check_layer_steps),
    Contract("MLP's SwiGLU halves for inside_ffn", "megatron/transformer_layer.py (mlp_with_up_addend)",
             _check_mlp_internals),
    Contract("TransformerLayer constructor", "megatron/transformer_layer.py", _check_layer_constructor),
    Contract("block and GPTModel forwards", "megatron/gpt_model.py, layer_specs.py", _check_block),
    Contract("sharded state dict helpers", "megatron/memory_layer.py", _check_sharded_state_dict_helpers),
    Contract("optimizer internals", "megatron/builder.py, table_optimizer.py, checkpointing.py, step.py",
             _check_optimizer_internals),
    Contract("checkpoint writer queue", "megatron/checkpointing.py", _check_checkpoint_writer_queue),
    Contract("CPU backend targets", "megatron/cpu_backend.py", _check_cpu_backend_targets),
    Contract("Megatron-LM's trainer", "megatron_lm/", _check_trainer),
)


def broken_contracts() -> list[str]:
    """Every contract the installed megatron-core breaks, each as one message (empty: none)."""
    problems = []
    for contract in CONTRACTS:
        try:
            contract.check()
        except UpstreamMoved as moved:
            problems.append(f"{contract.name} (used by fe_megatron/{contract.used_by}): {moved}")
        except (ImportError, AttributeError) as error:
            problems.append(f"{contract.name} (used by fe_megatron/{contract.used_by}): megatron-core "
                            f"{megatron_core_version()}: {error}")
    return problems
