"""FactorEngram in a training script of one's own, in the shape of Megatron-LM's ``pretrain_gpt.py``.

Such a script parses Megatron-LM's arguments, builds its GPT model configuration and calls
``megatron.training.pretrain`` with its own batch, loss and forward step. Three lines give it the
memory branch (docs/megatron_lm.md, "A training script of your own"):

    from fe_megatron.megatron_lm.custom_script import add_factorengram_arguments, with_factorengram

    args = parse_and_validate_args(extra_args_provider=add_factorengram_arguments, ...)
    model_config, forward_step = with_factorengram(args, forward_step)   # instead of gpt_config_from_args(args)

`with_factorengram` runs the drop-in's start-up check and set-up (`fe_megatron.megatron_lm.run`): the
model configuration carries the memory branch, the tables follow the table plan, the log gets
``sparsity loss``, checkpoints are sealed with ``fe_run.json`` for ``fe-convert``, and the returned
forward step sets the sparsity term's gradient scale before calling the script's own. The script's
batch must give the token ids to every pipeline stage that holds a memory layer (the model hashes
them); `fe_megatron.megatron_lm.pretrain_gpt` does all of this for Megatron-LM's own script.

What it replaces in megatron.training, megatron-core and torch for that (`fe_megatron.megatron.compat.trainer`,
the CPU backend on a host without CUDA) lasts until the process exits, or, where the script passes the
`fe_megatron.megatron.patches.PatchScope` it trains in, until that scope closes:

    with PatchScope() as scope:
        model_config, forward_step = with_factorengram(args, forward_step, scope)
        pretrain(...)
"""

from __future__ import annotations

import atexit
import sys
from functools import partial
from typing import Optional

from fe_megatron.megatron.patches import PatchScope
from fe_megatron.megatron_lm.arguments import add_factorengram_arguments

__all__ = ["add_factorengram_arguments", "with_factorengram"]


def with_factorengram(args, forward_step, scope: Optional[PatchScope] = None):
    """``(model_config, forward_step)`` for ``megatron.training.pretrain``: Megatron-LM's GPT model
    configuration of ``args`` with the memory branch where the ``--fe-*`` arguments ask for it, and
    ``forward_step`` with the sparsity scale set first. Exits with status 2, after one message naming
    every argument the run cannot honor, as the drop-in does. What it patches goes into ``scope`` (an
    open one, around the script's ``pretrain``), or into a scope of its own that closes at exit."""
    from fe_megatron.megatron_lm.run import ArgumentsRefused, refuse_arguments, prepare_trainer, set_up_host
    from fe_megatron.training.distributed import destroy_process_groups

    if scope is None:
        scope = PatchScope("training script").open()
        atexit.register(scope.close)  # after destroy_process_groups below: atexit runs the last registered first
    on_host = set_up_host(scope)
    problems = []
    if args.calculate_per_token_loss and (args.fe_memory_config or args.fe_memory_preset):
        problems.append("--calculate-per-token-loss: the sparsity term of a microbatch is weighted by its tokens, "
                        "which a script's own batch does not report; train with fe_megatron.megatron_lm.pretrain_gpt "
                        "(whose batch counts them), or without per-token loss")
    try:
        model_config, state = prepare_trainer(args, on_host, scope=scope)
    except ArgumentsRefused as refused:
        problems += refused.problems
    if problems:
        sys.exit(refuse_arguments(problems, args.rank))
    # joined before Python's own exit, where gloo's threads can abort a finished run (docs/operations.md)
    atexit.register(destroy_process_groups)
    return model_config, partial(_forward_step_with_memory, forward_step=forward_step, state=state)


def _forward_step_with_memory(data_iterator, model, *args, forward_step, state, **kwargs):
    """The script's forward step, with the sparsity term's gradient scale set first (as Megatron's
    schedules scale the mean LM loss, `fe_megatron.megatron_lm.steps.sparsity_scale`), and
    evaluation's terms kept out of the training log."""
    if state.memory is None:
        return forward_step(data_iterator, model, *args, **kwargs)
    from megatron.core.utils import get_attr_wrapped_model

    from fe_megatron.megatron.sparsity import SparsityLossAutoScaler
    from fe_megatron.megatron_lm.steps import sparsity_scale

    SparsityLossAutoScaler.set_loss_scale(sparsity_scale(model))
    output = forward_step(data_iterator, model, *args, **kwargs)
    if not model.training:
        get_attr_wrapped_model(model, "pop_sparsity_loss")()
    return output
