"""One dispatch for every kernel: ``ngram_hash``, ``gather_rows`` (forward and backward), the
table optimizer's fused update ``table_adamw_``, the sparse rule's ``rowwise_adagrad_rows_``, and
FactorEngram's fused basis-gated reconstruction ``gated_reconstruction`` (Eq. 7-9, forward and backward), with the
inference kernels of a decoding step (``basis_memory_values``, ``ngram_hash_decode_``, ``short_conv_decode_``).

Backends: ``torch`` (`fe_megatron.ops.reference`, always present: it defines the
semantics), ``cpp`` (OpenMP C++ built by setup.py on every machine), ``cuda`` (built
where CUDA torch is installed) and ``triton`` (where Triton can launch: a GPU, or
``TRITON_INTERPRET=1`` on CPU).  The backend follows the tensors' device: torch's dispatcher
routes each operator call to its CPU or CUDA kernel, which runs the fastest backend built for
that device, or the one ``set_backend(name)`` (``training.kernel_backend``) or a
``use_backend(name)`` block chose for the whole process, every thread included (autograd's
backward thread, the host tier's worker).  The hash, the gather and the gated reconstruction are ``torch.library``
operators (``torch.ops.fe_megatron.*``) with fake implementations and an autograd formula, so
that torch.compile traces a model through them without graph breaks.

Three run-time switches, all off the hot path:

* ``set_deterministic_backward(False)`` lets the table backward use atomic adds (cuda,
  triton) into fp32 gradients instead of the sorted, deterministic reduction (bf16 and fp16
  gradients keep the sorted one, which sums in fp32 and rounds once per row, where an atomic add
  would round once per duplicate).  ``torch.use_deterministic_algorithms`` overrides it back to sorted.
* ``use_fused_branch(False)`` (or ``FE_MEGATRON_FUSED_BRANCH=0``) runs the memory branch's equations as separate
  torch operations instead of the fused kernels (below, "the fused branch"), every other kernel unchanged.
* ``debug_checks()`` (or ``FE_MEGATRON_DEBUG_KERNELS=1``) range-checks every row index on
  the host before a kernel reads it, and names the offending value and position.  The
  C++ backend checks ranges always, before it allocates anything (one min/max pass over the
  indices: 0.14 ms beside the gather's 62 ms for 786K lookups of 64-column rows on 2 cores).
"""

import contextlib
import dataclasses
import importlib
import logging
import os

import torch

from fe_megatron.ops import reference

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "cpp", "cuda", "triton")
# fastest first, per device type
_PREFERENCE = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpp", "torch")}
DEBUG_ENV = "FE_MEGATRON_DEBUG_KERNELS"
FUSED_BRANCH_ENV = "FE_MEGATRON_FUSED_BRANCH"  # 0: the branch's equations run unfused (`use_fused_branch`)


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    module: object  # has ngram_hash, gather_rows_forward, gather_rows_backward
    devices: tuple  # device types whose tensors it accepts
    dtypes: tuple = (torch.float32, torch.bfloat16, torch.float16)  # table dtypes it accepts


_backends = {"torch": Backend("torch", reference, ("cpu", "cuda"), dtypes=(torch.float64,) + Backend.dtypes)}
_discovered = False
# the process's settings: the chosen backend (None: the fastest per device), the table backward's order
# and the index checks; read by every thread
_settings = {"backend": None, "deterministic": True, "debug": os.environ.get(DEBUG_ENV, "0") not in ("", "0"),
             "fused_branch": os.environ.get(FUSED_BRANCH_ENV, "1") not in ("", "0")}
DEVICE_TYPES = ("cpu", "cuda")  # the devices the operators have kernels for


def _discover() -> None:
    """Import the compiled backends once; log one line if none is built."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    try:
        _backends["cpp"] = Backend("cpp", importlib.import_module("fe_megatron.ops._C_cpu"), ("cpu",))
    except ImportError as error:
        logger.debug("cpp backend not built: %s", error)
    if torch.cuda.is_available():
        try:
            _backends["cuda"] = Backend("cuda", importlib.import_module("fe_megatron.ops._C_cuda"), ("cuda",))
        except ImportError as error:
            logger.debug("cuda backend not built: %s", error)
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if torch.cuda.is_available() or interpret:
        try:
            triton_backend = importlib.import_module("fe_megatron.ops.triton_backend")
            _backends["triton"] = Backend("triton", triton_backend, ("cpu",) if interpret else ("cuda",))
        except ImportError as error:
            logger.debug("triton backend unavailable: %s", error)
    if "cpp" not in _backends and "cuda" not in _backends:
        logger.warning("fe_megatron.ops: no compiled kernels are built (install with `pip install "
                       "--no-build-isolation -e .` where torch is installed); using the torch reference")


def available_backends() -> list:
    """The built backends, in the order torch, cpp, cuda, triton."""
    _discover()
    return [name for name in BACKEND_NAMES if name in _backends]


# What makes a backend available, for the error message when it is not.
_HOW_TO_ENABLE = {
    "cpp": "it is compiled by `pip install --no-build-isolation -e .` where torch is installed",
    "cuda": "it needs a CUDA device, and is compiled by `pip install --no-build-isolation -e .` where torch has "
            "CUDA and nvcc is found",
    "triton": "it needs the triton package and a GPU; on a CPU set TRITON_INTERPRET=1 before fe_megatron.ops is "
              "imported to run it in Triton's interpreter (slow: for tests)",
}


def get_backend(name: str) -> Backend:
    """A built backend: its kernel functions (``.module``), devices and table dtypes."""
    _discover()
    if name not in _backends:
        how = f": {_HOW_TO_ENABLE[name]}" if name in _HOW_TO_ENABLE else f"; known backends: {BACKEND_NAMES}"
        raise ValueError(f"kernel backend {name!r} is not available here{how}. Available: {available_backends()}")
    return _backends[name]


def set_backend(name: str = None) -> None:
    """Run backend ``name`` from now on, in every thread of the process (``None`` or ``"auto"``: the
    fastest built one for each call's device).  Work on a device the backend does not run on (the
    host tier's, under a GPU backend) takes that device's fastest."""
    if name not in (None, "auto"):
        get_backend(name)
    _settings["backend"] = None if name == "auto" else name


@contextlib.contextmanager
def use_backend(name: str):
    """`set_backend` ``name`` inside the ``with`` block, then the previous choice again."""
    previous = _settings["backend"]
    set_backend(name)
    try:
        yield
    finally:
        _settings["backend"] = previous


def set_deterministic_backward(enabled: bool) -> None:
    """Sorted, run-to-run reproducible table gradients (default) or atomic adds."""
    _settings["deterministic"] = bool(enabled)


def fused_branch_enabled() -> bool:
    """Whether the fused branch's kernels run (`use_fused_branch`)."""
    return _settings["fused_branch"]


@contextlib.contextmanager
def use_fused_branch(enabled: bool = True):
    """Run the fused branch's kernels (`gated_reconstruction`, `basis_memory_values`, `ngram_hash_decode_`,
    `short_conv_decode_`) where a backend has them (the default; ``FE_MEGATRON_FUSED_BRANCH=0`` starts a process
    without), or, with False, their torch compositions, while every other kernel keeps its backend: to measure the
    fusion, or to rule it out."""
    previous = _settings["fused_branch"]
    _settings["fused_branch"] = bool(enabled)
    try:
        yield
    finally:
        _settings["fused_branch"] = previous


@contextlib.contextmanager
def debug_checks(enabled: bool = True):
    """Range-check row indices on the host before every gather (one device sync per call)."""
    previous = _settings["debug"]
    _settings["debug"] = enabled
    try:
        yield
    finally:
        _settings["debug"] = previous


def current_backend(device: torch.device, dtype: torch.dtype = None) -> str:
    """The backend a call on ``device`` (with tables of ``dtype``) uses now: the chosen one
    (`set_backend`; for host tensors under a GPU backend, the host's fastest: the host tier's work),
    else the fastest built one that accepts them.  float64 tables use the reference: the
    compiled kernels accumulate in fp32."""
    _discover()
    forced = _settings["backend"]
    if forced is not None:
        backend = _backends[forced]
        if device.type == "cpu" and "cpu" not in backend.devices:  # a GPU backend forced: host-memory work
            return fastest_backend(device, dtype)  # (the host tier's hashing and updates) takes the host's fastest
        if device.type not in backend.devices:
            raise ValueError(f"backend {forced!r} (chosen by set_backend) cannot run on {device.type} tensors; "
                             f"it accepts {backend.devices}")
        if dtype is not None and dtype not in backend.dtypes:
            raise TypeError(f"backend {forced!r} (chosen by set_backend) does not take {dtype} tables; "
                            f"it accepts {backend.dtypes}")
        return forced
    return fastest_backend(device, dtype)


def fastest_backend(device: torch.device, dtype: torch.dtype = None, op: str = None) -> str:
    """The fastest built backend for tensors on ``device`` (with tables of ``dtype``; that has the
    function ``op``, when given), whatever `set_backend` chose: for work on another device than the
    chosen backend's (the host tier's gathers and gradient additions in host memory)."""
    _discover()
    for name in _PREFERENCE.get(device.type, ("torch",)):
        backend = _backends.get(name)
        if backend and device.type in backend.devices and (dtype is None or dtype in backend.dtypes) \
                and (op is None or hasattr(backend.module, op)):
            return name
    return "torch"


def _backend_for(device: torch.device, dtype: torch.dtype = None):
    return _backends[current_backend(device, dtype)].module


# --- torch.library operators --------------------------------------------------------------------
# The hash, the row gather and its backward are registered as operators ``fe_megatron::...``,
# with fake (meta) implementations for their output shapes and the gather's autograd formula, so
# that torch.compile traces a model through them as single nodes, without graph breaks.  They have
# kernels for the devices of ``DEVICE_TYPES`` only, which torch's dispatcher picks by the inputs'
# device; each runs the backend that `current_backend` picks for that device, at run time.


@torch.library.custom_op("fe_megatron::ngram_hash", mutates_args=(), device_types=DEVICE_TYPES)
def _ngram_hash_op(token_ids: torch.Tensor, multipliers: torch.Tensor, moduli: torch.Tensor, offsets: torch.Tensor,
                   pad_id: int) -> torch.Tensor:
    return _backend_for(token_ids.device).ngram_hash(token_ids, multipliers, moduli, offsets, pad_id)


@_ngram_hash_op.register_fake
def _ngram_hash_shape(token_ids, multipliers, moduli, offsets, pad_id):
    return token_ids.new_empty((*token_ids.shape, multipliers.shape[0]), dtype=torch.int64)


@torch.library.custom_op("fe_megatron::gather_rows", mutates_args=(), device_types=DEVICE_TYPES)
def _gather_rows_op(weight: torch.Tensor, flat_indices: torch.Tensor) -> torch.Tensor:
    if _settings["debug"]:
        check_row_indices(flat_indices, weight.shape[0], tuple(flat_indices.shape))
    return _backend_for(weight.device, weight.dtype).gather_rows_forward(weight, flat_indices)


@_gather_rows_op.register_fake
def _gather_rows_shape(weight, flat_indices):
    return weight.new_empty((flat_indices.shape[0], weight.shape[1]))


@torch.library.custom_op("fe_megatron::gather_rows_grad_into", mutates_args=("out",), device_types=DEVICE_TYPES)
def _gather_rows_grad_into_op(grad_rows: torch.Tensor, flat_indices: torch.Tensor, out: torch.Tensor, backend: str,
                              deterministic: bool) -> None:
    """``out[i] += `` the gradients of the rows gathered from row ``i`` (a dense gradient, or where an
    engine keeps them: `table_weight_gradient`)."""
    _backends[backend].module.gather_rows_backward(grad_rows, flat_indices, out, deterministic)


def _gather_rows_setup(ctx, inputs, output) -> None:
    weight, flat_indices = inputs
    # the forward's backend, also when a use_backend block has ended before the backward runs
    ctx.backend = current_backend(weight.device, weight.dtype)
    ctx.save_for_backward(weight, flat_indices)


def _gather_rows_backward(ctx, grad_rows):
    """Each unique row's gradient reduced once, into a dense gradient or where an engine keeps gradients
    (`table_weight_gradient`)."""
    weight, flat_indices = ctx.saved_tensors
    grad_rows = grad_rows.contiguous()
    deterministic = deterministic_backward()
    return table_weight_gradient(weight, lambda out: torch.ops.fe_megatron.gather_rows_grad_into(
        grad_rows, flat_indices, out, ctx.backend, deterministic)), None


_gather_rows_op.register_autograd(_gather_rows_backward, setup_context=_gather_rows_setup)


def ngram_hash(token_ids: torch.Tensor, multipliers: torch.Tensor, moduli: torch.Tensor, offsets: torch.Tensor,
               pad_id: int) -> torch.Tensor:
    """All branches of all insertion layers in one launch (the ``fe_megatron::ngram_hash`` operator).
    See `fe_megatron.ops.reference.ngram_hash`."""
    for name, tensor in (("token_ids", token_ids), ("multipliers", multipliers), ("moduli", moduli),
                         ("offsets", offsets)):
        if tensor.dtype != torch.int64:
            raise TypeError(f"ngram_hash: {name} must be int64, got {tensor.dtype}")
    branches = (multipliers.shape[0],) if multipliers.dim() == 2 else None
    if token_ids.dim() != 2 or branches is None or moduli.shape != branches or offsets.shape != branches:
        raise ValueError(f"ngram_hash: expected token_ids [B, T], multipliers [nb, K], moduli and offsets [nb]; got "
                         f"{tuple(token_ids.shape)}, {tuple(multipliers.shape)}, {tuple(moduli.shape)}, "
                         f"{tuple(offsets.shape)}")
    return torch.ops.fe_megatron.ngram_hash(token_ids.contiguous(), multipliers.contiguous(), moduli.contiguous(),
                                            offsets.contiguous(), int(pad_id))


def check_row_indices(flat_indices: torch.Tensor, num_rows: int, shape: tuple) -> None:
    """Raise a ValueError naming the first index outside ``[0, num_rows)`` and its position in ``shape``."""
    bad = (flat_indices < 0) | (flat_indices >= num_rows)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        position = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), shape))
        raise ValueError(f"gather_rows: row index {int(flat_indices[first])} at position {position} of the "
                         f"indices (shape {tuple(shape)}) is outside the table's rows [0, {num_rows})")


def deterministic_backward() -> bool:
    """Whether table gradients are reduced in sorted, reproducible order (see `set_deterministic_backward`)."""
    return _settings["deterministic"] or torch.are_deterministic_algorithms_enabled()


def gather_rows_forward(weight: torch.Tensor, flat_indices: torch.Tensor, backend: str = None) -> torch.Tensor:
    """``weight[flat_indices]`` ([rows, w], [M] int64 -> [M, w]) without autograd, with ``backend`` or the
    current choice for the weight's device and dtype."""
    if _settings["debug"]:
        check_row_indices(flat_indices, weight.shape[0], tuple(flat_indices.shape))
    backend = backend or current_backend(weight.device, weight.dtype)
    return _backends[backend].module.gather_rows_forward(weight.contiguous(), flat_indices.contiguous())


def gather_rows_backward(grad_rows: torch.Tensor, flat_indices: torch.Tensor, out: torch.Tensor,
                         deterministic: bool = None, backend: str = None) -> None:
    """``out[i] += sum_{m: flat_indices[m] = i} grad_rows[m]`` in place (sorted and reproducible unless
    ``deterministic`` is False), with ``backend`` or the current choice for ``out``."""
    deterministic = deterministic_backward() if deterministic is None else deterministic
    backend = backend or current_backend(out.device, out.dtype)
    _backends[backend].module.gather_rows_backward(grad_rows.contiguous(), flat_indices.contiguous(), out,
                                                    deterministic)


_WEIGHT_GRADIENT_SINKS: list = []


def register_weight_gradient_sink(sink) -> bool:
    """Let an engine take a table's row gradients where it keeps gradients: ``sink(weight, add_row_gradients)``
    returns the tensor autograd gets for ``weight`` once it has added the rows itself, or None to leave the
    table to the next sink or to a dense gradient (`table_weight_gradient`).  The Megatron adapter
    registers Megatron's fused accumulation into ``main_grad`` for the length of a run
    (`fe_megatron.megatron.main_grad.use_main_grad_accumulation`).  Returns whether ``sink`` was not
    registered before (the caller that registered it is the one to `unregister_weight_gradient_sink` it)."""
    if sink in _WEIGHT_GRADIENT_SINKS:
        return False
    _WEIGHT_GRADIENT_SINKS.append(sink)
    return True


def unregister_weight_gradient_sink(sink) -> None:
    """Tables' gradients no longer go to ``sink`` (nothing where it is not registered)."""
    if sink in _WEIGHT_GRADIENT_SINKS:
        _WEIGHT_GRADIENT_SINKS.remove(sink)


def weight_gradient_sinks() -> tuple:
    """The registered sinks, in the order `table_weight_gradient` asks them."""
    return tuple(_WEIGHT_GRADIENT_SINKS)


def table_weight_gradient(weight: torch.Tensor, add_row_gradients, dense_dtype: torch.dtype = None) -> torch.Tensor:
    """The gradient a table's backward hands autograd, given ``add_row_gradients(out)``, which adds the
    looked-up rows' gradients into ``out`` (a [rows, width] tensor): what a registered sink returns
    (`register_weight_gradient_sink`), else a dense gradient, accumulated in ``dense_dtype`` (default:
    the weight's) and returned in the weight's dtype."""
    for sink in _WEIGHT_GRADIENT_SINKS:
        taken = sink(weight, add_row_gradients)
        if taken is not None:
            return taken
    grad_weight = torch.zeros(weight.shape, dtype=dense_dtype or weight.dtype, device=weight.device)
    add_row_gradients(grad_weight)
    return grad_weight.to(weight.dtype)


def table_adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 global_rows: torch.Tensor, column_offset: int, global_width: int, keys: torch.Tensor, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float, step: int, backend: str = None) -> None:
    """One AdamW step of table ``param`` in place, stochastically rounding what is stored in bf16
    (`fe_megatron.ops.reference.table_adamw_` gives the semantics).  The fused kernel of ``backend``
    (default: the current one) when it has one, else of the fastest built backend for the table's
    device that has one (cpp on the host, for the host tier; triton on a GPU, where the CUDA
    backend has none), else the reference."""
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for name, tensor in tensors.items():
        if tensor.dtype not in (torch.float32, torch.bfloat16) or tensor.shape != param.shape:
            raise ValueError(f"table_adamw_: {name} must be fp32 or bf16 of the table's shape {tuple(param.shape)}, "
                             f"got {tensor.dtype} {tuple(tensor.shape)}")
        if tensor.device != param.device or not tensor.is_contiguous():
            raise ValueError(f"table_adamw_: {name} must be contiguous and on the table's device {param.device}")
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise ValueError(f"table_adamw_: the moments must share a dtype, got {exp_avg.dtype} and {exp_avg_sq.dtype}")
    if global_rows.shape != (param.shape[0],) or global_rows.dtype != torch.int64 or keys.shape != (3, 2):
        raise ValueError("table_adamw_: global_rows must be int64 [rows] and keys [3, 2]")
    fused = fused_update(backend or current_backend(param.device, param.dtype), param.device)
    fused(param, grad, exp_avg, exp_avg_sq, global_rows.to(param.device), int(column_offset), int(global_width),
          keys.to(torch.int64).cpu(), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(step))


def rowwise_adagrad_rows_(param: torch.Tensor, momentum: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor,
                          global_width: int, lr: float, eps: float, weight_decay: float, backend: str = None) -> None:
    """Row-wise AdaGrad of fp32 table ``param``'s touched rows in place (`fe_megatron.ops.reference.
    rowwise_adagrad_rows_` gives the semantics): one pass over each row in the C++ backend, where the table's
    device has it, else the reference."""
    if param.dtype != torch.float32 or param.dim() != 2 or momentum.shape != (param.shape[0],):
        raise ValueError(f"rowwise_adagrad_rows_: an fp32 table [rows, width] and one accumulator per row, got "
                         f"{param.dtype} {tuple(param.shape)} and {tuple(momentum.shape)}")
    if ids.dtype != torch.int64 or grad.shape != (ids.numel(), param.shape[1]) or grad.dtype != torch.float32:
        raise ValueError(f"rowwise_adagrad_rows_: int64 ids and fp32 gradients [ids, width] = [{ids.numel()}, "
                         f"{param.shape[1]}], got {ids.dtype} and {grad.dtype} {tuple(grad.shape)}")
    module = get_backend(backend or current_backend(param.device, param.dtype)).module
    if not hasattr(module, "rowwise_adagrad_rows_"):
        module = reference
    module.rowwise_adagrad_rows_(param, momentum, ids, grad.contiguous(), int(global_width), float(lr), float(eps),
                                 float(weight_decay))


def fused_update(backend: str, device: torch.device):
    """The ``table_adamw_`` that `table_adamw_` runs with ``backend`` on ``device`` (see there)."""
    module = get_backend(backend).module
    if not hasattr(module, "table_adamw_"):
        module = _backends[fastest_backend(device, op="table_adamw_")].module  # the reference has one
    return module.table_adamw_


def gather_rows(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``weight[indices]``: [rows, w] and [..., nb] int64 -> [..., nb, w], differentiable in ``weight``
    (the ``fe_megatron::gather_rows`` operator), each unique row's gradient reduced once."""
    if weight.dim() != 2:
        raise ValueError(f"gather_rows: weight must be [rows, width], got shape {tuple(weight.shape)}")
    if indices.dtype != torch.int64:
        raise TypeError(f"gather_rows: indices must be int64, got {indices.dtype}")
    if indices.device != weight.device:
        raise ValueError(f"gather_rows: indices on {indices.device} but weight on {weight.device}")
    if _settings["debug"] and not torch.compiler.is_compiling():  # the position in the caller's shape
        check_row_indices(indices.reshape(-1), weight.shape[0], tuple(indices.shape))
    if not (torch.is_grad_enabled() and weight.requires_grad) and not torch.compiler.is_compiling():
        # inference: no operator, no autograd record (the indices were range-checked above in debug mode)
        rows = _backend_for(weight.device, weight.dtype).gather_rows_forward(weight.contiguous(), indices.reshape(-1))
    else:
        rows = torch.ops.fe_megatron.gather_rows(weight.contiguous(), indices.reshape(-1))
    return rows.view(*indices.shape, weight.shape[1])



# --- the fused branch --------------------------------------------------------------------------------------------
# FactorEngram's basis-gated reconstruction (Eq. 7-9) for training and inference, the whole position-wise memory of
# a served step (Eq. 7-9 and ``V``), and the refinement of a decoding step (Eq. 10); design: docs/kernels.md, "The
# fused branch". A backend has a kernel when its module has the function (``gated_reconstruction_forward`` and
# ``_backward``: cpp, triton; ``basis_memory_values``, ``ngram_hash_decode_`` and ``short_conv_decode_``: cpp).
# Elsewhere, under the torch backend and under ``use_fused_branch(False)``, the reference composition runs, operation
# by operation: the branch as it was before the kernels.
GATED_RECONSTRUCTION_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels take (others: the reference)


def fused_backend(function: str, device: torch.device, dtype: torch.dtype = None) -> str:
    """The backend whose ``function`` runs for operands on ``device`` in ``dtype``: the current one (`ops.current_
    backend`) when it has the kernel, else the device's fastest that has it, else ``"torch"`` (the reference: for
    float64 and float16, for the torch backend, under ``ops.use_fused_branch(False)``, and where no kernel is built)."""
    if (dtype is not None and dtype not in GATED_RECONSTRUCTION_DTYPES) or not fused_branch_enabled():
        return "torch"
    name = current_backend(device, dtype)
    if name == "torch" or hasattr(get_backend(name).module, function):
        return name
    return fastest_backend(device, dtype, op=function)  # "torch" where none has it: the reference has them all


def gated_reconstruction_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The backend `gated_reconstruction` runs for operands on ``device`` in ``dtype`` (`fused_backend`)."""
    return fused_backend("gated_reconstruction_forward", device, dtype)


def _operands_on_one_device_in_one_dtype(*tensors) -> bool:
    return len({(tensor.device, tensor.dtype) for tensor in tensors}) == 1


# --- the basis-gated reconstruction, an operator with an autograd formula (training, and under torch.compile) ---
@torch.library.custom_op("fe_megatron::gated_reconstruction", mutates_args=(), device_types=DEVICE_TYPES)
def _gated_reconstruction_op(coefficients: torch.Tensor, query: torch.Tensor, dictionary: torch.Tensor,
                             hidden_size: int, backend: str) -> torch.Tensor:
    return get_backend(backend).module.gated_reconstruction_forward(coefficients, query, dictionary, hidden_size)


@_gated_reconstruction_op.register_fake
def _gated_reconstruction_shape(coefficients, query, dictionary, hidden_size, backend):
    return query.new_empty(query.shape)


@torch.library.custom_op("fe_megatron::gated_reconstruction_backward", mutates_args=(),
                         device_types=DEVICE_TYPES)
def _gated_reconstruction_backward_op(grad_memory: torch.Tensor, coefficients: torch.Tensor, query: torch.Tensor,
                                      dictionary: torch.Tensor, hidden_size: int,
                                      backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(get_backend(backend).module.gated_reconstruction_backward(grad_memory, coefficients, query,
                                                                               dictionary, hidden_size))


@_gated_reconstruction_backward_op.register_fake
def _gated_reconstruction_backward_shape(grad_memory, coefficients, query, dictionary, hidden_size, backend):
    return coefficients.new_empty(coefficients.shape), query.new_empty(query.shape), dictionary.new_empty(
        dictionary.shape)


def _gated_reconstruction_setup(ctx, inputs, output) -> None:
    coefficients, query, dictionary, ctx.hidden_size, ctx.backend = inputs
    ctx.save_for_backward(coefficients, query, dictionary)  # no [M, s] intermediate: the backward recomputes the gate


def _gated_reconstruction_grad(ctx, grad_memory):
    coefficients, query, dictionary = ctx.saved_tensors
    grads = torch.ops.fe_megatron.gated_reconstruction_backward(grad_memory.contiguous(), coefficients, query,
                                                                dictionary, ctx.hidden_size, ctx.backend)
    return (*grads, None, None)


_gated_reconstruction_op.register_autograd(_gated_reconstruction_grad, setup_context=_gated_reconstruction_setup)


def _needs_autograd(*tensors) -> bool:
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)


def gated_reconstruction(coefficients: torch.Tensor, query: torch.Tensor, dictionary: torch.Tensor,
                         hidden_size: int) -> torch.Tensor:
    """FactorEngram's memory before ``V`` (Eq. 7-9): ``e_t = D^T (z_t * sigmoid(D q_t / sqrt(d)))``.

    coefficients ``z`` [..., s], query ``q`` [..., d_m] (``RMSNorm(Q^T h)``), dictionary ``D`` [s, d_m] (a tensor-
    parallel rank's rows: the result is that rank's share of the sum). Returns [..., d_m].  A backend with the fused
    kernel (`gated_reconstruction_backend`) runs it as two GEMMs with the gate between them, and its backward
    recomputes the gate, so autograd saves ``z``, ``q`` and ``D`` and no ``[..., s]`` intermediate; the torch backend
    runs `fe_megatron.ops.reference.gated_reconstruction`, operation by operation."""
    width, memory_dim = dictionary.shape if dictionary.dim() == 2 else (None, None)
    if width is None or coefficients.shape[-1] != width or query.shape[-1] != memory_dim \
            or coefficients.shape[:-1] != query.shape[:-1]:
        raise ValueError(f"gated_reconstruction: coefficients [..., s], query [..., d_m] and dictionary [s, d_m], got "
                         f"{tuple(coefficients.shape)}, {tuple(query.shape)} and {tuple(dictionary.shape)}")
    backend = "torch"
    if _operands_on_one_device_in_one_dtype(coefficients, query, dictionary):
        backend = gated_reconstruction_backend(coefficients.device, coefficients.dtype)
    if backend == "torch":
        return reference.gated_reconstruction(coefficients, query, dictionary, hidden_size)
    lead = coefficients.shape[:-1]
    operands = coefficients.reshape(-1, width).contiguous(), query.reshape(-1, memory_dim).contiguous(), \
        dictionary.contiguous()
    if not _needs_autograd(*operands) and not torch.compiler.is_compiling():  # inference: no operator, no record
        memory = get_backend(backend).module.gated_reconstruction_forward(*operands, int(hidden_size))
    else:
        memory = torch.ops.fe_megatron.gated_reconstruction(*operands, int(hidden_size), backend)
    return memory.view(*lead, memory_dim)


# --- inference only: a served step's position-wise memory, and a decoding step's addresses and refinement --------
def basis_memory_values(hidden: torch.Tensor, coefficients: torch.Tensor, query_weight: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float, dictionary: torch.Tensor, value_weight: torch.Tensor,
                        hidden_size: int) -> torch.Tensor:
    """``v_t = V D^T (z_t * sigmoid(D RMSNorm(Q^T h_t) / sqrt(d)))`` (Eq. 7-9) of [N, d] hidden states and [N, s]
    coefficients, in one call where the backend has the kernel: for a branch in one process with nothing to
    differentiate (``generate``, vLLM), where no communication sits between the products. Returns [N, out]. With
    autograd, under torch.compile, or where no kernel is built: `fe_megatron.ops.reference.basis_memory_values`."""
    operands = (hidden, coefficients, query_weight, norm_weight, dictionary, value_weight)
    backend = "torch"
    if _operands_on_one_device_in_one_dtype(*operands) and not _needs_autograd(*operands) \
            and not torch.compiler.is_compiling() and hidden.dim() == 2:
        backend = fused_backend("basis_memory_values", hidden.device, hidden.dtype)
    module = get_backend(backend).module if backend != "torch" else reference
    return module.basis_memory_values(*(tensor.contiguous() for tensor in operands[:4]), float(eps),
                                      dictionary.contiguous(), value_weight.contiguous(), int(hidden_size))


def ngram_hash_decode_(ids: torch.Tensor, id_state: torch.Tensor, slots: torch.Tensor, multipliers: torch.Tensor,
                       moduli: torch.Tensor, offsets: torch.Tensor, pad_id: int) -> torch.Tensor:
    """One decoding step of Eq. 1 for R sequences of one new position each, every one continuing (its look-back holds
    its last ``K - 1`` ids, or ``pad_id`` before its start): the row indices [R, branches] of ``ids`` [R] int64 after
    ``id_state[slots[r], :K - 1]`` (int32 or int64, ``[slots, >= K - 1]``), which advances by one position in place.
    One pass per sequence where the backend has the kernel (not under torch.compile), else the reference."""
    backend = "torch" if torch.compiler.is_compiling() else fused_backend("ngram_hash_decode_", ids.device)
    module = get_backend(backend).module if backend != "torch" else reference
    return module.ngram_hash_decode_(ids.to(torch.int64).contiguous(), id_state, slots.to(torch.int64).contiguous(),
                                     multipliers.contiguous(), moduli.contiguous(), offsets.contiguous(), int(pad_id))


def short_conv_decode_(values: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, norm_weight: torch.Tensor,
                       conv_weight: torch.Tensor, dilation: int, eps: float) -> torch.Tensor:
    """One decoding step of Eq. 10 for R sequences of one new position each: ``m = v + SiLU(Conv1D(RMSNorm(v_{<=t})))``
    at the new position, sequence r's earlier values in ``state[slots[r], :(K-1) r]`` (``[slots, >= (K-1) r, C]``),
    which advances by one position in place. values [R, C]; conv_weight [C, K]. Returns [R, C]. One pass per sequence
    where the backend has the kernel (no autograd, not under torch.compile), else the reference."""
    backend = "torch"
    if _operands_on_one_device_in_one_dtype(values, state, norm_weight, conv_weight) \
            and not _needs_autograd(values, norm_weight, conv_weight) and not torch.compiler.is_compiling():
        backend = fused_backend("short_conv_decode_", values.device, values.dtype)
    module = get_backend(backend).module if backend != "torch" else reference
    return module.short_conv_decode_(values.contiguous(), state, slots.to(torch.int64).contiguous(),
                                     norm_weight.contiguous(), conv_weight.contiguous(), int(dilation), float(eps))
