"""Megatron-LM's ``pretrain_hybrid.py``, with FactorEngram: a drop-in for an existing command line.

    torchrun --nproc-per-node 8 -m fe_megatron.megatron_lm.pretrain_hybrid <the pretrain_hybrid.py arguments> \\
        --fe-memory-preset factorengram-340m --fe-memory-layers 20 24

(or the console script ``fe-megatron-lm-pretrain-hybrid``). It builds megatron-core's ``HybridModel``
(0.19 on) from ``--hybrid-layer-pattern`` through Megatron-LM's own builder, and takes the same
``--fe-*`` arguments as `fe_megatron.megatron_lm.pretrain_gpt`, with one difference: ``--fe-memory-layers``
names layers of the pattern (0-based, ``|`` not counted), each an attention (``*``) layer, and the memory
goes before its attention. Without them the preset's layers count the pattern's attention layers (the
paper's "layers 10 and 12" are its 10th and 12th ``*``). Everything else is `pretrain_gpt`'s: the batch,
the loss, the table plan, checkpoints with ``fe_run.json``, and the start-up check.

Where Transformer Engine is not installed, or ``--transformer-impl local`` asks for them, the stack is
megatron-core's local layers (`fe_megatron.megatron.hybrid_specs`): ``*`` attention, ``-`` MLP, ``E`` MoE;
a CPU machine trains there. Refused by name: other layer kinds on that stack, memory on a non-attention
layer (MLA ``+`` included: `fe_megatron.hybrid_pattern`), multi-token prediction (``/``) with memory
layers, the FFN placements, and whatever `pretrain_gpt` refuses. A pattern of ``*-`` pairs is the GPT model: its
checkpoints convert with ``fe-convert mcore-to-hf``.
"""

from __future__ import annotations

import sys
from typing import Optional

from fe_megatron.megatron_lm.pretrain_gpt import start


def main(argv: Optional[list] = None) -> int:
    return start(argv, "hybrid")


if __name__ == "__main__":
    sys.exit(main())
