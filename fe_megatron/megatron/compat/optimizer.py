"""megatron-core's optimizer internals as fe_megatron uses them: the chain the tables' member joins
(``ChainedOptimizer``, ``FP32Optimizer``), the keys its checkpoint loader pairs parameter groups by,
one gradient norm per step, the distributed optimizer on torch's Adam, and the optimizer states'
sharding.  The contracts (`fe_megatron.megatron.compat.contracts`) check each on the installed release."""

from __future__ import annotations

import inspect


def chained_optimizer_class():
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    return ChainedOptimizer


def fp32_optimizer_class():
    from megatron.core.optimizer.optimizer import FP32Optimizer

    return FP32Optimizer


def param_group_identifier_keys() -> tuple:
    """The keys Megatron's checkpoint loader tells an optimizer's parameter groups apart by."""
    from megatron.core.optimizer import optimizer

    return tuple(optimizer.param_group_identifier_keys)


# The keys that tell an optimizer's parameter groups apart by what they hold (megatron-core 0.16's
# param_group_identifier_keys).  0.19 adds the schedule's per-group values (max_lr, min_lr, start_wd,
# end_wd, optimizer) to its identifiers, so a resume with another optimizer.lr finds no matching group.
STRUCTURAL_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
# A group's own schedule values, which a loaded group brings from the checkpoint in every release
SCHEDULE_GROUP_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")


def group_identifier(group: dict) -> tuple:
    """What tells parameter group ``group`` apart in every supported release (`STRUCTURAL_GROUP_KEYS`)."""
    return tuple(group.get(key) for key in STRUCTURAL_GROUP_KEYS)


def loader_group_identifier(group: dict) -> tuple:
    """What the installed release's checkpoint loader pairs parameter group ``group`` by
    (`param_group_identifier_keys`: from 0.19 also the group's schedule values)."""
    return tuple(group.get(key) for key in param_group_identifier_keys())


def adopt_checkpoint_group_values(optimizer, loaded_groups: list) -> list:
    """``loaded_groups``: the checkpoint's parameter groups of each member of ``optimizer``'s chain.
    Give every current parameter group the values the checkpoint's group with the same
    `STRUCTURAL_GROUP_KEYS` holds for the other identifier keys (from 0.19: the schedule's max_lr,
    min_lr, start_wd, end_wd), so that megatron-core pairs the groups whatever the schedule asked for
    now; the loaded groups then carry the checkpoint's values, as 0.16 loads them.  Returns each
    group's schedule values (`SCHEDULE_GROUP_KEYS`) from before, for `restore_group_values` (to follow
    this config's schedule instead of the checkpoint's)."""
    schedule_keys = [key for key in param_group_identifier_keys() if key not in STRUCTURAL_GROUP_KEYS]
    kept = sorted(set(schedule_keys) | set(SCHEDULE_GROUP_KEYS))
    before = []
    for member, member_groups in zip(optimizer_members(optimizer), loaded_groups):
        loaded = {group_identifier(group): group for group in member_groups}
        for group in member.optimizer.param_groups:
            before.append({key: group.get(key) for key in kept})
            match = loaded.get(group_identifier(group))
            if match is not None:
                for key in schedule_keys:
                    if key in match:
                        group[key] = match[key]
                    else:
                        group.pop(key, None)
    return before


def restore_group_values(optimizer, before: list) -> None:
    """Put back the values `adopt_checkpoint_group_values` returned into the loaded groups."""
    groups = [group for member in optimizer_members(optimizer) for group in member.optimizer.param_groups]
    for group, values in zip(groups, before):
        for key, value in values.items():
            if value is None:
                group.pop(key, None)
            else:
                group[key] = value


def optimizer_members(optimizer) -> list:
    """The members of a ``ChainedOptimizer``, or ``[optimizer]``."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def step_with_grad_norm(optimizer, grad_norm: float) -> bool:
    """The rest of ``optimizer.step()`` once ``prepare_grads()`` and ``get_grad_norm()`` have run:
    clip every member by ``grad_norm`` (as ``ChainedOptimizer.step`` does) and apply the update.
    Megatron's own ``step()`` would prepare the gradients and compute the norm a second time: two
    passes over every gradient, the tables' included.  Returns whether the update was applied.
    Not applied here, as fe_megatron sets neither: 0.19's ``grad_norm_skip_threshold`` (a step
    skipped above a norm) and multi-token prediction's per-group clipping."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    takes_decoupled = "use_decoupled_grad" in inspect.signature(clip_grad_by_total_norm_fp32).parameters
    for member in optimizer_members(optimizer):
        if getattr(member, "is_stub_optimizer", False) or member.config.clip_grad <= 0.0:
            continue
        parameters = member.get_parameters()
        if not parameters:
            continue
        extra = {}
        if takes_decoupled:
            extra["use_decoupled_grad"] = bool(
                getattr(member.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                        getattr(member.config, "use_precision_aware_optimizer", False)))
        clip_grad_by_total_norm_fp32(parameters, max_norm=member.config.clip_grad, total_norm=grad_norm, **extra)
    return bool(optimizer.step_with_ready_grads())


def distributed_optimizer_class():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer


def distributed_optimizer_runs_torch_adam() -> bool:
    """Whether the distributed optimizer runs torch's own Adam (no Apex or Transformer Engine fused
    Adam), which keeps its step count in every parameter's state instead of the groups."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def sharded_parameters(model_sharded_state_dict: dict, parameters) -> dict:
    """``{index: ShardedTensor or factory}``: the model's sharded object of each of ``parameters``."""
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    return get_param_id_to_sharded_param_map(model_sharded_state_dict, parameters)
