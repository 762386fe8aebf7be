"""Every use of Megatron-Core's non-public API, in one package, for every supported release.

fe_megatron builds on megatron-core's public pieces (``ModuleSpec``, ``TransformerConfig``,
``GPTModel``, DDP, ``get_megatron_optimizer``, the schedules, ``dist_checkpointing``) and, where
no public hook exists, on a few internals.  Those internals move between releases; this package
is the only place that touches them, one module per thing it adapts:

* `versions`: the supported range, the installed release, and what it ships (Megatron-LM's trainer,
  HybridModel);
* `layers`: a ``TransformerLayer``'s private forward steps (the memory branch sits between them), the
  block's layer count and norm, the fused softmax's kernels, the MoE router without Transformer Engine;
* `optimizer`: optimizer internals (a chain member of our own, one gradient norm per step, the keys a
  checkpoint's parameter groups are paired by);
* `checkpoints`: the checkpoint writer's result queue, where a release reads a checkpoint's common state,
  a GPT checkpoint with memory loaded into a hybrid model;
* `cpu`: what the CPU backend (`fe_megatron.megatron.cpu_backend`) replaces: module-level ``torch`` and the
  device RNG functions;
* `trainer`: Megatron-LM's trainer (``megatron.training``) attributes that `fe_megatron.megatron_lm` replaces;
* `contracts`: what each use expects (`CONTRACTS`), so that an upstream change fails one named check
  (``tests/unit/megatron/test_compat.py``) instead of a training run.

What replaces an upstream attribute takes the `fe_megatron.megatron.patches.PatchScope` of the run and
is undone when the run ends; nothing here changes anything when imported.

Supported: megatron-core ``SUPPORTED_MEGATRON_CORE`` (docs/compatibility.md lists the releases
each end was tested with).  What changed inside that range and is answered here:

* 0.17: ``TransformerLayer._forward_mlp`` takes ``packed_seq_params``; layer-norm and MLP
  submodules may be builder callables instead of ``ModuleSpec``; ``megatron.training`` ships
  in the wheel;
* 0.19: DDP's gradient sync asks ``torch.cuda.current_stream()`` (the CPU backend answers it);
  ``megatron.training.pretrain`` takes a config container and builds models through a
  ``GPTModelConfig``'s builder; `fe_megatron.megatron_lm` drives that trainer through the hooks in
  `trainer` (the model class its builder constructs, the optimizer overrides, the optimizer chain it
  trains with, the log, the save, and what a host without CUDA needs);
* later (megatron-core's main branch): ``_forward_post_mlp`` is gone; `post_mlp` does its work
  (the MLP's bias-dropout-add) when the layer lacks it.
"""

from fe_megatron.megatron.compat.checkpoints import (install_checkpoint_writer_queue,
                                                     point_hybrid_state_at_gpt_checkpoint,
                                                     reads_common_state_inside_torch_dist,
                                                     repair_gpt_to_hybrid_memory_load, unreadable_checkpoint_problem)
from fe_megatron.megatron.compat.contracts import (CONTRACTS, Contract, UpstreamMoved, broken_contracts,
                                                   unsupported_version_message)
from fe_megatron.megatron.compat.cpu import (CPU_BACKEND_MODULES, CPU_TRAINER_MODULES, build_fsdp_device_meshes_on,
                                             quiet_rng_tracker_warnings, replace_device_rng_state_functions,
                                             replace_module_torch, split_sizes_as_numpy_on_the_host)
from fe_megatron.megatron.compat.layers import (default_block_norm, ensure_metadata_dp_cp_group, forward_attention,
                                                forward_mlp, fused_softmax_available, num_layers_to_build, post_mlp,
                                                pre_mlp_layernorm, repair_moe_router_without_te)
from fe_megatron.megatron.compat.optimizer import (SCHEDULE_GROUP_KEYS, STRUCTURAL_GROUP_KEYS,
                                                   adopt_checkpoint_group_values, chained_optimizer_class,
                                                   distributed_optimizer_class, distributed_optimizer_runs_torch_adam,
                                                   fp32_optimizer_class, group_identifier, loader_group_identifier,
                                                   optimizer_members,
                                                   param_group_identifier_keys, restore_group_values,
                                                   sharded_parameters, step_with_grad_norm)
from fe_megatron.megatron.compat.trainer import (add_trainer_param_group_overrides, add_training_log_entries,
                                                 after_each_save, argument_dump_held, around_trainer_loads,
                                                 building_gpt_model_as, building_hybrid_model_as,
                                                 extend_trainer_optimizer, finish_fsdp_param_gathers,
                                                 print_argument_dump, repair_fsdp_dtensor_swiglu_lookup,
                                                 run_trainer_on_host, use_built_dataset_helpers,
                                                 wrap_trainer_checkpointing)
from fe_megatron.megatron.compat.versions import (HYBRID_MINIMUM, NEWEST_TESTED, OLDEST_TESTED,
                                                  SUPPORTED_MEGATRON_CORE, TRAINER_MINIMUM, has_hybrid_model,
                                                  has_megatron_lm_trainer, is_supported_version,
                                                  megatron_core_version)

__all__ = ["CONTRACTS", "CPU_BACKEND_MODULES", "CPU_TRAINER_MODULES", "HYBRID_MINIMUM", "NEWEST_TESTED", "OLDEST_TESTED",
           "SCHEDULE_GROUP_KEYS", "STRUCTURAL_GROUP_KEYS", "SUPPORTED_MEGATRON_CORE", "TRAINER_MINIMUM",
           "add_trainer_param_group_overrides", "add_training_log_entries", "adopt_checkpoint_group_values",
           "after_each_save", "argument_dump_held", "around_trainer_loads", "broken_contracts",
           "build_fsdp_device_meshes_on", "building_gpt_model_as", "building_hybrid_model_as", "chained_optimizer_class",
           "Contract", "default_block_norm", "distributed_optimizer_class", "distributed_optimizer_runs_torch_adam",
           "ensure_metadata_dp_cp_group", "extend_trainer_optimizer", "finish_fsdp_param_gathers", "forward_attention",
           "forward_mlp", "fp32_optimizer_class", "fused_softmax_available", "group_identifier", "has_hybrid_model",
           "has_megatron_lm_trainer", "install_checkpoint_writer_queue", "is_supported_version", "loader_group_identifier",
           "megatron_core_version", "num_layers_to_build", "optimizer_members",
           "param_group_identifier_keys", "point_hybrid_state_at_gpt_checkpoint", "post_mlp", "pre_mlp_layernorm",
           "print_argument_dump", "quiet_rng_tracker_warnings", "reads_common_state_inside_torch_dist",
           "repair_fsdp_dtensor_swiglu_lookup", "repair_gpt_to_hybrid_memory_load", "repair_moe_router_without_te",
           "replace_device_rng_state_functions", "replace_module_torch", "restore_group_values", "run_trainer_on_host",
           "sharded_parameters", "split_sizes_as_numpy_on_the_host", "step_with_grad_norm",
           "unreadable_checkpoint_problem", "unsupported_version_message", "UpstreamMoved", "use_built_dataset_helpers",
           "wrap_trainer_checkpointing"]
