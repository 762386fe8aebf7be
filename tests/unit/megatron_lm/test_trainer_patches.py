"""Megatron-LM's trainer (`fe_megatron.megatron_lm.run`) installs every replacement of megatron.training's,
megatron-core's and torch's attributes into its run's patch scope: inside the scope each is replaced, after it
(also after a run that raised) each is the original again. A whole trainer run in a fresh interpreter, with
the same check after it: tests/integration/test_megatron_lm.py."""

import types

import pytest
import torch

from fe_megatron.megatron import compat
from tests.helpers.patched import changed, snapshot

pytestmark = pytest.mark.skipif(not compat.has_megatron_lm_trainer(), reason=(
    f"megatron-core {compat.megatron_core_version()} has no Megatron-LM trainer (megatron.training, "
    f"{compat.TRAINER_MINIMUM} on); `make test-newest` runs these tests"))

# what a run with memory in stores, a hybrid model and Megatron-FSDP's checkpoints replaces on every machine
TRAINER_HOOKS = {
    "ops.weight_gradient_sinks()", "megatron.core.datasets.utils.compile_helpers",
    "megatron.core.dist_checkpointing.gpt_checkpoint_interop.retarget_sharded_state_dict_to_gpt_checkpoint",
    "megatron.training.training.get_megatron_optimizer_config", "megatron.training.training.get_megatron_optimizer",
    "megatron.training.training.training_log", "megatron.training.training.save_checkpoint",
    "megatron.training.training.load_checkpoint",
}
# and on a host without CUDA
HOST = {
    "torch.Tensor.cuda", "torch.Tensor.type", "megatron.training.training.torch",
    "megatron.training.training.initialize_megatron", "megatron.training.training.build_pretraining_data_loader",
    "megatron.training.initialize._warmup_jit_function",
    "megatron.training.datasets.data_samplers.build_pretraining_data_loader",
}


def test_every_trainer_hook_is_undone_when_the_run_s_scope_ends_with_an_exception():
    from fe_megatron.megatron.patches import PatchScope
    from fe_megatron.megatron_lm.run import install_trainer_hooks, set_up_host

    args = types.SimpleNamespace(lr=1e-3, min_lr=1e-4, fe_table_lr_mult=2.0, fe_table_weight_decay_mult=0.0,
                                 use_megatron_fsdp=True, ckpt_format="fsdp_dtensor", save=None, load=None)
    plan = types.SimpleNamespace(in_stores=True, tables_in_model_state_dict=False)
    state = types.SimpleNamespace(memory=object(), family="hybrid", plan=plan, add_table_member=lambda chain: chain,
                                  log_entries=lambda loss_dict, iteration: {}, seal_checkpoint=lambda iteration: None)
    before = snapshot()
    with pytest.raises(RuntimeError, match="the trainer failed"):
        with PatchScope("Megatron-LM's trainer") as scope:
            set_up_host(scope)
            install_trainer_hooks(scope, args, state)
            during = snapshot()
            raise RuntimeError("the trainer failed")
    replaced = {line.split(": ")[0] for line in changed(before, during)}
    from megatron.training import checkpointing

    expected = TRAINER_HOOKS | (set() if torch.cuda.is_available() else HOST)
    if getattr(checkpointing, "handle_swiglu_in_state_dict", None) is not None:  # Megatron-FSDP is installed
        expected.add("megatron.training.checkpointing.handle_swiglu_in_state_dict")
    assert expected <= replaced, sorted(expected - replaced)
    assert changed(before, snapshot()) == []
