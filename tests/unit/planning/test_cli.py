"""fe-plan (`fe_megatron.planning.cli`) in the test process: an MoE backbone's experts counted, and no per-rank
estimate made for it. fe-plan as a user runs it (its last line, per-rank memory, where each choice stops
fitting, the training config's layout and storage, activations and checkpoints, and the dtypes it counts in)
is tests/integration/test_commands.py's."""

from fe_megatron.config import MemoryConfig
from fe_megatron.planning.budget import total_params


def test_fe_plan_counts_an_moe_backbone_s_experts_and_makes_no_per_rank_estimate_for_it(tmp_path, capsys):
    from fe_megatron.planning.budget import layer_params
    from fe_megatron.planning.cli import main

    dense, moe = (MemoryConfig.from_dict({"preset": "factorengram-tiny"}, backbone={"preset": "tiny", "num_experts": n})
                  for n in (0, 4))
    d, f = moe.hidden_size, moe.ffn_hidden_size
    assert layer_params(moe) - layer_params(dense) == 3 * 3 * d * f + 4 * d  # three more experts and the router
    path = tmp_path / "moe.yaml"
    path.write_text("model:\n  preset: tiny\n  num_experts: 4\nmemory:\n  preset: factorengram-tiny\n"
                    "data:\n  tokenizer_model: t.model\n  train_data: [corpus]\n")
    assert main(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "per-rank estimates: not made for an MoE backbone (model.num_experts=4" in out
    assert out.strip().splitlines()[-1] == f"total_params={total_params(moe)}"
