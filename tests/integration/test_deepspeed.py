"""The DeepSpeed engine: ZeRO 1/2/3 against the Megatron engine at DP=2, both table modes, exact
resume, and conversion to Hugging Face.  DeepSpeed configs that contradict the training config, and
the tables outside ZeRO in one process, are tests/unit/deepspeed/'s."""

import glob
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from fe_megatron.deepspeed import shm_buffers
from fe_megatron.training.config import load_train_config
from tests.helpers.deepspeed import CLIP, STEPS, overrides
from tests.helpers.models import make_memory_matter
from tests.helpers.torchrun_util import failed_launch
from tests.helpers.training import CONFIG, ENDS_CLEANLY, ROOT, metrics, run_pretrain

pytest.importorskip("deepspeed", reason="DeepSpeed is installed by the project's set-up (make setup)")

DS = "training.engine=deepspeed"


def losses(save):
    return [(r["step"], r["lm_loss"], r["sparsity_loss"]) for r in metrics(save) if "lm_loss" in r]


def grad_norms(save):
    return [r["grad_norm"] for r in metrics(save) if "grad_norm" in r]


def assert_same_curve(got, expected, rel=2e-5):
    assert [step for step, *_ in got] == [step for step, *_ in expected]
    for (step, lm, sparsity), (_, lm_ref, sparsity_ref) in zip(got, expected):
        assert lm == pytest.approx(lm_ref, rel=rel), f"step {step}: lm loss {lm} vs {lm_ref}"
        assert sparsity == pytest.approx(sparsity_ref, rel=rel, abs=1e-7), f"step {step}: sparsity"


@pytest.fixture(scope="module")
def start(small_data, tmp_path_factory):
    """One set of initial weights for both engines: a Hugging Face directory (the DeepSpeed
    engine's --load) and the same weights as a Megatron checkpoint (fe-convert hf-to-mcore).
    The memory's output projections are perturbed so that the tables get gradients at once."""
    from fe_megatron.deepspeed.engine import build_model
    from fe_megatron.convert.to_mcore import hf_to_mcore

    base = tmp_path_factory.mktemp("deepspeed")
    cfg = load_train_config(CONFIG, overrides(small_data))
    torch.manual_seed(11)
    model = build_model(cfg)
    make_memory_matter(model, 0.05)
    hf = str(base / "hf")
    model.save_pretrained(hf)
    shutil.copyfile(small_data["tokenizer"], os.path.join(hf, "tokenizer.model"))
    return {"hf": hf, "mcore": hf_to_mcore(hf, str(base / "mcore")), "base": base, "data": small_data}


@pytest.fixture(scope="module")
def megatron_run(start):
    """The Megatron engine at DP=2 from the shared weights, with clipping active at every step:
    the reference of every DeepSpeed run here."""
    save = str(start["base"] / "megatron")
    run_pretrain(["--config", CONFIG, "--load", start["mcore"], "--save", save] + overrides(start["data"]), nproc=2,
                 ends_cleanly=True)
    norms = grad_norms(save)
    assert len(norms) == STEPS and min(norms) > CLIP, f"clipping must be active at every step: norms {norms}"
    return save


def deepspeed_run(start, name, stage, launcher="torchrun", **extra):
    save = str(start["base"] / name)
    args = ["--config", CONFIG, "--load", start["hf"], "--save", save, DS,
            f"deepspeed={{zero_optimization: {{stage: {stage}}}}}"] + overrides(start["data"], **extra)
    if launcher == "deepspeed":
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env["OMP_NUM_THREADS"] = "1"
        port = _free_port()
        cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port",
               str(port), ENDS_CLEANLY] + args
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        assert proc.returncode == 0, failed_launch(proc)
        # DeepSpeed's CPU all-reduce made one 66 MB file per rank in /dev/shm (the deepspeed launcher says all
        # ranks are local); the engine removed both at its end (fe_megatron/deepspeed/shm_buffers.py)
        left = [name for name in os.listdir(shm_buffers.FOLDER)
                if name.startswith(shm_buffers.PREFIX) and f"_{port}_" in name]
        assert not left, f"the run left DeepSpeed's all-reduce buffers in /dev/shm: {left}"
    else:
        proc = run_pretrain(args, nproc=2, ends_cleanly=True)
        # no third-party noise: torch's deprecation of ZeRO's collectives, DeepSpeed's accelerator guess
        noise = [line for line in (proc.stdout + proc.stderr).splitlines()
                 if "Warning" in line or "unable to detect" in line or "built successfully" in line]
        assert not noise, "\n".join(noise[:5])
    assert "loaded the weights of" in proc.stdout
    return save


def plant_a_killed_run_s_buffer() -> str:
    """A DeepSpeed all-reduce buffer in /dev/shm as a killed run leaves it: this user's, mapped by no process,
    made two minutes ago (at a port no run uses: 0)."""
    path = os.path.join(shm_buffers.FOLDER, f"{shm_buffers.PREFIX}{os.getuid()}_127.0.0.1_0_1")
    with open(path, "wb") as fh:
        fh.write(b"\0" * 4096)
    made = time.time() - 120
    os.utime(path, (made, made))
    return path


def step_2_alone(source: str, target: str) -> None:
    """A run folder ``target`` holding only ``source``'s step-2 checkpoint (as if the run had stopped there)."""
    shutil.copytree(os.path.join(source, "iter_0000002"), os.path.join(target, "iter_0000002"))
    with open(os.path.join(target, "latest"), "w") as fh:
        fh.write("iter_0000002")


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def zero3(start):
    return deepspeed_run(start, "zero3", 3)


ROWS = {"parallel.table_sharding": "rows"}


@pytest.fixture(scope="module")
def rows3(start):
    """ZeRO-3 with the tables row-sharded outside it, clipped by one norm with ZeRO's parameters."""
    return deepspeed_run(start, "rows3", 3, **ROWS)


@pytest.mark.distributed
# ZeRO-0's clipping hook runs in the rows case (the backbone inside ZeRO, the tables outside it): a ZeRO-0 case
# with the tables inside too would run the same hook over a subset, so there is none (CI's time budget).
@pytest.mark.parametrize("stage,launcher,sharding", [(0, "torchrun", "rows"), (1, "deepspeed", "node"),
                                                     (2, "torchrun", "replicated")])
def test_zero_0_1_and_2_match_the_megatron_engine(start, megatron_run, rows3, tmp_path, stage, launcher, sharding):
    """Same batches, same weights, clipping active: the loss curves and the logged gradient norms agree
    to fp32 rounding, with the tables as ZeRO's parameters and with them row-sharded outside it (also
    without ZeRO, where DeepSpeed reports no norm and the run takes it), or node-shared (the row shards of
    the node's ranks once in shared memory, the folder left empty).  One norm clips both
    (DeepSpeed without ZeRO and ZeRO 1 each have their own hook): the tables' moments are ZeRO-3's
    rows run's, which test_tables_outside_zero_are_clipped_as_tables_inside_it checks against ZeRO's own."""
    extra = {"parallel.table_sharding": sharding}
    if sharding == "node":
        extra.update({"memory.table_placement": "host", "parallel.shared_table_folder": str(tmp_path)})
    if launcher == "deepspeed":  # what a killed run under the deepspeed launcher leaves, for this one to remove
        killed = plant_a_killed_run_s_buffer()
    save = deepspeed_run(start, f"zero{stage}_{sharding}", stage, launcher, **extra)
    if launcher == "deepspeed":
        assert not os.path.exists(killed), f"{killed} (a killed run's all-reduce buffer) was not removed"
    assert_same_curve(losses(save), losses(megatron_run))
    assert grad_norms(save) == pytest.approx(grad_norms(megatron_run), rel=1e-4)
    if sharding == "node":
        assert os.listdir(tmp_path) == []  # the segments were removed once mapped
    if sharding in ("rows", "node"):
        got, expected = table_moments(save), table_moments(rows3)
        assert got.keys() == expected.keys() and expected
        for name, values in expected.items():
            torch.testing.assert_close(got[name], values, rtol=1e-4, atol=1e-9, msg=name)


def table_moments(save: str, step: int = STEPS) -> dict:
    """The tables' first Adam moments at ``step``, whole, by Hugging Face name: read from the tables'
    checkpoint of every engine (``fe_tables/``, by global row), as fe-convert reads it."""
    from fe_megatron.convert.megatron_reader import DistCheckpoint
    from fe_megatron.hf.weights import hf_names

    tables = DistCheckpoint(os.path.join(save, f"iter_{step:07d}", "fe_tables"))
    return {hf_names(name)[0]: tables.load(f"optimizer.state.exp_avg.{name}") for name in tables.weight_names()}


@pytest.mark.distributed
def test_zero_3_matches_the_megatron_engine_and_resumes_exactly(start, megatron_run, zero3):
    assert_same_curve(losses(zero3), losses(megatron_run))
    # resume from the step-2 checkpoint: steps 3 and 4 come out bit-identical
    half = str(start["base"] / "zero3_resumed")
    step_2_alone(zero3, half)
    proc = run_pretrain(["--config", CONFIG, "--load", half, "--save", half, DS,
                         "deepspeed={zero_optimization: {stage: 3}}"] + overrides(start["data"]), nproc=2,
                        ends_cleanly=True)
    assert "resumed from" in proc.stdout and "at iteration 2" in proc.stdout
    assert losses(half) == losses(zero3)[2:]


@pytest.fixture(scope="module")
def rows3_bf16(start):
    """rows3 with bf16 tables (fp32 moments)."""
    return deepspeed_run(start, "rows3_bf16", 3, **BF16_ROWS)


BF16_ROWS = dict(ROWS, **{"memory.table_dtype": "bf16"})


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["zero", "rows", "rows-host"])
def test_a_checkpoint_resumes_on_fewer_ranks(start, zero3, rows3, mode):
    """A node lost: the step-2 checkpoint of the 2-rank run resumes on 1 rank (ZeRO-3's partitions
    through DeepSpeed's universal checkpoint, the row-sharded tables and their moments regathered,
    also into the host tier) and steps 3-4 match the uninterrupted 2-rank run."""
    source, extra = {"zero": (zero3, {}), "rows": (rows3, ROWS),
                     "rows-host": (rows3, dict(ROWS, **{"memory.table_placement": "host"}))}[mode]
    half = str(start["base"] / f"{mode}_on_one_rank")
    step_2_alone(source, half)
    # one process: rank 0 hosts the group's TCP store, which ends_cleanly.py checks is gone too
    proc = run_pretrain(["--config", CONFIG, "--load", half, "--save", half, DS,
                         "deepspeed={zero_optimization: {stage: 3}}"] + overrides(start["data"], **extra), nproc=1,
                        ends_cleanly=True)
    assert "at iteration 2, saved by 2 data-parallel ranks" in proc.stdout
    assert_same_curve(losses(half), losses(source)[2:])
    assert ".fe_universal" not in os.listdir(half)  # the universal copy is gone once loaded
    if mode != "zero":  # the tables by global row, whatever split wrote or reads them
        assert "fe_tables" in os.listdir(os.path.join(half, "iter_0000004"))
        for name, values in table_moments(source).items():
            torch.testing.assert_close(table_moments(half)[name], values, rtol=1e-4, atol=1e-9, msg=name)
    else:  # the other table mode is refused by name, before any loading
        refused = run_pretrain(["--config", CONFIG, "--load", half, "--save", half, DS,
                                "deepspeed={zero_optimization: {stage: 3}}"]
                               + overrides(start["data"], **{"parallel.table_sharding": "rows"}), check=False)
        assert refused.returncode != 0
        assert "resume with the table settings it was saved with (parallel.table_sharding=replicated)" in refused.stderr


@pytest.mark.distributed
def test_resuming_with_a_guarded_change_is_refused_naming_both_values(start, zero3):
    proc = run_pretrain(["--config", CONFIG, "--load", zero3, "--save", zero3, DS,
                         "deepspeed={zero_optimization: {stage: 3}}"]
                        + overrides(start["data"], **{"memory.hash_seed": 99}), nproc=2, check=False)
    assert proc.returncode != 0
    assert "cannot resume from" in proc.stderr and "memory.hash_seed is 0 in the checkpoint and 99 now" in proc.stderr


@pytest.mark.distributed
def test_rows_mode_matches_the_megatron_engine_with_clipping(start, megatron_run, rows3):
    """Row-sharded tables outside ZeRO-3 with their own AdamW, clipped by one norm with ZeRO's
    parameters: the Megatron engine's curve."""
    save = rows3
    assert_same_curve(losses(save), losses(megatron_run))
    folder = os.path.join(save, "iter_0000004")
    assert not [f for f in os.listdir(folder) if f.startswith("tables_rank_")]
    # one format: the tables and their moments under the Megatron engine's names, with its values
    from fe_megatron.convert.megatron_reader import DistCheckpoint

    ours = DistCheckpoint(os.path.join(folder, "fe_tables"))
    theirs = DistCheckpoint(os.path.join(megatron_run, "iter_0000004"))
    assert set(ours.metadata) - {"common"} >= {name for name in theirs.metadata if "memory.tables" in name} != set()
    for name in ours.metadata:
        if "memory.tables" in name:
            torch.testing.assert_close(ours.load(name), theirs.load(name), rtol=1e-4, atol=1e-5, msg=name)
    # each rank wrote half of every branch's rows (rounded), never a whole table
    from fe_megatron.hf.safetensors_stream import SafetensorsSource

    whole = SafetensorsSource(start["hf"])
    chunks = {}  # {(table, writing rank): rows}; a rank writes files __<rank>_<thread>.distcp
    metadata = ours.reader.read_metadata()
    for index, storage in metadata.storage_data.items():
        if index.fqn.endswith("memory.tables.weight") and not index.fqn.startswith("optimizer."):
            chunk = next(c for c in metadata.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
            key = (index.fqn, storage.relative_path[2:].split("_")[0])
            chunks[key] = chunks.get(key, 0) + chunk.sizes[0]
    from fe_megatron.hf.weights import hf_names

    assert ours.weight_names() and len(chunks) == 2 * len(ours.weight_names())
    assert all(rows <= whole.shape(hf_names(name)[0])[0] // 2 + 6 for (name, _), rows in chunks.items())


@pytest.mark.distributed
def test_tables_outside_zero_are_clipped_as_tables_inside_it(zero3, rows3, tmp_path):
    """One norm clips ZeRO's parameters and the tables outside it: after 4 clipped steps the tables'
    Adam moments of the rows run (their own files) are those of the zero run, whose tables are ZeRO's
    parameters.  (The loss curves alone cannot tell: Adam nearly ignores a gradient's scale; its first
    moment is that scale.)  Compared as sorted values, since the two lay rows out differently."""
    from fe_megatron.deepspeed.resize import write_universal

    universal = str(tmp_path / "universal")
    write_universal(os.path.join(zero3, "iter_0000004"), universal)
    inside = {os.path.basename(folder): torch.load(os.path.join(folder, "exp_avg.pt"), weights_only=True)
              for folder in glob.glob(os.path.join(universal, "zero", "*tables.weight"))}
    outside_moments = table_moments(rows3)
    assert inside and len(outside_moments) == len(inside)
    for name, moments in inside.items():
        outside = outside_moments[name].reshape(-1)
        expected = moments.reshape(-1)
        assert outside.numel() == expected.numel()
        torch.testing.assert_close(outside.sort().values, expected.sort().values, rtol=1e-4,
                                   atol=1e-4 * float(expected.abs().max()), msg=name)


# In bf16 DeepSpeed builds other optimizers around the model, each with its own hook in JointClipping
BF16_OPTIMIZERS = {"DeepSpeedZeroOptimizer": "{zero_optimization: {stage: 2}}",
                   "FP16_UnfusedOptimizer": "{zero_optimization: {stage: 0}}",
                   "BF16_Optimizer": "{zero_optimization: {stage: 1}, data_types: {grad_accum_dtype: fp32}}"}


@pytest.mark.distributed
def test_the_bf16_optimizers_clip_the_tables_by_one_norm_too(start):
    """Row-sharded tables beside DeepSpeed's bf16 optimizers, one rank, two clipped steps: the tables'
    Adam moments under FP16_UnfusedOptimizer (no ZeRO) and BF16_Optimizer (ZeRO-1 with fp32 gradient
    accumulation) are those under DeepSpeedZeroOptimizer (ZeRO-2, whose hook the fp32 runs above
    check).  Clipped per part, as before their hooks, they were 6 times larger.  The log holds no
    memory report of BF16_Optimizer's construction."""
    moments, norms = {}, {}
    for optimizer, zero in BF16_OPTIMIZERS.items():
        save = str(start["base"] / f"bf16_{optimizer}")
        proc = run_pretrain(["--config", CONFIG, "--load", start["hf"], "--save", save, DS, f"deepspeed={zero}"]
                            + overrides(start["data"], **ROWS, **{"training.precision": "bf16",
                                                                  "training.train_steps": 2,
                                                                  "training.eval_interval": 2}),
                            ends_cleanly=True)
        assert f"one gradient norm over DeepSpeed's parameters and the tables ({optimizer}'s, widened)" in proc.stdout
        assert not [line for line in proc.stdout.splitlines() if line.startswith(("MA ", "CPU Virtual Memory"))]
        norms[optimizer] = grad_norms(save)
        assert len(norms[optimizer]) == 2 and min(norms[optimizer]) > CLIP, norms
        moments[optimizer] = table_moments(save, step=2)
    expected = moments.pop("DeepSpeedZeroOptimizer")
    for optimizer, got in moments.items():  # the reported norms are the joint one, as ZeRO-2's
        assert norms[optimizer] == pytest.approx(norms["DeepSpeedZeroOptimizer"], rel=1e-3), norms
        for name, values in expected.items():
            torch.testing.assert_close(got[name], values, rtol=1e-3, atol=1e-3 * float(values.abs().max()),
                                       msg=f"{optimizer}: {name}")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["zero", "rows"])
def test_deepspeed_checkpoints_convert_to_the_megatron_run_model(megatron_run, zero3, rows3, tmp_path, mode):
    """fe-convert deepspeed-to-hf of step 4 gives the logits of fe-convert mcore-to-hf of the
    Megatron engine's step 4 (the two trainings agree)."""
    from fe_megatron.convert.deepspeed_to_hf import deepspeed_to_hf
    from fe_megatron.hf import FactorEngramForCausalLM
    from fe_megatron.convert.to_hf import mcore_to_hf

    source = zero3 if mode == "zero" else rows3
    ours = deepspeed_to_hf(source, str(tmp_path / "from_deepspeed"))
    theirs = mcore_to_hf(megatron_run, str(tmp_path / "from_megatron"))
    ids = torch.randint(0, 512, (2, 48))
    with torch.no_grad():
        got = FactorEngramForCausalLM.from_pretrained(ours).eval()(input_ids=ids).logits
        expected = FactorEngramForCausalLM.from_pretrained(theirs).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # fe-eval and fe-inspect read the DeepSpeed run itself, as fe-convert does
    from fe_megatron.evaluation.model import EvalModel

    with torch.no_grad():
        torch.testing.assert_close(EvalModel.load(source).model(input_ids=ids).logits, got, rtol=0, atol=0)
    # hf-to-mcore carries the DeepSpeed run's settings into a config the Megatron engine accepts
    from fe_megatron.convert.to_mcore import hf_to_mcore

    carried = load_train_config(os.path.join(hf_to_mcore(ours, str(tmp_path / "back")), "train.yaml"))
    assert carried.training.engine == "megatron" and carried.deepspeed is None
    assert carried.parallel.table_sharding == ("rows" if mode == "rows" else "replicated")
    with pytest.raises(ValueError, match="Megatron engine"):
        deepspeed_to_hf(os.path.join(megatron_run, "iter_0000004"), str(tmp_path / "wrong"))
    # and the other way round: not "damaged", but a DeepSpeed run, with the command that converts it
    with pytest.raises(ValueError, match="is a run of the DeepSpeed engine .*use fe-convert deepspeed-to-hf"):
        mcore_to_hf(source, str(tmp_path / "wrong"))


@pytest.mark.distributed
def test_the_host_tier_trains_as_the_device_tier(start, rows3):
    """Row-sharded tables in host memory, each microbatch's rows fetched one microbatch ahead: the
    curve of the same tables on the device."""
    save = deepspeed_run(start, "rows3_host", 3, **dict(ROWS, **{"memory.table_placement": "host"}))
    assert_same_curve(losses(save), losses(rows3), rel=1e-6)


@pytest.mark.distributed
def test_bf16_tables_train_checkpoint_resume_and_convert(start, rows3, rows3_bf16, tmp_path):
    """memory.table_dtype=bf16 under rows: the curve of the fp32 tables' run to bf16 rounding, bf16
    rows with fp32 moments on disk, an exact resume (the rounding's random bits are a function of
    the step), and a conversion that keeps the trained format."""
    from fe_megatron.convert.deepspeed_to_hf import deepspeed_to_hf
    from fe_megatron.hf import FactorEngramForCausalLM

    bf16, save = BF16_ROWS, rows3_bf16
    assert_same_curve(losses(save), losses(rows3), rel=1e-3)
    from fe_megatron.convert.megatron_reader import DistCheckpoint

    tables = DistCheckpoint(os.path.join(save, "iter_0000004", "fe_tables"))
    assert {tables.dtype(name) for name in tables.weight_names()} == {torch.bfloat16}
    assert {tables.dtype(f"optimizer.state.{key}.{name}") for name in tables.weight_names()
            for key in ("exp_avg", "exp_avg_sq")} == {torch.float32}
    half = str(start["base"] / "rows3_bf16_resumed")
    step_2_alone(save, half)
    run_pretrain(["--config", CONFIG, "--load", half, "--save", half, DS, "deepspeed={zero_optimization: {stage: 3}}"]
                 + overrides(start["data"], **bf16), nproc=2, ends_cleanly=True)
    assert losses(half) == losses(save)[2:]
    hf = deepspeed_to_hf(save, str(tmp_path / "hf"))
    model = FactorEngramForCausalLM.from_pretrained(hf).eval()
    assert model.config.memory["table_dtype"] == "bf16"
    assert model.model.layers[1].memory.tables.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.randint(0, 512, (1, 32))).logits).all()


@pytest.mark.distributed
def test_whole_bf16_tables_outside_zero_round_as_row_sharded_ones(start, rows3_bf16, tmp_path):
    """table_sharding=replicated with bf16 tables: whole tables on both ranks, outside ZeRO, their
    gradients all-reduced.  The rounding depends on each element's global coordinates only, so the
    curve is the row-sharded run's; rank 0 alone writes the tables, which convert as trained; and the
    row-sharded run's checkpoint resumes with whole tables."""
    from fe_megatron.convert.deepspeed_to_hf import deepspeed_to_hf
    from fe_megatron.hf import FactorEngramForCausalLM

    save = deepspeed_run(start, "whole3_bf16", 3, **dict(BF16_ROWS, **{"parallel.table_sharding": "replicated"}))
    assert_same_curve(losses(save), losses(rows3_bf16), rel=1e-5)
    from fe_megatron.convert.megatron_reader import DistCheckpoint

    storage = DistCheckpoint(os.path.join(save, "iter_0000004", "fe_tables")).reader.read_metadata().storage_data
    assert {info.relative_path[:4] for index, info in storage.items() if "memory.tables" in index.fqn} == {"__0_"}
    # the tables' checkpoint is by global row: whole tables resume the row-sharded run's step 2 and go on
    # as the whole tables' own run did
    whole = dict(BF16_ROWS, **{"parallel.table_sharding": "replicated"})
    half = str(start["base"] / "rows3_bf16_resumed_whole")
    step_2_alone(rows3_bf16, half)
    run_pretrain(["--config", CONFIG, "--load", half, "--save", half, DS, "deepspeed={zero_optimization: {stage: 3}}"]
                 + overrides(start["data"], **whole), nproc=2, ends_cleanly=True)
    assert_same_curve(losses(half), losses(save)[2:], rel=1e-5)
    ours, theirs = (FactorEngramForCausalLM.from_pretrained(deepspeed_to_hf(run, str(tmp_path / name))).eval()
                    for name, run in (("whole", save), ("rows", rows3_bf16)))
    ids = torch.randint(0, 512, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-3, atol=1e-3)


@pytest.mark.distributed
def test_deepspeed_checkpoints_are_committed_and_verified_like_megatrons(start, zero3):
    """The DeepSpeed engine's checkpoints get the same tracker, manifest and verification as the
    Megatron engine's (DeepSpeed's own ``latest`` is kept for its tools)."""
    from fe_megatron.checkpoint.files import TRACKER, read_manifest

    with open(os.path.join(zero3, TRACKER)) as fh, open(os.path.join(zero3, "latest")) as latest:
        assert fh.read() == "4" and latest.read() == "iter_0000004"
    folder = os.path.join(zero3, "iter_0000004")
    manifest = read_manifest(folder)
    assert "fe_run.json" in manifest["files"] and any(name.endswith("model_states.pt") for name in manifest["files"])
    assert not [name for name in os.listdir(zero3) if name.endswith(".tmp")]
    damaged = str(start["base"] / "zero3_damaged")
    shutil.copytree(zero3, damaged)
    victim = sorted(name for name in manifest["files"] if name.endswith(".pt"))[0]
    with open(os.path.join(damaged, "iter_0000004", victim), "r+b") as fh:
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    proc = run_pretrain(["--config", CONFIG, "--load", damaged, "--save", damaged, DS,
                         "deepspeed={zero_optimization: {stage: 3}}"] + overrides(start["data"]), nproc=2, check=False)
    assert proc.returncode != 0 and "loaded the weights" not in proc.stdout
    assert f"{victim}: its sha256 differs from the manifest's" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.distributed
def test_a_sparse_table_update_trains_alike_in_both_engines_and_resumes_on_fewer_ranks(start, megatron_run):
    """optimizer.table_update=rowwise_adagrad with row-sharded tables: the DeepSpeed engine (ZeRO-3,
    the tables outside it) follows the Megatron engine's curve from the same weights (clipped by one
    norm in both, as test_rows_mode_matches_the_megatron_engine_with_clipping), its step-2
    checkpoint (the row-wise state in the tables' files) resumes on one rank, and a change to
    another rule is refused by name."""
    sparse = dict(ROWS, **{"optimizer.table_update": "rowwise_adagrad"})
    megatron = str(start["base"] / "megatron_rowwise")
    proc = run_pretrain(["--config", CONFIG, "--load", start["mcore"], "--save", megatron]
                        + overrides(start["data"], **sparse), nproc=2, ends_cleanly=True)
    assert "updated by rowwise_adagrad (touched rows only)" in proc.stdout
    assert losses(megatron) != losses(megatron_run)  # another rule: another curve
    save = deepspeed_run(start, "rows3_rowwise", 3, **sparse)
    assert_same_curve(losses(save), losses(megatron))
    half = str(start["base"] / "rowwise_on_one_rank")
    step_2_alone(save, half)
    run_pretrain(["--config", CONFIG, "--load", half, "--save", half, DS, "deepspeed={zero_optimization: {stage: 3}}"]
                 + overrides(start["data"], **sparse), nproc=1, ends_cleanly=True)
    assert_same_curve(losses(half), losses(save)[2:])
    refused = run_pretrain(["--config", CONFIG, "--load", half, "--save", half, DS,
                            "deepspeed={zero_optimization: {stage: 3}}"]
                           + overrides(start["data"], **dict(sparse, **{"optimizer.table_update": "lazy_adam",
                                                                        "training.train_steps": 6})), check=False)
    assert refused.returncode != 0
    assert "optimizer.table_update is 'rowwise_adagrad' in the checkpoint and 'lazy_adam' now" in refused.stderr
