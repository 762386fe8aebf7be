"""`fe_megatron.megatron.megatron_lm_spec`: the spec module Megatron-LM's own scripts import reads
its memory from the environment."""

import os


def test_megatron_lm_spec_module_reads_the_environment(tmp_path):
    import subprocess
    import sys

    code = ("import warnings; warnings.filterwarnings('ignore');"
            "from fe_megatron.megatron import megatron_lm_spec as m;"
            "print(m.factorengram_local_spec.module.__name__, m.memory_config.layers, m.memory_config.hidden_size)")
    env = dict(os.environ, FE_MEMORY_PRESET="factorengram-tiny")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "FactorEngramTransformerLayer" and "[1, 2] 128" in out
    cfg = tmp_path / "m.yaml"
    cfg.write_text("memory:\n  preset: factorengram-tiny\n  layers: [3]\n")
    env = dict(os.environ, FE_MEMORY_CONFIG=str(cfg))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "[3] 128" in out
