"""Megatron-LM's ``pretrain_gpt.py``, with FactorEngram: a drop-in for an existing command line.

    torchrun --nproc-per-node 8 -m fe_megatron.megatron_lm.pretrain_gpt <the pretrain_gpt.py arguments> \\
        --fe-memory-preset factorengram-340m

(or the console script ``fe-megatron-lm-pretrain-gpt``). Every ``pretrain_gpt.py`` argument
means what it means there; the ``--fe-*`` arguments (`fe_megatron.megatron_lm.arguments`) add the
memory branch. Without them this trains Megatron-LM's stock GPT model. It runs
``megatron.training.pretrain`` (megatron-core 0.19 on) with:

* the model: Megatron-LM's GPT builder with the memory branch (`fe_megatron.megatron_lm.model`);
* the batch: token ids on every stage that holds a memory layer, hashed before a context-parallel
  split (`fe_megatron.megatron_lm.batch`);
* the loss: the LM loss as Megatron-LM computes it; the sparsity term (Eq. 12-13) enters through
  its auxiliary-loss scale, set here for every microbatch, and is logged as ``sparsity loss``;
* the tables as fe-pretrain's table plan says (`fe_megatron.tables.plan`): the trainer's parameters,
  in a group of their own (learning-rate and weight-decay multipliers) through Megatron-LM's
  optimizer overrides, or in stores, trained by a table member added to the optimizer chain the
  trainer builds;
* checkpoints in Megatron-LM's format under ``--save``, with an ``fe_run.json`` beside them for
  ``fe-convert mcore-to-hf``.

Not carried over from Megatron-LM's script: supervised fine-tuning (``--sft``), fill-in-the-middle
data, packed sequences, multi-token prediction with memory, and ModelOpt; use Megatron-LM's own
script for those. Arguments the memory branch cannot honor are refused at start-up, by name.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import Optional


def _needs_trainer(family: str = "gpt") -> Optional[str]:
    """Why Megatron-LM's trainer (and, for ``family`` ``hybrid``, megatron-core's HybridModel) cannot run
    here (None: it can)."""
    try:
        from fe_megatron.megatron import compat
    except ImportError as error:
        return f"megatron-core is not installed ({error}); pip install 'megatron-core>=0.19,<0.20'"
    if compat.has_megatron_lm_trainer() and (family != "hybrid" or compat.has_hybrid_model()):
        return None
    if family == "hybrid" and compat.has_megatron_lm_trainer():
        return (f"fe_megatron.megatron_lm.pretrain_hybrid builds megatron-core's HybridModel, which megatron-core "
                f"{compat.HYBRID_MINIMUM} and newer ship; megatron-core {compat.megatron_core_version()} is "
                f"installed here. Install megatron-core>={compat.HYBRID_MINIMUM},<0.20")
    return (f"fe_megatron.megatron_lm runs Megatron-LM's trainer (megatron.training) as megatron-core "
            f"{compat.TRAINER_MINIMUM} and newer ship it; megatron-core {compat.megatron_core_version()} is "
            f"installed here. Install megatron-core>={compat.TRAINER_MINIMUM},<0.20 (Python 3.12; `make "
            "setup-newest` builds such an environment), or train with fe-pretrain, which runs on every "
            "supported release")


def main(argv: Optional[list] = None) -> int:
    return start(argv, "gpt")


def start(argv: Optional[list], family: str) -> int:
    """The drop-in of Megatron-LM's ``pretrain_<family>.py`` (``gpt`` or ``hybrid``) on ``argv``."""
    # as fe-pretrain and Megatron-LM's launch scripts set it (ordered tensor-parallel communication); a
    # value the user set is kept. Not for Megatron-FSDP, which refuses 1 (its recipe unsets it)
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--use-megatron-fsdp" not in argv:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if not faulthandler.is_enabled():  # a crash in native code prints every thread's Python stack
        faulthandler.enable()
    problem = _needs_trainer(family)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from fe_megatron.megatron_lm.run import run

    return run(argv, family)


if __name__ == "__main__":
    sys.exit(main())
