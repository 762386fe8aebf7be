"""TableAdamW: AdamW for n-gram tables stored in fp32 or bf16 (``memory.table_dtype``).

The update is torch's AdamW (decoupled weight decay, bias-corrected moments), computed in fp32
from the stored rows.  fp32 tables take it as torch's AdamW does, to the bit.  bf16 tables hold
only the bf16 rows: each step reads a block of rows as fp32, updates it, and writes it back with
stochastic rounding (`fe_megatron.memory.table_storage.stochastic_round_to_bf16`), so updates far
below a bf16 step still move the rows in expectation.  Rounding to nearest would drop them.

Optimizer state precision (the documented choice): the two moments stay fp32, 8 bytes per table
parameter, as FBGEMM's and TorchRec's low-precision tables keep full-precision optimizer state
by default.  The gradient is read from ``main_grad`` (an fp32 accumulator the row exchange adds
into) when the parameter has one, else from ``grad``.

The random bits of a step are a function of ``(seed, parameter index, step)``, so a resumed run
rounds exactly as the uninterrupted one did, with no generator state to checkpoint.  The state
dict has torch AdamW's layout (``step``, ``exp_avg``, ``exp_avg_sq``).
"""

from __future__ import annotations

import torch

from fe_megatron.memory.table_storage import stochastic_round_to_bf16

ROWS_PER_BLOCK = 1 << 16  # rows updated at a time in a bf16 table: bounds the fp32 scratch


class TableAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.seed = seed
        for group in self.param_groups:
            for param in group["params"]:
                if param.dtype not in (torch.float32, torch.bfloat16):
                    raise TypeError(f"TableAdamW updates fp32 or bf16 tables; got a {param.dtype} parameter of shape "
                                    f"{tuple(param.shape)}")

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the moments stay fp32 (torch casts them to a bf16 table's dtype)."""
        super().load_state_dict(state_dict)
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for pid, param in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if saved is not None:
                for key in ("exp_avg", "exp_avg_sq"):
                    self.state[param][key] = saved[key].to(device=param.device, dtype=torch.float32)

    @staticmethod
    def gradient(param: torch.Tensor):
        main_grad = getattr(param, "main_grad", None)
        return main_grad if main_grad is not None else param.grad

    @torch.no_grad()
    def step(self, closure=None):
        index = 0
        for group in self.param_groups:
            for param in group["params"]:
                index += 1
                grad = self.gradient(param)
                if grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                    state["exp_avg_sq"] = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                state["step"] += 1
                step = int(state["step"].item())
                if param.dtype == torch.float32:
                    _adamw(param, grad, state["exp_avg"], state["exp_avg_sq"], step, group)
                    continue
                generator = torch.Generator(device=param.device)
                generator.manual_seed(hash((self.seed, index, step)) & ((1 << 63) - 1))
                for first in range(0, param.shape[0], ROWS_PER_BLOCK):
                    block = slice(first, first + ROWS_PER_BLOCK)
                    rows = param[block].float()
                    _adamw(rows, grad[block], state["exp_avg"][block], state["exp_avg_sq"][block], step, group)
                    param[block] = stochastic_round_to_bf16(rows, generator)
        return None


def _adamw(param, grad, exp_avg, exp_avg_sq, step: int, group: dict) -> None:
    """One AdamW update of fp32 ``param`` in place, in the order of torch's single-tensor AdamW."""
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    grad = grad.float()
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
