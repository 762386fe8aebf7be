"""The torch norm for the local spec, with sequence-parallel support.

megatron.core falls back to ``WrappedTorchNorm`` when neither apex nor Transformer Engine
is installed (always the case on CPU), and that wrapper refuses ``sequence_parallel``
because it does not mark its weights. Under sequence parallelism each TP rank normalizes
different tokens, so the weights' gradients are partial: marking them
``sequence_parallel`` makes ``finalize_model_grads`` sum them across TP ranks.
"""

import torch


class TorchNorm:
    """``torch.nn.RMSNorm`` or ``LayerNorm`` per ``config.normalization``, built like megatron's norms."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r} is not supported; use 'RMSNorm' or 'LayerNorm'")
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm
