"""Resident memory and generation speed of a FactorEngram model with its tables in memory
against the same model with ``table_storage="mmap"`` (tables read from the safetensors file).

Writes a model whose tables are several GB (random weights: the point is bytes, not text),
then, each in a fresh process, loads it three ways (``STORAGES``) and generates greedily from
the same prompts.  Reports private and file-backed resident memory after loading and after
generating, the load time and the tokens/s of each, and checks that all three generate the
same tokens.

    python benchmarks/bench_mmap_tables.py [--table-gb 4] [--new-tokens 64] [--dir /tmp/bench_mmap]
"""

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time

import torch
import transformers

# "copied": the tables read into private memory (a loader that copies the file); "memory":
# transformers' own loading (table_storage="memory"); "mmap": table_storage="mmap".
STORAGES = ("copied", "memory", "mmap")


def build(directory: str, table_gb: float) -> dict:
    """A 4-layer d=256 model, memory at layers 1 and 2, tables of about ``table_gb`` GB in all."""
    from fe_megatron.config import BackboneConfig, MemoryConfig
    from fe_megatron.hf import FactorEngramConfig, FactorEngramForCausalLM

    backbone = BackboneConfig(vocab_size=32000, hidden_size=256, num_layers=4, num_attention_heads=4,
                              ffn_hidden_size=1024, seq_length=1024)
    width = 64  # s_b: 6 branches x 64 = s
    rows = int(table_gb * 2 ** 30 / (4 * width * 2))  # per layer
    capacity = (rows - 2 * 32000) // 4
    memory = MemoryConfig(backbone=backbone, ngram_orders=[1, 2, 3], heads_per_order=2,
                          table_capacity=[32000, capacity, capacity], coeff_width=6 * width, memory_dim=256,
                          layers=[1, 2])
    config = FactorEngramConfig.from_fe_megatron(backbone, memory, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = FactorEngramForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".memory." in name and ("value_proj" in name or "conv.weight" in name):
                param.normal_(0, 0.2)  # the branch output starts at zero; make the tables matter
    model.save_pretrained(directory, max_shard_size="100GB")
    tables = sum(p.numel() for n, p in model.named_parameters() if n.endswith("tables.weight"))
    return {"table_params": tables, "table_bytes": 4 * tables,
            "file_bytes": sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
                              if f.endswith(".safetensors"))}


def memory_status() -> dict:
    """Resident memory in MiB: private (``RssAnon``: what the process itself holds) and file-backed
    (``RssFile``: pages of mapped files, which the kernel may drop and re-read at any time)."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("RssAnon", "RssFile")):
                name, value = line.split(":")
                out[name] = int(value.split()[0]) >> 10
    return out


def measure(directory: str, storage: str, new_tokens: int, batch: int) -> dict:
    """Run in a fresh process: load as ``storage`` says, generate, report memory and speed."""
    from transformers import AutoModelForCausalLM

    import fe_megatron.hf  # noqa: F401 - registers the model

    before = memory_status()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(directory, table_storage="mmap" if storage == "mmap" else "memory",
                                                 dtype=torch.float32).eval()
    if storage == "copied":  # what a loader that reads the file into memory holds
        for index in model.model.memory_layers:
            tables = model.model.layers[index].memory.tables
            tables.weight.data = tables.weight.data.clone()
    loaded = time.perf_counter() - start
    after_load = memory_status()
    prompts = torch.randint(3, 32000, (batch, 32), generator=torch.Generator().manual_seed(1))
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    model.generate(prompts, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompts, **settings)
    seconds = time.perf_counter() - start
    after = memory_status()
    return {"storage": storage, "load_seconds": round(loaded, 2),
            "private_mb": {"before_load": before["RssAnon"], "after_load": after_load["RssAnon"],
                           "after_generate": after["RssAnon"]},
            "file_backed_mb": {"after_load": after_load["RssFile"], "after_generate": after["RssFile"]},
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
            "tokens_per_second": round(batch * new_tokens / seconds, 1), "tokens": out[:, 32:].tolist()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table-gb", type=float, default=4.0, help="GB of fp32 tables in all (default 4)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dir", default="/tmp/bench_mmap_tables", help="where the model is written")
    parser.add_argument("--measure", choices=STORAGES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.dir, args.measure, args.new_tokens, args.batch)))
        return 0
    shutil.rmtree(args.dir, ignore_errors=True)
    sizes = build(args.dir, args.table_gb)
    results = []
    for storage in STORAGES:
        done = subprocess.run([sys.executable, __file__, "--measure", storage, "--dir", args.dir,
                               "--new-tokens", str(args.new_tokens), "--batch", str(args.batch)],
                              check=True, capture_output=True, text=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    tokens = [result.pop("tokens") for result in results]
    copied_speed = results[0]["tokens_per_second"]
    report = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "transformers": transformers.__version__, **sizes,
              "identical_tokens": all(t == tokens[0] for t in tokens), "results": results,
              "tokens_per_second_over_copied": {r["storage"]: round(r["tokens_per_second"] / copied_speed, 3)
                                                for r in results}}
    print(json.dumps(report, indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0 if report["identical_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
