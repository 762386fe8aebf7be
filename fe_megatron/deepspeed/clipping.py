"""One gradient norm over DeepSpeed's parameters and the tables outside ZeRO.

Megatron's engine clips every gradient by one global norm (the table optimizer is a member of its
chain, `fe_megatron.megatron.table_optimizer`).  Under DeepSpeed, tables outside ZeRO (row-sharded,
or whole in stores) are updated by `fe_megatron.deepspeed.tables.StoredTables` beside the engine's
optimizer, which computes its own norm inside its step.  `JointClipping` makes the two one: before
the engine's update the tables' norm is computed, the engine's norm is widened to include it

    ||g|| = sqrt(||g_DeepSpeed||^2 + ||g_tables||^2),

so that DeepSpeed clips its parameters by it (and reports it), and the tables are then clipped by
the same value.  The engines then agree step by step with clipping active, as without it.

DeepSpeed has no public hook for a norm computed outside it, so the norm function of each of its
optimizers is wrapped on the instance (DeepSpeed 0.19):

* ZeRO 1 and 2 (``DeepSpeedZeroOptimizer``): ``scaled_global_norm``, the one global norm it clips by;
* ZeRO 3 (``DeepSpeedZeroOptimizer_Stage3``): ``_get_norm_groups``, the per-group norms it combines;
* stage 0 with fp32: the engine's ``clip_fp32_gradients`` (its gradients are already averaged);
* stage 0 with bf16 (``FP16_UnfusedOptimizer``, for the torch AdamW that fe-pretrain hands
  DeepSpeed): ``unscale_and_clip_grads``, which receives the norm it clips by (and the reported
  norm, set just before, is widened with it);
* ZeRO 1 with bf16 and fp32 gradient accumulation (``BF16_Optimizer``): ``get_grads_for_norm``,
  the tensors it takes the norm of, to which one holding the tables' norm is added (its gradients
  are whole and averaged on every rank, so their norm needs no reduction that would count it twice).

Any other optimizer keeps DeepSpeed's own clipping of its parameters, and the tables are clipped by
their own norm; a run says so when it starts.  These are the subclasses of the ZeRO optimizers
(ZenFlow, SuperOffload), ``FP16_Optimizer`` (stage 0 with bf16 around DeepSpeed's FusedAdam), and
``BF16_Optimizer`` under a model-parallel unit or with DeepSpeed's MoE layers: none of which
fe-pretrain builds.
"""

from __future__ import annotations

import importlib
import math
from typing import Optional

import torch

# What is wrapped or called, by module, class (or None) and attribute: checked by
# tests/unit/deepspeed/test_clipping.py on the installed release, and named in docs/compatibility.md.
DEEPSPEED_INTERNALS = (
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "scaled_global_norm"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_get_norm_groups"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "clip_fp32_gradients"),
    ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer", "unscale_and_clip_grads"),
    ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer", "get_grads_for_norm"),
)


def missing_internals() -> list:
    """The `DEEPSPEED_INTERNALS` the installed DeepSpeed lacks, as ``module.Class.attribute``."""
    missing = []
    for module_name, class_name, attribute in DEEPSPEED_INTERNALS:
        try:
            holder = importlib.import_module(module_name)
            holder = getattr(holder, class_name) if class_name else holder
        except (ImportError, AttributeError):
            holder = None
        if not callable(getattr(holder, attribute, None)):
            missing.append(".".join(part for part in (module_name, class_name, attribute) if part))
    return missing


class JointClipping:
    """The joint norm of ``engine``'s parameters and ``tables`` (`StoredTables`, or None: no tables
    outside ZeRO) for each step.

    Per step: `begin_step` (after the last backward, before ``engine.step()`` at the boundary)
    computes the tables' norm; the engine's step clips by the joint norm; `norms` gives it, for
    ``tables.step`` and the step's report.  ``joined``: whether the engine's optimizer is one whose
    norm is widened (otherwise the tables are clipped by their own norm and DeepSpeed's parameters
    by theirs).  A plain torch optimizer (stage 0 in fp32) has no norm DeepSpeed would report:
    `begin_step` takes it, with or without tables, so that every step reports its gradient norm, and
    the engine's clip uses it instead of taking it a second time."""

    def __init__(self, engine, tables=None):
        self.engine, self.tables = engine, tables
        self.tables_norm: Optional[float] = None
        self.joint_norm: Optional[float] = None
        self.engine_reports_joint = False  # BF16_Optimizer: its reported norm is the joint one (no hook sees it)
        self.takes_fp32_norm = isinstance(engine.optimizer, torch.optim.Optimizer) and not engine.zero_optimization() \
            and not engine.bfloat16_enabled() and not engine.fp16_enabled()
        # a torch optimizer is clipped by the norm begin_step took, with or without tables: not by a second one
        self.joined = self._install(engine) if tables is not None or self.takes_fp32_norm else False

    def describe(self) -> str:
        optimizer = type(self.engine.optimizer).__name__
        if self.joined:
            return f"one gradient norm over DeepSpeed's parameters and the tables ({optimizer}'s, widened)"
        return (f"clipping per part: DeepSpeed's {optimizer} clips its parameters by their norm, the tables are "
                "clipped by theirs (one norm needs DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, "
                "FP16_UnfusedOptimizer without LAMB, BF16_Optimizer without a model-parallel unit or MoE layers, "
                "or a torch optimizer in fp32; docs/deepspeed.md)")

    def begin_step(self) -> None:
        """The tables' norm for this step (their gradients reduced; collective over their groups) and,
        for a plain torch optimizer, the joint norm with its gradients (averaged over the ranks by
        the last backward)."""
        self.tables_norm = self.tables.tables.grad_norm() if self.tables is not None else 0.0
        self.joint_norm = None
        if self.takes_fp32_norm:
            grads = self._fp32_grads()
            self._joint([_norm(grads)], 1.0)  # sets joint_norm
            if not math.isfinite(self.joint_norm):
                for grad in grads:  # a torch optimizer steps whatever its gradients: zero ones, as ZeRO's clip leaves
                    grad.zero_()

    def norms(self, engine_norm: float) -> tuple:
        """``(clip_by, total)`` after the engine's step: the norm to clip the tables by, and the norm of
        every gradient (what the step reports).  Both are the joint norm where the engine computed
        it; otherwise (clipping per part, or an engine that skipped its norm and its update: a
        non-finite gradient) the tables' own, and the combination of ``engine_norm`` (DeepSpeed's
        reported norm, inf after such a skip) with it.  Ends the step: until the next `begin_step`
        the engine's norm is its own."""
        if self.engine_reports_joint and self.tables_norm is not None and math.isfinite(engine_norm):
            self.joint_norm = engine_norm
        norms = step_norms(self.joint_norm, self.tables_norm, engine_norm)
        self.tables_norm = None
        return norms

    # ------------------------------------------------------------------ the hooks
    def _joint(self, engine_norms: list, scale: float, like=None) -> torch.Tensor:
        """The L2 combination of DeepSpeed's norms ``engine_norms`` (times its loss scale ``scale``) and
        the tables' norm, as a tensor on ``like``'s device; an invalid norm among them (DeepSpeed's
        -1 sentinel, inf or nan) makes it inf, as DeepSpeed's own combination does."""
        values = [float(norm) for norm in engine_norms]
        tables = [self.tables_norm * scale] if self.tables_norm is not None else []  # none: not a step of ours
        invalid = any(not math.isfinite(value) or value < 0 for value in values + tables)
        joint = math.inf if invalid else math.sqrt(sum(value * value for value in values + tables))
        self.joint_norm = joint / scale if tables else None
        return torch.tensor(joint, dtype=torch.float32, device=like.device if torch.is_tensor(like) else None)

    def _install(self, engine) -> bool:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        optimizer = engine.optimizer
        kind = type(optimizer)
        if kind is DeepSpeedZeroOptimizer:
            original = _method(optimizer, "scaled_global_norm")

            def scaled_global_norm(norm_type=2):
                norm = original(norm_type)
                return self._joint([norm], optimizer.loss_scale, like=norm)

            optimizer.scaled_global_norm = scaled_global_norm
            return True
        if kind is DeepSpeedZeroOptimizer_Stage3:
            original = _method(optimizer, "_get_norm_groups")

            def get_norm_groups():
                groups = original()  # DeepSpeed combines them into its norm: one group, the joint norm
                return [self._joint(groups, optimizer.loss_scale, like=groups[0] if groups else None)]

            optimizer._get_norm_groups = get_norm_groups
            return True
        if kind is FP16_UnfusedOptimizer and not optimizer.fused_lamb_legacy:
            original = _method(optimizer, "unscale_and_clip_grads")

            def unscale_and_clip_grads(total_norm, apply_scale=True):
                scale = optimizer.loss_scale_config.cur_scale
                joint = self._joint([total_norm], scale, like=total_norm)
                optimizer._global_grad_norm = float(joint) / scale  # what the engine reports, set just before
                return original(joint, apply_scale)

            optimizer.unscale_and_clip_grads = unscale_and_clip_grads
            return True
        if kind is BF16_Optimizer and optimizer.mpu is None and not optimizer.has_moe_layers:
            original = _method(optimizer, "get_grads_for_norm")

            def get_grads_for_norm(for_clipping=False):
                grads = original(for_clipping=for_clipping)
                if for_clipping or self.tables_norm is None:  # the tensors to clip, or not a step of ours
                    return grads
                non_expert, expert = grads
                device = non_expert[0].device if non_expert else None
                return non_expert + [torch.tensor([self.tables_norm], dtype=torch.float32, device=device)], expert

            optimizer.get_grads_for_norm = get_grads_for_norm
            self.engine_reports_joint = True
            return True
        if self.takes_fp32_norm:
            _method(engine, "clip_fp32_gradients")
            engine.clip_fp32_gradients = self._clip_fp32
            return True
        return False

    def _fp32_grads(self) -> list:
        return [p.grad for p in self.engine.module.parameters() if p.grad is not None]

    @torch.no_grad()
    def _clip_fp32(self) -> None:
        """Stage 0 in fp32: the engine's gradients (averaged over the ranks already) clipped by the joint
        norm that `begin_step` took (the engine's step at the boundary always follows it), as
        `StoredTables.step` clips the tables.  A non-finite norm: `begin_step` zeroed them."""
        if not math.isfinite(self.joint_norm):
            return
        coefficient = self.engine.gradient_clipping() / (self.joint_norm + 1e-6)
        if coefficient < 1.0:
            for grad in self._fp32_grads():
                grad.mul_(coefficient)


def _norm(grads: list) -> torch.Tensor:
    """The L2 norm of ``grads`` together, summed in float64."""
    squares = sum((torch.linalg.vector_norm(g, dtype=torch.float64).square() for g in grads),
                  torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None))
    return squares.sqrt()


def step_norms(joint_norm: Optional[float], tables_norm: float, engine_norm: float) -> tuple:
    """``(clip_by, total)`` of `JointClipping.norms`: ``joint_norm`` where the engine computed it
    (None where it did not), else the tables' norm and its combination with the engine's (an
    infinite ``engine_norm``, DeepSpeed's report of a skipped step, stays infinite)."""
    if joint_norm is not None:
        return joint_norm, joint_norm
    return tables_norm, math.hypot(engine_norm, tables_norm)


def _method(holder, name: str):
    """``holder.name``, or an error naming the DeepSpeed release it moved in."""
    found = getattr(holder, name, None)
    if not callable(found):
        import deepspeed

        raise RuntimeError(f"DeepSpeed {deepspeed.__version__}'s {type(holder).__name__} has no {name}(), which "
                           "fe_megatron widens to one gradient norm with the tables outside ZeRO "
                           "(fe_megatron/deepspeed/clipping.py); this release is not supported (docs/compatibility.md)")
    return found
