"""`fe_megatron.hybrid_pattern`: a hybrid layer pattern's memory layers, pipeline stages and GPT
names, on any stack (plain Python)."""

import pytest

from fe_megatron.hybrid_pattern import (gpt_name_of, hybrid_name_of, is_gpt_shaped, memory_blocks_of_layers,
                                                 memory_positions, pipeline_segments, stages_without_memory)


def test_layer_numbers_are_positions_in_the_pattern_and_blocks_count_its_attention_layers():
    assert memory_positions("*-|*-*-", [1, 2]) == {2: 1, 4: 2}  # '|' (a pipeline split) is no layer
    assert memory_blocks_of_layers("*-E*-*", [3, 5]) == [1, 2]
    assert memory_blocks_of_layers("*-*-", [2, 0]) == [0, 1]
    with pytest.raises(ValueError, match=r"memory layers \[3\] .* has 3 attention \('\*'\) layers"):
        memory_positions("*-*-*-", [0, 3])
    with pytest.raises(ValueError) as refused:
        memory_blocks_of_layers("*-+-M*", [1, 2, 4, 9])
    message = str(refused.value)
    assert "--fe-memory-layers 1 2 4 9 with --hybrid-layer-pattern '*-+-M*'" in message
    assert "layer 1 is '-' (MLP): the memory goes before the attention of an attention layer" in message
    assert "layer 2 is '+' (MLA): memory before MLA attention is not supported yet" in message
    assert "layer 4 is 'M' (Mamba)" in message and "9 is not a layer of it (0 to 5)" in message
    assert "Its attention ('*') layers are [0, 5]" in message


def test_pipeline_stages_split_as_megatron_core_splits_them():
    assert pipeline_segments("*-*-|*-*-", 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert pipeline_segments("*-*-*-", 3) == [[0, 1], [2, 3], [4, 5]]
    assert pipeline_segments("*-*-*-*-", 3, first=2, last=2) == [[0, 1], [2, 3, 4, 5], [6, 7]]
    assert stages_without_memory("*-*-|*-*-", [2, 3], 2) == {0}
    assert stages_without_memory("*-*-*-*-", [0, 3], 2) == set()
    with pytest.raises(ValueError, match="has 3 pipeline segments for --pipeline-model-parallel-size 2"):
        pipeline_segments("*-|*-|*-", 2)
    with pytest.raises(ValueError, match="does not split evenly over 4 pipeline stages"):
        pipeline_segments("*-*-*-", 4)


def test_a_pattern_of_pairs_names_the_gpt_model_s_parameters_both_ways():
    pattern = "*-*-|*-"
    assert is_gpt_shaped(pattern) and not is_gpt_shaped("*-E-") and not is_gpt_shaped("*--*")
    pairs = {"decoder.layers.4.self_attention.linear_qkv.weight": "decoder.layers.2.self_attention.linear_qkv.weight",
             "decoder.layers.2.memory.tables.weight": "decoder.layers.1.memory.tables.weight",
             "decoder.layers.3.mlp.linear_fc2.weight": "decoder.layers.1.mlp.linear_fc2.weight",
             "decoder.layers.1.pre_mlp_layernorm.weight": "decoder.layers.0.pre_mlp_layernorm.weight",
             "decoder.final_norm.weight": "decoder.final_layernorm.weight",
             "embedding.word_embeddings.weight": "embedding.word_embeddings.weight"}
    for hybrid, gpt in pairs.items():
        assert gpt_name_of(hybrid, pattern) == gpt and hybrid_name_of(gpt, pattern) == hybrid
    with pytest.raises(ValueError, match=r"layer 2 is an attention layer \('\*'\), which holds no mlp.linear_fc1"):
        gpt_name_of("decoder.layers.2.mlp.linear_fc1.weight", "*-*-")
