"""The GPU tier's machinery: run a step's commands within a time budget, and keep one results file.

`tests/gpu/test_gpu.py` holds the steps, as tests marked ``gpu``; `make gpu-check` runs them on a GPU
machine, and `make gpu-check-dry` runs the same steps on CPU at a tiny size (`Target.dry`): the same
scripts, arguments, casts and results file, with the CUDA kernels replaced by their torch reference.
A bug in the check itself then fails on CPU, not on a GPU lent for minutes.

Every step is a subprocess with its own log under ``OUT/logs/`` and its own time limit.
``OUT/gpu_check.json`` holds every step's status, seconds, numbers and log; the summary goes to
``OUT/gpu_check.md``; both are rewritten after every step, so that a check stopped from outside
still leaves what it measured.  ``FE_GPU_CHECK_BUDGET_S`` bounds the whole check: each command runs
at most until the budget ends, and the steps it leaves out are recorded as ``not run``, by name.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "data", "sotu.jsonl.gz")
CONFIG = os.path.join(ROOT, "examples", "configs", "demo_cpu.yaml")
PY = sys.executable
# fp32 on GPU against fp32 on CPU: the same weights and batches, other kernels and reduction orders
FP32_CURVE_RTOL = 1e-3
# bf16 against the fp32 reference (other rounding): 40 steps of the demo config from the same weights
# end within 5e-4 on CPU (benchmarks/RESULTS.md); 1e-2 leaves room for the GPU's kernels and still
# fails a run that did not start from the shared weights (3e-2, the weights-only load bug)
BF16_CURVE_RTOL = 0.01
# bf16 with Transformer Engine's spec, which names its weights otherwise and so starts from its own
# initialization: a sanity bound
BF16_TE_CURVE_RTOL = 0.05
# the kernel tests a dry run runs (every CUDA and compiled-Triton case skips without a GPU)
KERNEL_TESTS = ("tests/unit/ops/test_kernels.py", "tests/unit/ops/test_fused_branch.py")
DRY_KERNEL_TESTS = "test_the_operators_pass_torch_library_opcheck"


# a command given less than this of the budget is not started
MIN_COMMAND_S = 10


class BudgetSpent(Exception):
    """Raised by `Checker.run` when too little of the budget is left to start a command: the step
    is recorded as not run."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the steps run: a GPU, or (``dry``) this machine's CPU at a tiny size, with the torch
    reference in place of the CUDA kernels and every "GPU" run on the CPU in the same precision."""

    dry: bool
    train_steps: int  # fe-pretrain steps of each pretraining run

    @property
    def kernel_backend(self) -> str:
        if self.dry:
            return "torch"
        return "cuda" if os.environ.get("FE_GPU_CHECK_BUILD", "1") != "0" else "triton"

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    @property
    def gpu_env(self) -> dict:
        """The environment of a run that is on the GPU (on the CPU in a dry run)."""
        return dict(CPU_ONLY, TRITON_INTERPRET="1") if self.dry else {}

    @classmethod
    def from_environment(cls) -> "Target":
        """``FE_GPU_CHECK_DRY=1`` for a dry run; ``FE_GPU_CHECK_TRAIN_STEPS`` (default 40, or 2 dry: a dry run
        checks the steps' code, not the curves)."""
        dry = os.environ.get("FE_GPU_CHECK_DRY", "0") not in ("", "0")
        return cls(dry=dry, train_steps=int(os.environ.get("FE_GPU_CHECK_TRAIN_STEPS", 2 if dry else 40)))


class Checker:
    def __init__(self, out: str, budget_s: float = None, dry: bool = False):
        self.out = out
        self.dry = dry
        self.logs = os.path.join(out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.steps = []
        self.running = None  # the progress of the step under way (`progress`)
        self.deadline = None if budget_s is None else time.monotonic() + budget_s

    def time_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def run(self, name: str, cmd: list, timeout: int, env: dict = None) -> tuple:
        """Run ``cmd`` from the repository root, its output into ``logs/<name>.log``; ``(rc, output)``.
        The command's limit is ``timeout`` or what is left of the budget, whichever is less."""
        log = os.path.join(self.logs, f"{name}.log")
        merged = dict(os.environ, **(env or {}))
        start = time.perf_counter()
        timeout = int(min(timeout, self.time_left()))
        if timeout < MIN_COMMAND_S:
            with open(log, "a") as fh:
                fh.write(f"$ {' '.join(cmd)}\n[gpu_check] not run: the time budget is spent\n")
            raise BudgetSpent(name)
        try:
            # a session of its own, so that a timeout ends the command's children too (nvcc, test workers)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=merged, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
        except FileNotFoundError as err:  # the program itself is missing (nvidia-smi, say)
            proc, rc, output = None, 127, f"[gpu_check] {err}"
        if proc is not None:
            try:
                output, _ = proc.communicate(timeout=timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                rc, output = 124, (output or "") + f"\n[gpu_check] timed out after {timeout} s"
        with open(log, "a") as fh:
            fh.write(f"$ {' '.join(cmd)}\n{output}\n[gpu_check] exit {rc} after {time.perf_counter() - start:.1f} s\n")
        return rc, output

    def progress(self, name: str, numbers: dict) -> None:
        """What the running step ``name`` has measured so far (a step of several commands calls it after each),
        written at once as the step's entry with status ``running``: a check cut off from outside (a lease
        that ended) still leaves it. `record` or `not_run` replaces it."""
        self.running = {"step": name, "status": "running", "seconds": 0.0, "numbers": dict(numbers),
                        "why": "cut off before the step ended: what it measured so far",
                        "log": os.path.join("logs", f"{name}.log")}
        self.write()

    def record(self, name: str, passed: bool, seconds: float, numbers: dict = None, why: str = "") -> dict:
        self.running = None
        entry = {"step": name, "status": "pass" if passed else "FAIL", "seconds": round(seconds, 1),
                 "numbers": numbers or {}, "log": os.path.join("logs", f"{name}.log")}
        if why:
            entry["why"] = why
        self.steps.append(entry)
        print(f"\n[gpu_check] {name}: {entry['status']} ({seconds:.0f} s){': ' + why if why else ''}", flush=True)
        self.write()
        return entry

    def not_run(self, name: str, why: str) -> dict:
        if self.running is not None and self.running["step"] == name:  # keep what it measured before the budget ended
            why = f"{why}; it measured {json.dumps(self.running['numbers'])} before"
        self.running = None
        entry = {"step": name, "status": "not run", "seconds": 0.0, "numbers": {}, "why": why}
        self.steps.append(entry)
        print(f"\n[gpu_check] {name}: not run: {why}", flush=True)
        self.write()
        return entry

    def entries(self) -> list:
        """The steps ended so far, and the running one's progress."""
        return self.steps + ([self.running] if self.running is not None else [])

    def write(self) -> None:
        """Both results files, each written whole under a temporary name and then renamed: a check killed while
        writing leaves the previous complete file, never half of one."""
        for name, text in (("gpu_check.json", json.dumps({"date": time.strftime("%Y-%m-%d"), "host": platform.node(),
                                                          "dry_run": self.dry, "steps": self.entries()}, indent=1)),
                           ("gpu_check.md", summary(self))):
            path = os.path.join(self.out, name)
            with open(path + ".tmp", "w") as fh:
                fh.write(text)
            os.replace(path + ".tmp", path)


def json_lines(text: str) -> list:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def lm_curve(save: str) -> dict:
    path = os.path.join(save, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path) as fh:
        rows = json_lines(fh.read())  # a run stopped mid-write leaves a cut last line
    return {r["step"]: r["lm_loss"] for r in rows if "lm_loss" in r and "step" in r}


def compare_curves(got: dict, reference: dict) -> tuple:
    """``(max relative difference over the common logged steps, steps compared)``."""
    common = sorted(set(got) & set(reference))
    if not common:
        return float("inf"), 0
    return max(abs(got[s] - reference[s]) / abs(reference[s]) for s in common), len(common)


# ----------------------------------------------------------------------------- steps
# Each returns the entry it recorded (`Checker.record`); `BudgetSpent` leaves the step to the caller.
ENVIRONMENT = """
import json, os, platform, torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = None
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": tv, "python": platform.python_version(),
        "cpus": os.cpu_count()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(device=torch.cuda.get_device_name(0), memory_gib=round(p.total_memory / 2**30, 1),
                capability=f"{p.major}.{p.minor}")
else:
    info.update(device=f"{platform.machine()} CPU (dry run)")
print(json.dumps(info))
"""


def environment(c: Checker, t: Target) -> dict:
    start = time.perf_counter()
    if not t.dry:
        c.run("environment", ["nvidia-smi"], 60)
    rc, output = c.run("environment", [PY, "-c", ENVIRONMENT], 120, t.gpu_env)
    rows = json_lines(output)
    return c.record("environment", rc == 0 and bool(rows), time.perf_counter() - start, rows[0] if rows else {})


def build(c: Checker, t: Target) -> dict:
    """``setup.py build_ext --inplace``: the C++ and (on a GPU) CUDA kernels, for this GPU's architecture
    (or TORCH_CUDA_ARCH_LIST / FE_MEGATRON_CUDA_ARCH, as setup.py reads them), a compiler job per core.
    ``FE_GPU_CHECK_BUILD=0`` builds nothing: the steps then run with the Triton kernels. A dry run loads
    the C++ library the install built in place where it is newer than its sources (delete it to compile)."""
    start = time.perf_counter()
    if os.environ.get("FE_GPU_CHECK_BUILD", "1") == "0":  # a lease too short for a build: Triton's kernels only
        rc, backends = loaded_backends(c, t)
        ok = rc == 0 and ("triton" in backends or t.dry)
        return c.record("build", ok, time.perf_counter() - start, {"backends": backends, "built": False},
                        "" if ok else "FE_GPU_CHECK_BUILD=0 and no Triton backend to run the steps with")
    env = {"MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))}
    if t.dry:
        env["FE_MEGATRON_CUDA"] = "0"
        built = up_to_date_cpu_build()
        if built:  # the install (pip install -e) compiled this very build; the step checks that it loads
            rc, backends = loaded_backends(c, t)
            ok = rc == 0 and "cpp" in backends
            return c.record("build", ok, time.perf_counter() - start,
                            {"backends": backends, "built": False, "reused": os.path.relpath(built, ROOT)},
                            "" if ok else "the C++ kernels of the install did not load (see the log)")
    else:
        import torch

        major, minor = torch.cuda.get_device_capability(0)
        env["TORCH_CUDA_ARCH_LIST"] = (os.environ.get("TORCH_CUDA_ARCH_LIST") or os.environ.get("FE_MEGATRON_CUDA_ARCH")
                                       or f"{major}.{minor}")
    rc, _ = c.run("build", [PY, "setup.py", "build_ext", "--inplace"], 1800, env)
    rc2, backends = loaded_backends(c, t)
    wanted = "cpp" if t.dry else "cuda"
    ok = rc == 0 and rc2 == 0 and wanted in backends
    return c.record("build", ok, time.perf_counter() - start, {"backends": backends, **env},
                    "" if ok else f"the {wanted} kernels did not build or load (see the log)")


def loaded_backends(c: Checker, t: Target) -> tuple:
    """``(rc, backends)``: the kernel backends ``fe_megatron.ops`` finds in a fresh process of the target
    (the build step's log gets its output)."""
    rc, output = c.run("build", [PY, "-c", "from fe_megatron import ops; print(ops.available_backends())"], 120,
                       t.gpu_env)
    return rc, output.strip().splitlines()[-1] if output.strip() else ""


def up_to_date_cpu_build() -> str:
    """The C++ kernels' library built in place for this Python, where it is newer than its sources and
    setup.py (``pip install -e`` builds it there): a dry run loads it rather than compiling it again."""
    import sysconfig

    library = os.path.join(ROOT, "fe_megatron", "ops", "_C_cpu" + sysconfig.get_config_var("EXT_SUFFIX"))
    sources = [os.path.join(ROOT, "setup.py")] + [os.path.join(ROOT, "csrc", "cpu", name)
                                                  for name in os.listdir(os.path.join(ROOT, "csrc", "cpu"))]
    if os.path.exists(library) and os.path.getmtime(library) > max(map(os.path.getmtime, sources)):
        return library
    return ""


def kernel_tests(c: Checker, t: Target) -> dict:
    start = time.perf_counter()
    # with pytest-xdist, a test that crashes its process is reported as failed and the others still run
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") and not t.dry else []
    select = ["-k", DRY_KERNEL_TESTS] if t.dry else []
    rc, output = c.run("kernel-tests", [PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *workers, *select,
                                        *KERNEL_TESTS], 1800)
    totals = [line for line in output.splitlines() if " passed" in line or " failed" in line]
    crashed = [line.strip() for line in output.splitlines() if "crashed while running" in line]
    return c.record("kernel-tests", rc == 0, time.perf_counter() - start,
                    {"summary": totals[-1] if totals else "", "crashed": crashed})


def kernel_bench(c: Checker, t: Target) -> dict:
    """bench_kernels.py in fp32 and bf16 at the 340M preset: every kernel's time, and the forward
    gather and row backward as fractions of the measured copy bandwidth."""
    start = time.perf_counter()
    size = (["--preset", "factorengram-tiny", "--micro-batch", "1", "--seq", "256", "--repeats", "2", "--device",
             "cpu"] if t.dry else ["--repeats", "20"])
    # a dry run times the torch and C++ kernels only: Triton's interpreter takes minutes and measures nothing
    env = dict(t.gpu_env, TRITON_INTERPRET="0") if t.dry else t.gpu_env
    numbers, ok = {}, True
    for dtype in ("float32", "bfloat16"):
        rc, output = c.run("kernel-bench", [PY, "benchmarks/bench_kernels.py", *size, "--dtype", dtype], 1800, env)
        rows = json_lines(output)
        ok = ok and rc == 0 and bool(rows)
        header = next((r for r in rows if "copy_gbs" in r), {})
        numbers[dtype] = {"copy_gbs": header.get("copy_gbs"), "kernels": [r for r in rows if "backend" in r]}
        c.progress("kernel-bench", numbers)
    return c.record("kernel-bench", ok, time.perf_counter() - start, numbers)


def fused_branch_bench(c: Checker, t: Target) -> dict:
    """bench_memory.py --kernel: the fused gated reconstruction (Triton on a GPU) against its unfused composition at
    the 340M preset's widths, forward and backward, in bf16 and fp32, and the fraction of the measured matmul rate
    each reaches."""
    start = time.perf_counter()
    size = ["--sizes", "small", "--steps", "2", "--device", "cpu"] if t.dry else \
        ["--sizes", "medium", "--steps", "20", "--device", "cuda"]
    numbers, ok = {}, True
    for dtype in ("bfloat16", "float32"):
        command = [PY, "benchmarks/bench_memory.py", "--kernel", *size, "--dtype", dtype]
        rc, output = c.run("fused-branch-bench", command, 600, t.gpu_env)
        rows = [row for row in json_lines(output) if "fwd_bwd_speedup" in row]
        ok = ok and rc == 0 and bool(rows)
        numbers[dtype] = rows[-1] if rows else {}
        c.progress("fused-branch-bench", numbers)
    return c.record("fused-branch-bench", ok, time.perf_counter() - start, numbers)


def train_bench(c: Checker, t: Target, size: str) -> dict:
    """bench_train.py in bf16: FactorEngram's tokens/s against the same backbone without memory, beside
    the ratio a step bound by its matrix products would reach (``matmul_bound_ratio``)."""
    name = f"train-bench-{size}"
    start = time.perf_counter()
    # a dry run's bf16 matrix products on a CPU are slow: one table update rule of the three is enough there
    size_args = (["--size", "tiny", "--steps", "2", "--table-updates", "adamw"] if t.dry
                 else ["--size", size, "--steps", "10"])
    rc, output = c.run(name, [PY, "benchmarks/bench_train.py", *size_args, "--precision", "bf16"], 1800, t.gpu_env)
    rows = [row for row in json_lines(output) if "matmul_bound_ratio" in row]
    why = "" if rc == 0 and rows else "the benchmark failed (see the log)"
    if rows and not rows[-1].get("bf16"):
        why = "the benchmark did not run in bf16"
    return c.record(name, not why, time.perf_counter() - start, rows[-1] if rows else {}, why)


DRY_STORAGES = ("fp32", "fp32-host", "fp32-host-no-prefetch", "bf16-bf16")


def table_storage(c: Checker, t: Target) -> dict:
    start = time.perf_counter()
    # a dry run starts only the storages the numbers below read: each is a process of its own (about 25 s on
    # a CPU, mostly imports)
    size = ["--size", "tiny", "--steps", "2", "--storages", *DRY_STORAGES] if t.dry else \
        ["--size", "small", "--steps", "10"]
    rc, output = c.run("table-storage", [PY, "benchmarks/bench_table_storage.py", *size], 3000, t.gpu_env)
    rows = [row for row in json_lines(output) if "results" in row]
    results = rows[-1]["results"] if rows else {}
    numbers, why = {"results": results}, []
    if rc != 0 or not results:
        why.append("the benchmark failed (see the log)")
    else:
        fp32, host, lazy = (results.get(k, {}).get("tokens_per_s") for k in ("fp32", "fp32-host",
                                                                            "fp32-host-no-prefetch"))
        numbers.update(host_vs_device=host / fp32, lookahead_speedup=host / lazy)
        halved = results["bf16-bf16"]["table_bytes"] / results["fp32"]["table_bytes"]
        numbers["bf16_state_table_bytes_ratio"] = halved
        if halved > 0.55:
            why.append(f"bf16 tables with bf16 state take {halved:.2f}x of fp32 tables' bytes (limit 0.55)")
    return c.record("table-storage", not why, time.perf_counter() - start, numbers, "; ".join(why))


# HybridModel against the GPT model, both with memory and the same weights: fp32 is the same function in
# other module wrappers (the same kernels in the same order, identical on an H200); bf16 parts by rounding
# (which operation rounds otherwise is not established): 2.1e-3 apart after 11 Adam steps on an H200
HYBRID_FP32_ATOL = 1e-5
HYBRID_BF16_ATOL = 5e-3


def hybrid_vs_gpt(c: Checker, t: Target) -> dict:
    """bench_hybrid.py in fp32 and bf16: megatron-core's HybridModel with a ``*-`` pattern and the memory,
    against the GPT model with the memory, from the same weights on the same batches: the largest LM-loss
    difference over the steps, and each model's tokens/s."""
    start = time.perf_counter()
    size = ["--size", "tiny", "--steps", "3"] if t.dry else ["--size", "small", "--steps", "10"]
    numbers, why = {}, []
    for precision, limit in (("fp32", HYBRID_FP32_ATOL), ("bf16", HYBRID_BF16_ATOL)):
        rc, output = c.run("hybrid", [PY, "benchmarks/bench_hybrid.py", *size, "--precision", precision], 900,
                           t.gpu_env)
        rows = [row for row in json_lines(output) if "max_lm_loss_difference" in row]
        if rc != 0 or not rows:
            why.append(f"{precision}: the benchmark failed (see the log)")
            continue
        numbers[precision] = rows[-1]
        c.progress("hybrid", numbers)
        if rows[-1]["max_lm_loss_difference"] > limit:
            why.append(f"{precision}: hybrid and GPT LM losses differ by {rows[-1]['max_lm_loss_difference']:.2e} "
                       f"(limit {limit:.0e})")
    return c.record("hybrid", not why, time.perf_counter() - start, numbers, "; ".join(why))


def prepare_data(c: Checker) -> tuple:
    """A 4096-piece tokenizer trained on the bundled corpus, and the corpus tokenized with it:
    ``(tokenizer model, dataset prefix)``, or ``(None, None)``."""
    data = os.path.join(c.out, "data")
    tokenizer, prefix = os.path.join(data, "tokenizer.model"), os.path.join(data, "sotu")
    if not os.path.isfile(prefix + ".idx"):
        c.run("data", [PY, "-m", "fe_megatron.data.cli", "train-tokenizer", "--input", CORPUS,
                       "--output-prefix", tokenizer[:-len(".model")], "--vocab-size", "4096"], 900)
        c.run("data", [PY, "-m", "fe_megatron.data.cli", "preprocess", "--input", CORPUS, "--tokenizer-model",
                       tokenizer, "--output-prefix", prefix, "--no-progress"], 900)
    return (tokenizer, prefix) if os.path.isfile(prefix + ".idx") else (None, None)


def data_overrides(c: Checker, tokenizer: str, prefix: str) -> list:
    return [f"data.tokenizer_model={tokenizer}", f"data.train_data=[{prefix}]",
            f"data.cache_dir={os.path.join(c.out, 'cache')}"]


def pretrain_args(c: Checker, name: str, steps: int, tokenizer: str, prefix: str, *extra) -> tuple:
    save = os.path.join(c.out, "runs", name)
    shutil.rmtree(save, ignore_errors=True)  # a run of an earlier check: fe-pretrain never writes over one
    return save, [PY, "-m", "fe_megatron.train", "--config", CONFIG, "--save", save,
                  *data_overrides(c, tokenizer, prefix), f"training.train_steps={steps}",
                  f"optimizer.warmup_steps={max(1, steps // 15)}", f"training.save_interval={steps}",
                  f"training.eval_interval={steps}", *(["training.eval_steps=1"] if c.dry else []), *extra]


CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def train_runs(c: Checker, step: str, runs: dict) -> tuple:
    """Run each fe-pretrain command of ``runs`` (``{name: (save, command, env)}``) in turn:
    ``(curves, failed, not_run)``, the logged LM loss per run, the runs that failed or logged
    nothing, and those the budget left out (what the runs before them measured is kept); `BudgetSpent`
    when the budget left out every run."""
    curves, failed, not_run = {}, [], []
    for name, (save, cmd, env) in runs.items():
        try:
            rc, _ = c.run(step, cmd, 3000, env)
        except BudgetSpent:
            not_run.append(name)
            continue
        curves[name] = lm_curve(save)
        if rc != 0 or not curves[name]:
            failed.append(name)
        c.progress(step, {"final_lm_loss": final_losses(curves), "failed": failed})
    if not curves:  # nothing started: the step was not run, rather than failed
        raise BudgetSpent(step)
    return curves, failed, not_run


def final_losses(curves: dict) -> dict:
    return {name: curve[max(curve)] for name, curve in curves.items() if curve}


START = """
import shutil, sys, torch
from fe_megatron.convert.to_mcore import hf_to_mcore
from fe_megatron.deepspeed.engine import build_model
from fe_megatron.training.config import load_train_config
config, hf, mcore, tokenizer = sys.argv[1:5]
torch.manual_seed(0)
model = build_model(load_train_config(config, sys.argv[5:]))
model.save_pretrained(hf)
shutil.copyfile(tokenizer, hf + "/tokenizer.model")
hf_to_mcore(hf, mcore)
"""


def start_weights(c: Checker, tokenizer: str, prefix: str) -> tuple:
    """One set of initial weights, as a Hugging Face directory (the DeepSpeed runs' ``--load``) and
    as a Megatron checkpoint (the local-spec Megatron runs' ``--load``), so that CPU and GPU runs
    start alike (each device initializes with its own random generator)."""
    hf, mcore = os.path.join(c.out, "runs", "start_hf"), os.path.join(c.out, "runs", "start_mcore")
    for folder in (hf, mcore):
        shutil.rmtree(folder, ignore_errors=True)
    rc, _ = c.run("start-weights", [PY, "-c", START, CONFIG, hf, mcore, tokenizer,
                                    *data_overrides(c, tokenizer, prefix)], 900, CPU_ONLY)
    return (hf, mcore) if rc == 0 else (None, None)


def pretrain(c: Checker, t: Target, tokenizer: str, prefix: str, mcore_start: str) -> tuple:
    """The demo config for ``t.train_steps`` steps: fp32 on the CPU (the reference), then on the GPU
    bf16, bf16 with bf16 tables and table state in host memory (the host tier), and fp32, all from one
    set of initial weights. ``(entry, the GPU fp32 run's directory or None)``."""
    start = time.perf_counter()
    load = f"load={mcore_start}"  # the Transformer Engine spec names its weights otherwise: its own start
    # bf16 with Transformer Engine's spec where it is installed, else with the local spec (and the shared start)
    has_te = importlib.util.find_spec("transformer_engine") is not None and not t.dry
    bf16_spec = ("training.transformer_impl=te",) if has_te else (load,)
    backend = f"training.kernel_backend={t.kernel_backend}"
    # the unmeasured bf16 curves first, the fp32 one (measured before; hf-generate converts it) last
    runs = {
        "cpu_fp32": ("training.precision=fp32", "training.kernel_backend=torch", load),
        "gpu_bf16": ("training.precision=bf16", backend, *bf16_spec),
        "gpu_bf16_host_tables": ("training.precision=bf16", backend, "memory.table_dtype=bf16",
                                 "optimizer.table_state_dtype=bf16", "memory.table_placement=host", load),
        "gpu_fp32": ("training.precision=fp32", backend, load),
    }
    curves, failed, not_run = train_runs(c, "pretrain", {
        name: (*pretrain_args(c, name, t.train_steps, tokenizer, prefix, *extra),
               CPU_ONLY if name.startswith("cpu") else t.gpu_env)
        for name, extra in runs.items()})
    numbers = {"steps": t.train_steps, "bf16_spec": "te" if has_te else "local", "final_lm_loss": final_losses(curves)}
    why = [f"runs that failed: {', '.join(failed)}"] if failed else []
    if not_run:
        why.append(f"runs not started, the time budget being spent: {', '.join(not_run)}")
    limits = {"gpu_fp32": ("GPU fp32", FP32_CURVE_RTOL),
              "gpu_bf16": ("GPU bf16", BF16_TE_CURVE_RTOL if has_te else BF16_CURVE_RTOL),
              "gpu_bf16_host_tables": ("GPU bf16 host-tier", BF16_CURVE_RTOL)}
    for name, (what, limit) in limits.items():
        if curves.get(name) and curves.get("cpu_fp32"):  # compared only where both runs logged losses
            difference, compared = compare_curves(curves[name], curves["cpu_fp32"])
            numbers[f"{name}_vs_cpu_max_rel"], numbers["logged_steps"] = difference, compared
            if difference > limit:
                why.append(f"{what} curve differs from the CPU fp32 one by {difference:.2e} (limit {limit:.0e})")
    entry = c.record("pretrain", not why, time.perf_counter() - start, numbers, "; ".join(why))
    ran = curves.get("gpu_fp32") and "gpu_fp32" not in failed
    return entry, os.path.join(c.out, "runs", "gpu_fp32") if ran else None


# The method where it matters (Table 2's comparison at a size a GPU trains in minutes): FactorEngram, Engram with
# unigrams and the Transformer, each a 28M-parameter backbone (8 x d512, sequence 512), the two memories with the
# same tables (orders 1-3, 4 heads, 100K rows per hashed head, s = 1536, at blocks 3 and 4 of 8), trained on the
# same tokens (the same steps, batches and schedule) for about METHOD_SECONDS each, with validation and test
# perplexity on the held-out addresses. A dry run trains each for 2 steps at the demo's size.
METHOD_SEQ, METHOD_GLOBAL_BATCH = 512, 32
METHOD_BACKBONE = ("model.hidden_size=512", "model.num_layers=8", "model.num_attention_heads=8",
                   "model.ffn_hidden_size=1408", f"model.seq_length={METHOD_SEQ}")
METHOD_TABLES = ("memory.layers=[3, 4]", "memory.table_capacity=[4096, 100000, 100000]", "memory.coeff_width=1536",
                 "memory.memory_dim=1536")
DRY_METHOD_TABLES = ("memory.layers=[1, 2]", "memory.table_capacity=[4096, 16384, 16384]", "memory.coeff_width=192",
                     "memory.memory_dim=192")
METHOD_MODELS = {"factorengram": "memory.preset=factorengram-340m",
                 "engram_unigram": "memory.preset=engram-unigram-340m", "transformer": "memory=null"}
METHOD_TRAINING = ("training.micro_batch_size=8", f"training.global_batch_size={METHOD_GLOBAL_BATCH}",
                   "optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "training.eval_steps=8", "training.log_interval=10")
METHOD_SECONDS = 180  # of training per model, when the budget allows (FE_GPU_CHECK_METHOD_S)
METHOD_SHARE = 0.6  # of the budget left when the step starts, at most, for its three runs
METHOD_PROBE_STEPS = 30  # FactorEngram's steps that measure its tokens/s, from which the runs' steps follow


def method_args(c: Checker, t: Target, name: str, steps: int, tokenizer: str, prefix: str) -> tuple:
    """``(save, command)`` of model ``name`` of `METHOD_MODELS`, in bf16, for ``steps`` steps."""
    tables = () if name == "transformer" else (DRY_METHOD_TABLES if t.dry else METHOD_TABLES)
    return pretrain_args(c, f"method_{name}", steps, tokenizer, prefix, "model.vocab_size=4096",
                         *(() if t.dry else METHOD_BACKBONE), METHOD_MODELS[name], *tables, *METHOD_TRAINING,
                         "training.precision=bf16", f"training.kernel_backend={t.kernel_backend}")


def run_records(save: str) -> list:
    path = os.path.join(save, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as fh:
        return json_lines(fh.read())


def method_steps(c: Checker, t: Target, tokenizer: str, prefix: str) -> tuple:
    """``(steps, seconds per model)``: the steps FactorEngram, the slowest of the three, trains in the seconds each
    model gets (`METHOD_SECONDS`, or less when the budget is short), from its tokens/s over `METHOD_PROBE_STEPS`."""
    if t.dry:
        return 2, 0.0
    seconds = min(float(os.environ.get("FE_GPU_CHECK_METHOD_S", METHOD_SECONDS)), METHOD_SHARE * c.time_left() / 3)
    save, cmd = method_args(c, t, "factorengram", METHOD_PROBE_STEPS, tokenizer, prefix)
    c.run("method", cmd, 900, t.gpu_env)
    rates = [r["tokens_per_s"] for r in run_records(save) if "tokens_per_s" in r and "lm_loss" in r]
    if not rates:  # the probe failed: its log says why, and the runs at the probe's length will too
        return METHOD_PROBE_STEPS, seconds
    return max(METHOD_PROBE_STEPS, int(seconds * rates[-1] / (METHOD_GLOBAL_BATCH * METHOD_SEQ))), seconds


def method(c: Checker, t: Target, tokenizer: str, prefix: str) -> dict:
    """FactorEngram, Engram with unigrams and the Transformer on the same tokens: validation and test perplexity,
    parameters and tokens/s of each, and each memory's validation perplexity over the Transformer's."""
    start = time.perf_counter()
    steps, seconds = method_steps(c, t, tokenizer, prefix)
    runs = {name: (*method_args(c, t, name, steps, tokenizer, prefix), t.gpu_env) for name in METHOD_MODELS}
    curves, failed, not_run = train_runs(c, "method", runs)
    results = {}
    for name, (save, _, _) in runs.items():
        rows = run_records(save)
        valid = [r["val_ppl"] for r in rows if "val_ppl" in r]
        final = next((r for r in rows if r.get("event") == "final"), None)
        if valid and final:
            results[name] = {"val_ppl": valid[-1], "test_ppl": final["test_ppl"], "parameters": final["parameters"],
                             "tokens_per_s": final["tokens_per_s"]}
    numbers = {"steps": steps, "seconds_per_model": round(seconds), "results": results}
    for name in ("factorengram", "engram_unigram"):
        if name in results and "transformer" in results:
            numbers[f"{name}_val_ppl_over_transformer"] = results[name]["val_ppl"] / results["transformer"]["val_ppl"]
    why = [f"runs that failed: {', '.join(failed)}"] if failed else []
    if not_run:
        why.append(f"runs not started, the time budget being spent: {', '.join(not_run)}")
    missing = [name for name in curves if name not in results and name not in failed]
    if missing:
        why.append(f"runs without a validation and a test perplexity: {', '.join(missing)}")
    return c.record("method", not why, time.perf_counter() - start, numbers, "; ".join(why))


LLAMA3_LAYERS = "2"
LLAMA3_MEMORY = "--fe-memory-preset factorengram-340m --fe-memory-layers 1"
STEP_TIME = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+)"
                       r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([\d.]+))?")


def llama3_recipe(c: Checker, t: Target, tokenizer: str, prefix: str) -> dict:
    """Megatron-LM's Llama-3 8B recipe (examples/megatron_lm/recipes/llama3_8b.sh) with FactorEngram, in
    bf16 at its full width, sequence length and batch, shortened to 2 layers: 2 steps, a checkpoint,
    then a second launch that resumes it for a third step. A dry run takes the recipe's CPU size."""
    start = time.perf_counter()
    save = os.path.join(c.out, "runs", "llama3")
    shutil.rmtree(save, ignore_errors=True)
    env = {"DATA_PATH": prefix, "TOKENIZER_MODEL": tokenizer, "SAVE": save,
           "PATH": os.path.dirname(PY) + os.pathsep + os.environ.get("PATH", ""), **t.gpu_env}
    env.update(SIZE="cpu", TRAIN_ITERS="3", SAVE_INTERVAL="2") if t.dry else \
        env.update(SIZE="full", NUM_LAYERS=LLAMA3_LAYERS, TRAIN_ITERS="3", FE_ARGS=LLAMA3_MEMORY)
    recipe = os.path.join(ROOT, "examples", "megatron_lm", "recipes", "llama3_8b.sh")
    rc, first = c.run("llama3-recipe", ["bash", recipe, "--exit-interval", "2"], 1200, env)
    c.progress("llama3-recipe", {"first_launch_exit": rc, "lm_loss": lm_curve(save)})
    rc2, second = c.run("llama3-recipe", ["bash", recipe, "--exit-interval", "3"], 1200, env) if rc == 0 else (1, "")
    curve = lm_curve(save)
    times = {int(m[1]): dict(ms=float(m[2]), tflops=float(m[3]) if m[3] else None)
             for m in STEP_TIME.finditer(first + second)}
    numbers = {"size": env["SIZE"], "layers": env.get("NUM_LAYERS"), "train_iters": env["TRAIN_ITERS"],
               "fe_args": env.get("FE_ARGS", "(the default)"), "lm_loss": curve, "step_time": times}
    why = []
    if rc != 0 or rc2 != 0:
        why.append("a launch failed (see the log)")
    elif sorted(curve) != [1, 2, 3] or not all(math.isfinite(v) for v in curve.values()):
        why.append(f"logged steps {sorted(curve)} (expected 1, 2, 3 with finite losses)")
    elif "successfully loaded checkpoint" not in second or "at iteration 2" not in second:
        why.append("the second launch did not resume the step-2 checkpoint")
    return c.record("llama3-recipe", not why, time.perf_counter() - start, numbers, "; ".join(why))


def deepspeed_zero3(c: Checker, t: Target, tokenizer: str, prefix: str, hf_start: str) -> dict:
    start = time.perf_counter()
    runs = {"ds_cpu_fp32": (("training.precision=fp32",), CPU_ONLY),
            "ds_gpu_bf16": (("training.precision=bf16",), t.gpu_env)}
    curves, failed, not_run = train_runs(c, "deepspeed-zero3", {
        name: (*pretrain_args(c, name, t.train_steps, tokenizer, prefix, "training.engine=deepspeed",
                              "deepspeed={zero_optimization: {stage: 3}}", f"load={hf_start}", *extra), env)
        for name, (extra, env) in runs.items()})
    difference, compared = compare_curves(curves.get("ds_gpu_bf16", {}), curves.get("ds_cpu_fp32", {}))
    why = [f"runs that failed: {', '.join(failed)}"] if failed else []
    if not_run:
        why.append(f"runs not started, the time budget being spent: {', '.join(not_run)}")
    if not failed and not not_run and difference > BF16_CURVE_RTOL:
        why.append(f"GPU bf16 curve differs from the CPU fp32 one by {difference:.2e} (limit {BF16_CURVE_RTOL:.0e})")
    return c.record("deepspeed-zero3", not why, time.perf_counter() - start,
                    {"gpu_bf16_vs_cpu_fp32_max_rel": difference, "logged_steps": compared,
                     "final_lm_loss": final_losses(curves)}, "; ".join(why))


GENERATE = """
import json, sys, torch
import fe_megatron.hf
from fe_megatron.hf import FactorEngramForCausalLM
hf, device = sys.argv[1:3]
prompt = torch.tensor([[1, 200, 31, 412, 77, 9, 1200, 5]])
out = {}
for name, where, dtype in (("cpu_fp32", "cpu", torch.float32), ("gpu_fp32", device, torch.float32),
                           ("gpu_bf16", device, torch.bfloat16)):
    model = FactorEngramForCausalLM.from_pretrained(hf, dtype=dtype).to(where).eval()
    with torch.no_grad():
        ids = model.generate(prompt.to(where), max_new_tokens=48, do_sample=False)
    out[name] = ids[0, prompt.shape[1]:].tolist()
same = lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
print(json.dumps({"new_tokens": len(out["cpu_fp32"]), "gpu_fp32_same_prefix": same(out["gpu_fp32"], out["cpu_fp32"]),
                  "gpu_bf16_same_prefix": same(out["gpu_bf16"], out["cpu_fp32"])}))
"""


def hf_generate(c: Checker, t: Target, run_dir: str) -> dict:
    """The GPU fp32 run converted with fe-convert mcore-to-hf: greedy generation on the GPU (fp32 and
    bf16) and on the CPU; the fp32 tokens must agree."""
    start = time.perf_counter()
    hf = os.path.join(c.out, "runs", "gpu_fp32_hf")
    shutil.rmtree(hf, ignore_errors=True)
    rc, _ = c.run("hf-generate", [PY, "-m", "fe_megatron.convert.cli", "mcore-to-hf", "--load", run_dir,
                                  "--output", hf], 900)
    rc2, output = c.run("hf-generate", [PY, "-c", GENERATE, hf, t.device], 900,
                        {"NVIDIA_TF32_OVERRIDE": "0", **t.gpu_env})
    rows = json_lines(output)
    numbers = rows[-1] if rows else {}
    ok = rc == 0 and rc2 == 0 and numbers.get("gpu_fp32_same_prefix") == numbers.get("new_tokens")
    return c.record("hf-generate", ok, time.perf_counter() - start, numbers,
                    "" if ok else "conversion or generation failed, or the GPU fp32 tokens differ from the CPU ones")


def summary(c: Checker) -> str:
    kind = "dry run on CPU" if c.dry else "GPU"
    lines = [f"# gpu_check ({kind}), {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}", "",
             "| step | status | seconds | numbers |", "| --- | --- | --- | --- |"]
    for step in c.entries():
        numbers = json.dumps(step["numbers"])
        numbers = numbers if len(numbers) < 400 else numbers[:400] + " ... (gpu_check.json)"
        lines.append(f"| {step['step']} | {step['status']}{' (' + step['why'] + ')' if 'why' in step else ''} "
                     f"| {step['seconds']} | `{numbers}` |")
    return "\n".join(lines) + "\n"
