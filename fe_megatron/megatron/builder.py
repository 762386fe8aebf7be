"""Build a pipeline stage's GPT model, wrap it in Megatron DDP, and make its optimizer."""

from __future__ import annotations

from typing import Optional

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate
from megatron.core.optimizer_param_scheduler import ParamGroupOverride

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron import compat, patches
from fe_megatron.megatron.gpt_model import FactorEngramGPTModel
from fe_megatron.megatron.layer_specs import get_block_spec, get_gpt_layer_with_factorengram_spec, get_local_layer_spec
from fe_megatron.megatron.table_optimizer import TableChainedOptimizer, TableOptimizer
from fe_megatron.training.param_groups import NO_DECAY_NAMES, TABLE_ATTRIBUTE


def build_gpt_model(transformer_config, vocab_size: int, max_sequence_length: int,
                    memory_config: Optional[MemoryConfig] = None, backend: str = "local",
                    share_embeddings: bool = True, rotary_base: float = 10000.0,
                    table_sharding: str = "replicated", prefetch_table_rows: bool = True):
    """This pipeline stage's model: FactorEngram/Engram when ``memory_config`` is given, else the
    plain Transformer with the same backbone (RoPE, RMSNorm, SwiGLU per ``transformer_config``).
    ``table_sharding="rows"`` shards the tables' rows over their row group (every data-parallel rank,
    `fe_megatron.megatron.parallel.table_row_group`).  A ``transformer_config`` with
    ``num_moe_experts`` gets Megatron's MoE FFN (sequential experts) in every layer."""
    kwargs = dict(pre_process=parallel_state.is_pipeline_first_stage(),
                  post_process=parallel_state.is_pipeline_last_stage(),
                  share_embeddings_and_output_weights=share_embeddings, position_embedding_type="rope",
                  rotary_base=rotary_base)
    experts = {}
    if transformer_config.num_moe_experts:
        compat.repair_moe_router_without_te(patches.active())  # the run's scope
        experts = dict(num_experts=transformer_config.num_moe_experts, moe_grouped_gemm=False)
    if memory_config is None:
        if backend == "te":
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            spec = get_gpt_layer_with_transformer_engine_spec(**experts)
        else:
            spec = get_local_layer_spec(**experts)
        return GPTModel(transformer_config, get_block_spec(spec, transformer_config), vocab_size,
                        max_sequence_length, **kwargs)
    layer_spec = get_gpt_layer_with_factorengram_spec(memory_config, backend=backend, table_sharding=table_sharding,
                                                      **experts)
    spec = get_block_spec(layer_spec, transformer_config)
    return FactorEngramGPTModel(transformer_config, spec, vocab_size, max_sequence_length, memory_config,
                                prefetch_table_rows=prefetch_table_rows, **kwargs)


def build_hybrid_model(transformer_config, vocab_size: int, max_sequence_length: int, hybrid_layer_pattern: str,
                       memory_config: Optional[MemoryConfig] = None, share_embeddings: bool = True,
                       rotary_base: float = 10000.0, table_sharding: str = "replicated"):
    """This pipeline stage's megatron-core ``HybridModel`` (0.19 on) of ``hybrid_layer_pattern`` on the local
    hybrid stack (`fe_megatron.megatron.hybrid_specs`), with ``memory_config``'s branches before the attention
    of its attention layers (`fe_megatron.megatron.hybrid_model`), or without memory. ``transformer_config``
    has one layer per symbol of the pattern."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from fe_megatron.megatron.hybrid_model import FactorEngramHybridModel
    from fe_megatron.megatron.hybrid_specs import local_hybrid_stack_spec

    if transformer_config.num_moe_experts:
        compat.repair_moe_router_without_te(patches.active())  # the run's scope
    spec = local_hybrid_stack_spec(num_experts=transformer_config.num_moe_experts or None)
    kwargs = dict(pre_process=parallel_state.is_pipeline_first_stage(),
                  post_process=parallel_state.is_pipeline_last_stage(),
                  share_embeddings_and_output_weights=share_embeddings, position_embedding_type="rope",
                  rotary_base=rotary_base)
    if memory_config is None:
        return HybridModel(transformer_config, spec, vocab_size, max_sequence_length,
                           hybrid_layer_pattern=hybrid_layer_pattern, **kwargs)
    return FactorEngramHybridModel(transformer_config, spec, vocab_size, max_sequence_length, hybrid_layer_pattern,
                                   memory_config, table_sharding=table_sharding, **kwargs)


def wrap_ddp(model, transformer_config, use_distributed_optimizer: bool = False,
             overlap_grad_reduce: bool = False) -> DistributedDataParallel:
    """``model`` in Megatron's DDP.  Row-sharded tables must be in stores by then
    (`fe_megatron.megatron.table_optimizer.manage_tables`, as `fe_megatron.tables.plan` rules):
    DDP would reduce their rows, different on every rank, over the expert-data-parallel ranks."""
    if parallel_state.get_expert_data_parallel_world_size() > 1:
        held = [name for name, param in model.named_parameters() if getattr(param, "row_sharded", False)]
        if held:
            raise ValueError(f"row-sharded tables {held[:2]} are parameters, which DDP would all-reduce over the "
                             "data-parallel ranks although each holds other rows; move them into stores first "
                             "(fe_megatron.megatron.table_optimizer.manage_tables), as TablePlan rules for rows")
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
                                               use_distributed_optimizer=use_distributed_optimizer)
    ddp = DistributedDataParallel(config=transformer_config, ddp_config=ddp_config, module=model)
    ddp.broadcast_params()  # Megatron DDP does not broadcast initial parameters itself
    return ddp


def table_group_overrides(lr: float, min_lr, table_lr_mult: float = 1.0, table_weight_decay_mult: float = 1.0) -> dict:
    """``{ParamKey: ParamGroupOverride}`` of the memory tables' parameter group (empty when both
    multipliers are 1: the tables then share the other weights' group), for megatron-core's
    ``get_megatron_optimizer(config_overrides=...)``; see `build_optimizer`."""
    table_override = ParamGroupOverride()
    if table_weight_decay_mult != 1.0:
        table_override["wd_mult"] = table_weight_decay_mult
    if table_lr_mult != 1.0:
        table_override["max_lr"] = lr * table_lr_mult
        table_override["min_lr"] = (min_lr or 0.0) * table_lr_mult
        table_override["lr_mult"] = table_lr_mult
    return {ParamKey(attr=TABLE_ATTRIBUTE): table_override} if table_override else {}


def build_optimizer(model_chunks: list, optimizer_config: OptimizerConfig, table_lr_mult: float = 1.0,
                    table_weight_decay_mult: float = 1.0, tables=None):
    """Megatron's optimizer with the usual groups (no weight decay on norms and biases) plus one for
    the memory tables: learning-rate multiplier ``table_lr_mult``, weight decay multiplier
    ``table_weight_decay_mult`` (1 by default, as the paper trains: decay 0.01 on every weight;
    0 is Engram's exemption, which keeps decay from pulling rarely-seen rows towards zero between
    visits).  With ``tables`` (`fe_megatron.megatron.table_optimizer.manage_tables`: tables in
    stores) the tables' member of the chain is a `TableOptimizer` over them.

    The table learning rate is the group's ``max_lr`` / ``min_lr``; the group also carries
    ``lr_mult`` because Megatron's checkpoint loader tells groups apart by ``(wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr)`` (megatron.core's scheduler does not read ``lr_mult``; from
    0.19 the loader also compares the groups' rates, which `compat.adopt_checkpoint_group_values`
    reconciles).  Groups those four keys (`compat.STRUCTURAL_GROUP_KEYS`) cannot tell apart would
    load with the wrong parameters on some release, so they are refused.
    """
    len1 = ParamPredicate(name="param_len_1", fn=lambda p: len(p.shape) == 1)  # fe_megatron.training.param_groups
    overrides = {ParamKey(name=NO_DECAY_NAMES, predicate=len1): ParamGroupOverride(wd_mult=0.0)}
    overrides.update(table_group_overrides(optimizer_config.lr, optimizer_config.min_lr, table_lr_mult,
                                           table_weight_decay_mult))
    optimizer = get_megatron_optimizer(optimizer_config, model_chunks, config_overrides=overrides)
    if tables is not None:
        optimizer = with_table_member(optimizer, tables, table_lr_mult, table_weight_decay_mult)
    return check_group_identifiers(optimizer)


def with_table_member(optimizer, tables, table_lr_mult: float = 1.0, table_weight_decay_mult: float = 1.0):
    """Megatron's optimizer chain ``optimizer`` with a `TableOptimizer` over ``tables`` (the stores of
    `fe_megatron.megatron.table_optimizer.manage_tables`) as its last member; fe-pretrain's engine and
    Megatron-LM's trainer (`fe_megatron.megatron_lm`) both build it here."""
    member = TableOptimizer(tables, optimizer.config, table_lr_mult, table_weight_decay_mult)
    # the table groups say is_expert_parallel (no dense group of Megatron's does); beside an expert-parallel
    # MoE backbone's groups of the same multipliers they say is_decoupled_lr too, which no expert group does
    # (the identifiers of the tables' groups written before MoE backbones existed stay as they were)
    taken = {compat.group_identifier(group) for group in optimizer.param_groups}
    for group in member.param_groups:
        if compat.group_identifier(group) in taken:
            group["is_decoupled_lr"] = True
    return TableChainedOptimizer(compat.optimizer_members(optimizer) + [member])


def check_group_identifiers(optimizer, identifier=None, remedy: str = "change optimizer.table_lr_mult or "
                            "optimizer.table_weight_decay_mult"):
    """``optimizer``, refused when two parameter groups of one member of its chain share the identifier
    a checkpoint loader pairs groups by (each member loads its own groups). ``identifier(group)``:
    `compat.group_identifier` (the keys every supported release compares; fe-pretrain's loader pairs
    groups by them, `compat.adopt_checkpoint_group_values`) unless given; Megatron-LM's trainer passes
    `compat.loader_group_identifier`, the installed release's own, which from 0.19 tells the
    decoupled-learning-rate groups (``--decoupled-lr``) apart by their rate. ``remedy``: what to change."""
    identifier = identifier or compat.group_identifier
    for member in compat.optimizer_members(optimizer):
        keys = [identifier(group) for group in member.param_groups]
        if len(set(keys)) != len(keys):
            raise ValueError(f"optimizer parameter groups {keys} share identifiers, so a checkpoint of them "
                             f"would not load; {remedy}")
    return optimizer


def connect_schedule_hooks(transformer_config, model_chunks: list, optimizer) -> None:
    """What Megatron-LM's setup does so that its schedules finalize gradients and scale losses."""
    transformer_config.finalize_model_grads_func = finalize_model_grads
    transformer_config.grad_scale_func = optimizer.scale_loss
    transformer_config.no_sync_func = model_chunks[0].no_sync if len(model_chunks) == 1 else [
        m.no_sync for m in model_chunks]
