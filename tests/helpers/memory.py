"""Independent, straightforward computations for the memory branches' tests: Eq. 10's RMSNorm and the
short convolution written as loops, and random weights where a fresh branch holds zeros."""

import torch


def randomize(module):
    """Non-trivial weights everywhere (the conv starts at zero, the norms at one)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return module


def rms_norm(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def short_conv_loop(v, conv):
    """Eq. 10's refinement, position by position: SiLU(sum_k w_k RMSNorm(v)_{t-(K-1-k) r})."""
    normed = rms_norm(v, conv.norm.weight, conv.norm.eps)
    out = torch.zeros_like(v)
    K, r = conv.kernel_size, conv.dilation
    for t in range(v.shape[1]):
        acc = torch.zeros_like(v[:, 0])
        for k in range(K):
            src = t - (K - 1 - k) * r
            if src >= 0:
                acc = acc + conv.weight[:, k] * normed[:, src]
        out[:, t] = torch.nn.functional.silu(acc)
    return out
