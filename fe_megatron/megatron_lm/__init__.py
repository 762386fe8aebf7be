"""Megatron-LM's own trainer (``megatron.training``, megatron-core 0.19 on) with the memory branch.

``python -m fe_megatron.megatron_lm.pretrain_gpt`` takes a Megatron-LM ``pretrain_gpt.py`` command line
plus ``--fe-*`` arguments (docs/megatron_lm.md). For a training script of one's own, the pieces are
importable: `model.FactorEngramGPTModelConfig` (the model), `batch.get_batch` (the batch rule),
`steps.forward_step` (the sparsity loss scale). Importing this package needs no megatron.training;
its modules do.
"""
