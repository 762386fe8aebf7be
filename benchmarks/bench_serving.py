"""Serving a FactorEngram model with vLLM: throughput against transformers' generate, the memory's cost in vLLM,
and the time to the first token with the tables in memory or memory-mapped.

    python benchmarks/bench_serving.py --model runs/demo/factorengram-hf [--batches 1,8,32] [--busy-cores 1]
    python benchmarks/bench_serving.py --model runs/wide-hf --make-340m-width   # a 4-layer model of the paper's width
    python benchmarks/bench_serving.py --model runs/d512-hf --make-model 512x8  # width 512, 8 layers

(``make bench-serving`` converts the demo's runs and runs this in .venv-serve.)  On the same prompts (random
token ids, ``--prompt-tokens`` long), greedy, ``--new-tokens`` each:

* **vLLM / generate**: output tokens/s at each batch size; generate runs the batch left-padded, in this
  process (with the intra-op threads torch gives it), vLLM in its engine;
* **memory's cost**: the same folder served twice, with its memory and without it (``hf_overrides={"memory":
  None}``: the same backbone and weights, no memory layer); both engines stay up and take turns, batch by
  batch, so both see the same load;
* **time to the first token**: a fresh engine, tables ``"memory"`` (loaded) or ``"mmap"`` (mapped from the
  safetensors file), the start-up time and the first request's (one prompt, one token), then the median of
  five more.

``--make-model 512x8`` first writes, in ``--model``, a random model of that width and depth with the 340M preset's
memory scaled to it (``s = d_m = 3 d``, its branches and gates, at 10/24 and 12/24 of the depth, tables of
``--table-rows`` rows per hashed head); ``--make-340m-width`` is ``1024x4``, the paper's width: the memory's cost
where the backbone is not tiny.  vLLM runs at its defaults (compiled, prefix caching on, its engine in processes
of its own); ``--enforce-eager`` serves eagerly, ``--in-process`` runs the engine in the benchmark's process.

``--fusion`` adds an engine whose processes run the branch's equations unfused (``FE_MEGATRON_FUSED_BRANCH=0``,
`fe_megatron.ops.use_fused_branch`): the memory's cost with the fused kernels and without them, in the same run.

``--op-times`` (with ``--in-process``) adds the time spent in the memory's custom ops per step, per engine.

``--busy-cores N`` keeps N cores busy the whole time (a host with other work).  Prints a JSON line per
measurement and a Markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import contextmanager, nullcontext

import torch

from host_load import busy_cores  # this folder is on the path when the script runs

FUSED_BRANCH_ENV = "FE_MEGATRON_FUSED_BRANCH"  # fe_megatron.ops.FUSED_BRANCH_ENV: 0 runs the branch unfused
ENGINE = dict(dtype="float32", gpu_memory_utilization=0.05, skip_tokenizer_init=True, seed=0)
# vLLM's workers keep polling for work for a second after their last step (its shared-memory queue's busy
# loop); each measurement waits that out, so that an idle engine takes no core from the one being timed
SETTLE_S = 1.5


def prompts_of(vocab_size: int, count: int, length: int, seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]


def vllm_generate(llm, prompts, new_tokens) -> tuple:
    """``(seconds, token lists)`` of one greedy batch."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    time.sleep(SETTLE_S)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def hf_generate(model, prompts, new_tokens) -> tuple:
    """``(seconds, token lists)`` of one greedy batch through transformers' generate (left padding)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    time.sleep(SETTLE_S)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, out[:, width:].tolist()


def make_random_model(directory: str, width: int, layers: int, table_rows: int) -> None:
    """A random model of ``width`` and ``layers`` with the 340M preset's memory scaled to it (``s = d_m = 3 d``, its
    branches and gates, at layers ``10/24`` and ``12/24`` of the depth), saved as fe-convert does."""
    from fe_megatron.config import BackboneConfig, MemoryConfig
    from fe_megatron.hf import FactorEngramConfig, FactorEngramForCausalLM
    from fe_megatron.presets import BACKBONES, PRESETS

    backbone = BackboneConfig(**dict(BACKBONES["340m"], hidden_size=width, num_layers=layers,
                                     num_attention_heads=width // 64, ffn_hidden_size=width * 11 // 4, seq_length=512))
    preset = {key: value for key, value in PRESETS["factorengram-340m"].items() if key != "backbone"}
    memory = MemoryConfig(backbone=backbone, **dict(preset, layers=[layers * 10 // 24, layers * 12 // 24],
                                                     coeff_width=3 * width, memory_dim=3 * width,
                                                     table_capacity=[backbone.vocab_size, table_rows, table_rows]))
    torch.manual_seed(0)
    model = FactorEngramForCausalLM(FactorEngramConfig.from_fe_megatron(backbone, memory, pad_token_id=0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".memory." in name and ("value_proj" in name or "conv.weight" in name):
                param.normal_(0, 0.02)
    model.save_pretrained(directory)


def throughput(args, report):
    """vLLM against generate, and the memory's cost in vLLM, at each batch size."""
    import vllm
    from transformers import AutoModelForCausalLM

    import fe_megatron.hf  # noqa: F401 - registers the model with transformers

    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    vocab = model.config.vocab_size
    from fe_megatron import ops

    engines = {"vllm": vllm.LLM(args.model, **ENGINE),
               "vllm_no_memory": vllm.LLM(args.model, hf_overrides={"memory": None}, **ENGINE)}
    unfused = set()  # the engines whose steps run without the fused kernels
    if args.fusion:  # an engine whose processes start with the branch's equations unfused
        os.environ[FUSED_BRANCH_ENV] = "0"
        try:
            engines["vllm_unfused"] = vllm.LLM(args.model, **ENGINE)
        finally:
            del os.environ[FUSED_BRANCH_ENV]
        unfused.add("vllm_unfused")  # in the benchmark's process (--in-process), the environment came too late
    timer = OpTimer() if args.op_times else None
    for batch in args.batches:
        prompts = prompts_of(vocab, batch, args.prompt_tokens, seed=batch)
        for engine in engines.values():
            vllm_generate(engine, prompts, 2)  # warm
        hf_generate(model, prompts, 2)
        times = {name: [] for name in (*engines, "generate")}
        same = True
        for _ in range(args.repeats):
            served = {}
            for name, engine in engines.items():  # the engines take turns: all see the same load
                fusion = ops.use_fused_branch(False) if name in unfused else nullcontext()
                with fusion, (timer.of(name) if timer else nullcontext()):
                    seconds, served[name] = vllm_generate(engine, prompts, args.new_tokens)
                times[name].append(seconds)
            seconds, generated = hf_generate(model, prompts, args.new_tokens)
            times["generate"].append(seconds)
            same = same and served["vllm"] == generated and served.get("vllm_unfused", generated) == generated
        tokens = batch * args.new_tokens
        rate = {name: tokens / statistics.median(values) for name, values in times.items()}
        row = {"measure": "throughput", "batch": batch, "busy_cores": args.busy_cores,
               "tokens_per_s": {name: round(value, 1) for name, value in rate.items()},
               "vllm_over_generate": round(rate["vllm"] / rate["generate"], 2),
               "memory_cost": round(1 - rate["vllm"] / rate["vllm_no_memory"], 3),
               "same_tokens_as_generate": same}
        if args.fusion:
            row["unfused_memory_cost"] = round(1 - rate["vllm_unfused"] / rate["vllm_no_memory"], 3)
        if timer:  # the memory's custom ops, per step (a step decodes one token of every request)
            steps = args.repeats * args.new_tokens
            row["memory_ops_ms_per_step"] = {name: {op: round(seconds / steps * 1e3, 3) for op, seconds in ops_.items()}
                                             for name, ops_ in timer.take().items()}
        report(row)


class OpTimer:
    """The seconds spent in the memory's custom ops (`fe_megatron.vllm.memory_layer`: the router's, every layer's),
    per engine, in the benchmark's process (``--in-process``, where the ops run)."""

    def __init__(self):
        from fe_megatron.vllm import memory_layer

        self.engine, self.seconds = None, {}
        for cls, op in ((memory_layer.ServedMemoryRouter, "router"), (memory_layer.ServedMemory, "layers")):
            cls.forward_native = self._timed(cls.forward_native, op)

    def _timed(self, function, op):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if self.engine is not None:
                    spent = self.seconds.setdefault(self.engine, {"router": 0.0, "layers": 0.0})
                    spent[op] += time.perf_counter() - start
        return timed

    @contextmanager
    def of(self, engine: str):
        self.engine = engine
        try:
            yield
        finally:
            self.engine = None

    def take(self) -> dict:
        seconds, self.seconds = self.seconds, {}
        return seconds


def first_token(args, report):
    """Start-up and time to the first token, tables loaded or memory-mapped, each in a fresh engine."""
    import vllm

    for storage in ("memory", "mmap"):
        start = time.perf_counter()
        llm = vllm.LLM(args.model, hf_overrides={"table_storage": storage}, **ENGINE)
        started = time.perf_counter() - start
        vocab = llm.llm_engine.vllm_config.model_config.hf_config.vocab_size
        prompts = prompts_of(vocab, 6, args.prompt_tokens, seed=99)
        first = vllm_generate(llm, prompts[:1], 1)[0]
        later = statistics.median(vllm_generate(llm, [prompt], 1)[0] for prompt in prompts[1:])
        report({"measure": "first_token", "table_storage": storage, "busy_cores": args.busy_cores,
                "start_s": round(started, 2), "first_request_ms": round(first * 1e3, 1),
                "later_requests_ms": round(later * 1e3, 1)})
        llm.llm_engine.engine_core.shutdown()
        del llm


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a converted folder (fe-convert mcore-to-hf)")
    parser.add_argument("--batches", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy-cores", type=int, default=0)
    parser.add_argument("--memory-share", type=float, default=0.05, help="vLLM's gpu_memory_utilization: on a CPU "
                        "the share of host memory it takes for the model and its cache")
    parser.add_argument("--skip", default="", help="comma-separated: throughput, first_token")
    parser.add_argument("--make-model", metavar="WIDTHxLAYERS", help="write a random model of that width and depth "
                        "in --model first, e.g. 512x8")
    parser.add_argument("--make-340m-width", action="store_true", help="--make-model 1024x4: the paper's width")
    parser.add_argument("--table-rows", type=int, default=50_000, help="with --make-model: rows per hashed head")
    parser.add_argument("--fusion", action="store_true", help="a third engine with the branch's equations unfused "
                        f"({FUSED_BRANCH_ENV}=0): the memory's cost with and without the fused kernels, in one run")
    parser.add_argument("--op-times", action="store_true", help="with --in-process: the time in the memory's "
                        "custom ops per step, per engine")
    parser.add_argument("--enforce-eager", action="store_true", help="serve eagerly (vLLM compiles by default)")
    parser.add_argument("--in-process", action="store_true", help="run vLLM's engine in this process "
                        "(VLLM_ENABLE_V1_MULTIPROCESSING=0) instead of its own processes")
    args = parser.parse_args()
    shape = "1024x4" if args.make_340m_width else args.make_model
    if shape:
        width, layers = (int(part) for part in shape.lower().split("x"))
        make_random_model(args.model, width, layers, args.table_rows)
    if args.op_times and not args.in_process:
        parser.error("--op-times times the memory's ops where they run: add --in-process")
    ENGINE["enforce_eager"] = args.enforce_eager
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    ENGINE["gpu_memory_utilization"] = args.memory_share
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model {args.model} has no config.json: convert a run with fe-convert mcore-to-hf first")
    rows = []

    def report(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    with busy_cores(args.busy_cores):
        if "throughput" not in args.skip:
            throughput(args, report)
        if "first_token" not in args.skip:
            first_token(args, report)
    print("\n| batch | generate tok/s | vLLM tok/s | vLLM / generate | vLLM without memory tok/s | memory's cost |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if row["measure"] == "throughput":
            rate = row["tokens_per_s"]
            print(f"| {row['batch']} | {rate['generate']:,.0f} | {rate['vllm']:,.0f} | {row['vllm_over_generate']} | "
                  f"{rate['vllm_no_memory']:,.0f} | {row['memory_cost']:.1%} |")
    print("\n| tables | engine start s | first request ms | later requests ms |")
    print("|---|---:|---:|---:|")
    for row in rows:
        if row["measure"] == "first_token":
            print(f"| {row['table_storage']} | {row['start_s']} | {row['first_request_ms']} | "
                  f"{row['later_requests_ms']} |")


if __name__ == "__main__":
    main()
