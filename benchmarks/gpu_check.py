"""Every GPU-specific path of fe_megatron in one call, with one results file (``make gpu-check``).

    python benchmarks/gpu_check.py [--out gpu_results] [--steps 60] [--budget-s SECONDS] [--skip STEP ...]

Steps, each a subprocess with its own log under ``OUT/logs/`` and its own time limit:

1. ``environment``: the GPU, torch, CUDA, Triton (``nvidia-smi`` into the log);
2. ``build``: ``setup.py build_ext --inplace`` (the C++ and CUDA kernels);
3. ``kernel-tests``: ``tests/test_kernels.py``, where the cuda and compiled Triton backends join the
   torch and cpp ones against the reference;
4. ``kernel-bench``: ``bench_kernels.py`` in fp32 and bf16 at the 340M preset (GB/s of every kernel,
   and the forward gather as a fraction of the measured device copy bandwidth);
5. ``train-bench``: ``bench_train.py --size 340m-layer`` (one memory layer at the 340M width
   against the plain layer, tokens/s and their ratio);
6. ``pretrain``: the demo config for ``--steps`` steps, four times: fp32 on the CPU (the
   reference), fp32 on the GPU with the CUDA kernels (both from one set of initial weights made on
   the CPU, ``start-weights``, so the curves must agree to fp32 rounding: 1e-3 relative), bf16
   on the GPU with the CUDA kernels (with the Transformer Engine spec and its own initialization
   where Transformer Engine is installed, else the local spec from the shared weights: the curve
   must stay within 5% of the reference), and bf16 with bf16 tables and bf16 table state in host
   memory (the host tier on a GPU, from the shared weights: within 5%);
7. ``hf-generate``: the GPU fp32 run converted with ``fe-convert mcore-to-hf``, greedy generation on
   the GPU and on the CPU, token for token;
8. ``deepspeed-zero3``: the DeepSpeed engine, ZeRO-3, on the GPU in bf16 against the same run on
   the CPU in fp32, from the same initial weights (within 5%);
9. ``table-storage``: ``bench_table_storage.py`` on the GPU: every table storage's peak device
   memory and tokens/s, the host tier with its one-microbatch lookahead against the host tier
   fetching each layer's rows when it needs them (what the lookahead hides) and against the
   device tier; it must run every storage, and bf16 tables with bf16 state must take at most 55%
   of fp32 tables' bytes.

``OUT/gpu_check.json`` holds every step's status, seconds, numbers and log; the
summary is printed and written to ``OUT/gpu_check.md``, both rewritten after every step so that a
check stopped from outside still leaves what it measured.  ``--budget-s`` bounds the whole check:
each command runs at most until the budget ends, and the steps it leaves out are recorded as
``not run``, by name (a lent GPU is often lent for minutes).  The exit status is 0 only when every
step passed.  Without a GPU nothing runs: it says so and exits 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "sotu.jsonl.gz")
CONFIG = os.path.join(ROOT, "examples", "configs", "demo_cpu.yaml")
PY = sys.executable
NO_GPU_EXIT = 2
# fp32 on GPU against fp32 on CPU: the same weights and batches, other kernels and reduction orders
FP32_CURVE_RTOL = 1e-3
# bf16 against the fp32 reference (other rounding; with Transformer Engine also its own initialization):
# a sanity bound on the logged losses
BF16_CURVE_RTOL = 0.05


# a command given less than this of the budget is not started
MIN_COMMAND_S = 10


class BudgetSpent(Exception):
    """Raised by `Checker.run` when too little of ``--budget-s`` is left to start a command: the step
    is recorded as not run."""


class Checker:
    def __init__(self, out: str, budget_s: float = None):
        self.out = out
        self.logs = os.path.join(out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.steps = []
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

    def record(self, name: str, passed: bool, seconds: float, numbers: dict = None, why: str = "") -> None:
        entry = {"step": name, "status": "pass" if passed else "FAIL", "seconds": round(seconds, 1),
                 "numbers": numbers or {}, "log": os.path.join("logs", f"{name}.log")}
        if why:
            entry["why"] = why
        self.steps.append(entry)
        print(f"[gpu_check] {name}: {entry['status']} ({seconds:.0f} s){': ' + why if why else ''}", flush=True)
        self.write()

    def not_run(self, name: str, why: str) -> None:
        self.steps.append({"step": name, "status": "not run", "seconds": 0.0, "numbers": {}, "why": why})
        print(f"[gpu_check] {name}: not run: {why}", flush=True)
        self.write()

    def write(self) -> None:
        with open(os.path.join(self.out, "gpu_check.json"), "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "steps": self.steps}, fh, indent=1)
        with open(os.path.join(self.out, "gpu_check.md"), "w") as fh:
            fh.write(summary(self))


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
def environment(c: Checker) -> None:
    start = time.perf_counter()
    c.run("environment", ["nvidia-smi"], 60)
    rc, output = c.run("environment", [PY, "-c", (
        "import json, torch, platform; p = torch.cuda.get_device_properties(0)\n"
        "try:\n import triton; tv = triton.__version__\nexcept ImportError:\n tv = None\n"
        "print(json.dumps({'device': torch.cuda.get_device_name(0), 'memory_gib': round(p.total_memory / 2**30, 1),"
        " 'capability': f'{p.major}.{p.minor}', 'torch': torch.__version__, 'cuda': torch.version.cuda,"
        " 'triton': tv, 'python': platform.python_version()}))")], 120)
    rows = json_lines(output)
    c.record("environment", rc == 0 and bool(rows), time.perf_counter() - start, rows[0] if rows else {})


def build(c: Checker) -> bool:
    import torch

    start = time.perf_counter()
    # the architectures asked for (TORCH_CUDA_ARCH_LIST, else FE_MEGATRON_CUDA_ARCH, as setup.py reads
    # them), else only this GPU's (setup.py's default builds two), with a compiler job per core
    major, minor = torch.cuda.get_device_capability(0)
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST") or os.environ.get("FE_MEGATRON_CUDA_ARCH") or f"{major}.{minor}"
    env = {"TORCH_CUDA_ARCH_LIST": arch,
           "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))}
    rc, _ = c.run("build", [PY, "setup.py", "build_ext", "--inplace"], 1800, env)
    rc2, output = c.run("build", [PY, "-c", "from fe_megatron import ops; print(ops.available_backends())"], 120)
    backends = output.strip().splitlines()[-1] if output.strip() else ""
    ok = rc == 0 and rc2 == 0 and "cuda" in backends
    c.record("build", ok, time.perf_counter() - start, {"backends": backends, **env},
             "" if ok else "the CUDA extension did not build or load (see the log)")
    return ok


def kernel_tests(c: Checker) -> None:
    start = time.perf_counter()
    # with pytest-xdist, a test that crashes its process is reported as failed and the others still run
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") else []
    rc, output = c.run("kernel-tests", [PY, "-m", "pytest", "-q", "-rs", *workers, "tests/test_kernels.py"], 1800)
    totals = [line for line in output.splitlines() if " passed" in line or " failed" in line]
    crashed = [line.strip() for line in output.splitlines() if "crashed while running" in line]
    c.record("kernel-tests", rc == 0, time.perf_counter() - start,
             {"summary": totals[-1] if totals else "", "crashed": crashed})


def kernel_bench(c: Checker) -> None:
    start = time.perf_counter()
    numbers, ok = {}, True
    for dtype in ("float32", "bfloat16"):
        rc, output = c.run("kernel-bench", [PY, "benchmarks/bench_kernels.py", "--repeats", "20", "--dtype", dtype],
                           1800)
        rows = json_lines(output)
        ok = ok and rc == 0 and bool(rows)
        header = next((r for r in rows if "copy_gbs" in r), {})
        numbers[dtype] = {"copy_gbs": header.get("copy_gbs"),
                          "kernels": [r for r in rows if "backend" in r]}
    c.record("kernel-bench", ok, time.perf_counter() - start, numbers)


def train_bench(c: Checker) -> None:
    start = time.perf_counter()
    rc, output = c.run("train-bench", [PY, "benchmarks/bench_train.py", "--size", "340m-layer", "--steps", "10"], 1800)
    rows = json_lines(output)
    c.record("train-bench", rc == 0 and bool(rows), time.perf_counter() - start, rows[-1] if rows else {})


def table_storage(c: Checker) -> None:
    start = time.perf_counter()
    rc, output = c.run("table-storage", [PY, "benchmarks/bench_table_storage.py", "--size", "small", "--steps", "10"],
                       3000)
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
    c.record("table-storage", not why, time.perf_counter() - start, numbers, "; ".join(why))


def prepare_data(c: Checker) -> tuple:
    data = os.path.join(c.out, "data")
    tokenizer, prefix = os.path.join(data, "tokenizer.model"), os.path.join(data, "sotu")
    if not os.path.isfile(prefix + ".idx"):
        c.run("data", [PY, "-m", "fe_megatron.data.cli", "train-tokenizer", "--input", CORPUS,
                       "--output-prefix", tokenizer[:-len(".model")], "--vocab-size", "4096"], 900)
        c.run("data", [PY, "-m", "fe_megatron.data.cli", "preprocess", "--input", CORPUS, "--tokenizer-model",
                       tokenizer, "--output-prefix", prefix, "--no-progress"], 900)
    return tokenizer, prefix


def data_overrides(c: Checker, tokenizer: str, prefix: str) -> list:
    return [f"data.tokenizer_model={tokenizer}", f"data.train_data=[{prefix}]",
            f"data.cache_dir={os.path.join(c.out, 'cache')}"]


def pretrain_args(c: Checker, name: str, steps: int, tokenizer: str, prefix: str, *extra) -> tuple:
    save = os.path.join(c.out, "runs", name)
    shutil.rmtree(save, ignore_errors=True)  # a run of an earlier check: fe-pretrain never writes over one
    return save, [PY, "-m", "fe_megatron.train", "--config", CONFIG, "--save", save,
                  *data_overrides(c, tokenizer, prefix), f"training.train_steps={steps}",
                  f"optimizer.warmup_steps={max(1, steps // 15)}", f"training.save_interval={steps}",
                  f"training.eval_interval={steps}", *extra]


CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def train_runs(c: Checker, step: str, runs: dict) -> tuple:
    """Run each fe-pretrain command of ``runs`` (``{name: (save, command, env)}``) in turn:
    ``(curves, failed, not_run)``, the logged LM loss per run, the runs that failed or logged
    nothing, and those the budget left out (what the runs before them measured is kept)."""
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


def pretrain(c: Checker, steps: int, tokenizer: str, prefix: str, mcore_start: str) -> str:
    """Returns the GPU fp32 run's directory (for hf-generate), or None."""
    start = time.perf_counter()
    load = f"load={mcore_start}"  # the Transformer Engine spec names its weights otherwise: its own start
    # bf16 with Transformer Engine's spec where it is installed, else with the local spec (and the shared start)
    has_te = importlib.util.find_spec("transformer_engine") is not None
    bf16_spec = ("training.transformer_impl=te",) if has_te else (load,)
    runs = {
        "cpu_fp32": ("training.precision=fp32", "training.kernel_backend=torch", load),
        "gpu_fp32": ("training.precision=fp32", "training.kernel_backend=cuda", load),
        "gpu_bf16": ("training.precision=bf16", "training.kernel_backend=cuda", *bf16_spec),
        "gpu_bf16_host_tables": ("training.precision=bf16", "training.kernel_backend=cuda", "memory.table_dtype=bf16",
                                 "optimizer.table_state_dtype=bf16", "memory.table_placement=host", load),
    }
    curves, failed, not_run = train_runs(c, "pretrain", {
        name: (*pretrain_args(c, name, steps, tokenizer, prefix, *extra), CPU_ONLY if name.startswith("cpu") else None)
        for name, extra in runs.items()})
    numbers = {"steps": steps, "bf16_spec": "te" if has_te else "local", "final_lm_loss": final_losses(curves)}
    why = [f"runs that failed: {', '.join(failed)}"] if failed else []
    if not_run:
        why.append(f"runs not started, the time budget being spent: {', '.join(not_run)}")
    limits = {"gpu_fp32": ("GPU fp32", FP32_CURVE_RTOL), "gpu_bf16": ("GPU bf16", BF16_CURVE_RTOL),
              "gpu_bf16_host_tables": ("GPU bf16 host-tier", BF16_CURVE_RTOL)}
    for name, (what, limit) in limits.items():
        if curves.get(name) and curves.get("cpu_fp32"):  # compared only where both runs logged losses
            difference, compared = compare_curves(curves[name], curves["cpu_fp32"])
            numbers[f"{name}_vs_cpu_max_rel"], numbers["logged_steps"] = difference, compared
            if difference > limit:
                why.append(f"{what} curve differs from the CPU fp32 one by {difference:.2e} (limit {limit:.0e})")
    c.record("pretrain", not why, time.perf_counter() - start, numbers, "; ".join(why))
    return os.path.join(c.out, "runs", "gpu_fp32") if curves.get("gpu_fp32") and "gpu_fp32" not in failed else None


def deepspeed_zero3(c: Checker, steps: int, tokenizer: str, prefix: str, hf_start: str) -> None:
    start = time.perf_counter()
    runs = {"ds_cpu_fp32": (("training.precision=fp32",), CPU_ONLY),
            "ds_gpu_bf16": (("training.precision=bf16",), None)}
    curves, failed, not_run = train_runs(c, "deepspeed-zero3", {
        name: (*pretrain_args(c, name, steps, tokenizer, prefix, "training.engine=deepspeed",
                              "deepspeed={zero_optimization: {stage: 3}}", f"load={hf_start}", *extra), env)
        for name, (extra, env) in runs.items()})
    difference, compared = compare_curves(curves.get("ds_gpu_bf16", {}), curves.get("ds_cpu_fp32", {}))
    why = [f"runs that failed: {', '.join(failed)}"] if failed else []
    if not_run:
        why.append(f"runs not started, the time budget being spent: {', '.join(not_run)}")
    if not failed and not not_run and difference > BF16_CURVE_RTOL:
        why.append(f"GPU bf16 curve differs from the CPU fp32 one by {difference:.2e} (limit {BF16_CURVE_RTOL:.0e})")
    c.record("deepspeed-zero3", not why, time.perf_counter() - start,
             {"gpu_bf16_vs_cpu_fp32_max_rel": difference, "logged_steps": compared,
              "final_lm_loss": final_losses(curves)}, "; ".join(why))


GENERATE = """
import json, sys, torch
import fe_megatron.hf
from fe_megatron.hf import FactorEngramForCausalLM
hf = sys.argv[1]
prompt = torch.tensor([[1, 200, 31, 412, 77, 9, 1200, 5]])
out = {}
for name, device, dtype in (("cpu_fp32", "cpu", torch.float32), ("gpu_fp32", "cuda", torch.float32),
                            ("gpu_bf16", "cuda", torch.bfloat16)):
    model = FactorEngramForCausalLM.from_pretrained(hf, dtype=dtype).to(device).eval()
    with torch.no_grad():
        ids = model.generate(prompt.to(device), max_new_tokens=48, do_sample=False)
    out[name] = ids[0, prompt.shape[1]:].tolist()
same = lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
print(json.dumps({"new_tokens": len(out["cpu_fp32"]), "gpu_fp32_same_prefix": same(out["gpu_fp32"], out["cpu_fp32"]),
                  "gpu_bf16_same_prefix": same(out["gpu_bf16"], out["cpu_fp32"])}))
"""


def hf_generate(c: Checker, run_dir: str) -> None:
    start = time.perf_counter()
    hf = os.path.join(c.out, "runs", "gpu_fp32_hf")
    shutil.rmtree(hf, ignore_errors=True)
    rc, _ = c.run("hf-generate", [PY, "-m", "fe_megatron.convert.cli", "mcore-to-hf", "--load", run_dir,
                                  "--output", hf], 900)
    rc2, output = c.run("hf-generate", [PY, "-c", GENERATE, hf], 900, {"NVIDIA_TF32_OVERRIDE": "0"})
    rows = json_lines(output)
    numbers = rows[-1] if rows else {}
    ok = rc == 0 and rc2 == 0 and numbers.get("gpu_fp32_same_prefix") == numbers.get("new_tokens")
    c.record("hf-generate", ok, time.perf_counter() - start, numbers,
             "" if ok else "conversion or generation failed, or the GPU fp32 tokens differ from the CPU ones")


def summary(c: Checker) -> str:
    lines = [f"# gpu_check, {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}", "",
             "| step | status | seconds | numbers |", "| --- | --- | --- | --- |"]
    for step in c.steps:
        numbers = json.dumps(step["numbers"])
        numbers = numbers if len(numbers) < 400 else numbers[:400] + " ... (gpu_check.json)"
        lines.append(f"| {step['step']} | {step['status']}{' (' + step['why'] + ')' if 'why' in step else ''} "
                     f"| {step['seconds']} | `{numbers}` |")
    return "\n".join(lines) + "\n"


STEPS = ("environment", "build", "kernel-tests", "kernel-bench", "train-bench", "pretrain", "hf-generate",
         "deepspeed-zero3", "table-storage")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_results", help="results folder (default gpu_results)")
    parser.add_argument("--steps", type=int, default=60, help="training steps of each pretraining run (default 60)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole check; steps it leaves out are recorded as not run")
    parser.add_argument("--skip", nargs="+", default=[], choices=STEPS[2:], metavar="STEP",
                        help=f"steps to leave out, of: {', '.join(STEPS[2:])} (hf-generate and deepspeed-zero3 "
                             "use pretrain's data and start weights, so leaving pretrain out leaves them out too); "
                             "a step left out makes the exit status 1, as a failed one")
    args = parser.parse_args(argv)
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s {args.budget_s:g}: give a positive number of seconds")
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no GPU is visible to torch {torch.__version__} (torch.cuda.is_available() is False); "
              "nothing was run. Run it on a machine with an NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
        return NO_GPU_EXIT
    c = Checker(os.path.abspath(args.out), args.budget_s)
    try:
        environment(c)
        built = build(c)
    except BudgetSpent:
        c.not_run("build", f"the time budget of {args.budget_s:.0f} s was spent before it ended")
        built = False
    if not built:
        for name in STEPS[2:]:
            c.not_run(name, "the CUDA kernels were not built")
    else:
        state = {}

        def pretrain_step():
            tokenizer, prefix = prepare_data(c)
            state["data"] = tokenizer, prefix
            state["hf_start"], mcore_start = start_weights(c, tokenizer, prefix)
            if mcore_start is None:
                c.record("pretrain", False, 0.0,
                         why="the data or the shared initial weights could not be made (data.log, start-weights.log)")
            else:
                state["run_dir"] = pretrain(c, args.steps, tokenizer, prefix, mcore_start)

        steps = {
            "kernel-tests": lambda: kernel_tests(c),
            "kernel-bench": lambda: kernel_bench(c),
            "train-bench": lambda: train_bench(c),
            "pretrain": pretrain_step,
            "hf-generate": lambda: hf_generate(c, state["run_dir"]) if state.get("run_dir") else
            c.not_run("hf-generate", "no GPU fp32 pretraining run to convert"),
            "deepspeed-zero3": lambda: deepspeed_zero3(c, args.steps, *state["data"], state["hf_start"])
            if state.get("hf_start") else c.not_run("deepspeed-zero3", "no shared initial weights (pretrain step)"),
            "table-storage": lambda: table_storage(c),
        }
        for name, step in steps.items():
            if name in args.skip:
                c.not_run(name, "left out by --skip")
                continue
            try:
                step()
            except BudgetSpent:
                c.not_run(name, f"the time budget of {args.budget_s:.0f} s was spent before it ended")
            except Exception as err:  # noqa: BLE001 (a broken step is recorded, and the others still run)
                c.record(name, False, 0.0, why=f"the check itself failed: {type(err).__name__}: {err}")
    c.write()
    print(summary(c))
    return 0 if c.steps and all(step["status"] == "pass" for step in c.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
