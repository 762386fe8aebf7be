"""ShortConv: the causal refinement of Eq. 10, ``SiLU(Conv1D(RMSNorm(v_{<=t})))_t``."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class ShortConv(nn.Module):
    """RMSNorm, then a causal depthwise 1-D convolution (kernel ``K``, dilation ``r``), then SiLU.

    Position t reads positions ``t, t-r, ..., t-(K-1)r`` only.  The caller adds the residual
    (``m_t = v_t + ShortConv(v)_t``, Eq. 10).  The weight starts at zero, as in Engram, so the
    branch starts as ``m_t = v_t`` and the convolution learns from there.

    Parameters: ``norm.weight`` [C], ``weight`` [C, K] (tap ``K-1`` multiplies position t).
    """

    def __init__(self, channels: int, kernel_size: int, dilation: int, eps: float = 1e-5):
        super().__init__()
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.norm = nn.RMSNorm(channels, eps=eps)
        self.weight = nn.Parameter(torch.zeros(channels, kernel_size))

    @property
    def receptive_field(self) -> int:
        """How many earlier positions an output depends on: ``(K - 1) * r``."""
        return (self.kernel_size - 1) * self.dilation

    def forward(self, values: torch.Tensor, history: int = 0, sequence_dim: int = 1) -> torch.Tensor:
        """values: ``[batch, seq, C]`` (``sequence_dim=1``) or ``[seq, batch, C]`` (``sequence_dim=0``);
        returns the same layout with ``seq - history`` positions.

        ``history`` leading positions are context only (e.g. rows received from the previous
        sequence-parallel rank); no output is produced for them.
        """
        normed = self.norm(values).movedim(sequence_dim, -1)  # [B, C, T]
        missing = self.receptive_field - history  # zero padding still needed on the left
        padded = F.pad(normed, (missing, 0)) if missing >= 0 else normed[..., -missing:]
        out = F.conv1d(padded, self.weight.unsqueeze(1), dilation=self.dilation, groups=self.weight.shape[0])
        return F.silu(out).movedim(-1, sequence_dim)

    def last(self, window: torch.Tensor) -> torch.Tensor:
        """The output at the last position of ``window`` (``[batch, receptive_field + 1, C]``: that position and
        the ``(K-1) r`` before it), as `forward` computes it: a decoding step's Eq. 10 without the convolution's
        call overhead. Returns ``[batch, C]``."""
        taps = window[:, ::self.dilation]  # positions t-(K-1)r, .., t-r, t: the kernel's taps, in its order
        if taps.shape[1] != self.kernel_size:
            raise ValueError(f"a window of {window.shape[1]} positions; the last position's output reads "
                             f"receptive_field + 1 = {self.receptive_field + 1}")
        return F.silu((self.norm(taps) * self.weight.t()).sum(1))
