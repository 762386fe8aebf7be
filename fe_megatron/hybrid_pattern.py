"""What a ``hybrid_layer_pattern`` (megatron-core's HybridModel, 0.19 on) says about the memory, in plain
Python: which layers the memory sits before, which pipeline stages hold none, and how a pattern of ``*-``
pairs names the GPT model's parameters. Needs no megatron-core, so that a converter or a check can read
a hybrid run on any stack.

A pattern has one symbol per layer (``*`` attention, ``-`` MLP, ``E`` MoE, ``+`` MLA, ``D`` DSA, ``M``
Mamba, ``G`` Gated DeltaNet) and ``|`` between pipeline segments, which counts no layer.

Two numberings. A *layer number* is a 0-based position in the pattern without its ``|``: what a user
reads off the pattern, and what ``--fe-memory-layers`` takes for a hybrid model. A *block* is what
`MemoryConfig.layers` counts, as in the paper ("layers 10 and 12 of 24") and in the GPT model: block ``i``
is the pattern's ``i``-th attention (``*``) layer. The memory of block ``i`` sits before that layer's
attention and hashes as block ``i`` of the GPT model does, so a pattern of ``*-`` pairs is the GPT model
with memory, parameter for parameter (`gpt_name_of`).
"""

from __future__ import annotations

import re

PIPE = "|"
ATTENTION, MLP, MOE = "*", "-", "E"
KINDS = {ATTENTION: "attention", MLP: "MLP", MOE: "MoE", "M": "Mamba", "G": "Gated DeltaNet", "+": "MLA",
         "D": "DSA"}


def layers_of(pattern: str) -> str:
    """The pattern's layer symbols, without its pipeline splits."""
    return pattern.replace(PIPE, "")


def attention_layers(pattern: str) -> list:
    """The layer numbers of the pattern's attention (``*``) layers: block ``i`` is the ``i``-th."""
    return [number for number, symbol in enumerate(layers_of(pattern)) if symbol == ATTENTION]


def memory_positions(pattern: str, memory_layers) -> dict:
    """``{layer number: memory layer index}``: block ``i`` of ``memory_layers`` before the ``i``-th attention
    layer of ``pattern``."""
    attention = attention_layers(pattern)
    beyond = [index for index in memory_layers if index >= len(attention)]
    if beyond:
        raise ValueError(f"memory layers {beyond} (transformer blocks, 0-based): hybrid_layer_pattern {pattern!r} has "
                         f"{len(attention)} attention ('*') layers, so blocks 0 to {len(attention) - 1}")
    return {attention[index]: index for index in memory_layers}


def memory_blocks_of_layers(pattern: str, layer_numbers, flag: str = "--fe-memory-layers") -> list:
    """The blocks (`MemoryConfig.layers`) of the hybrid layer numbers ``layer_numbers``, each of which must be
    an attention (``*``) layer of ``pattern``; anything else is refused by name (``flag``: the setting that
    gave them)."""
    layers = layers_of(pattern)
    attention = attention_layers(pattern)
    problems = []
    for number in layer_numbers:
        if not 0 <= number < len(layers):
            problems.append(f"{number} is not a layer of it (0 to {len(layers) - 1})")
        elif layers[number] != ATTENTION:
            symbol = layers[number]
            kind = KINDS.get(symbol, "unknown")
            why = ("memory before MLA attention is not supported yet (megatron-core 0.19 builds MLA from Transformer "
                   "Engine's attention only: its local DotProductAttention takes no k_channels or v_channels, so "
                   "it could not be tested on a CPU); use a '*' layer" if symbol == "+" else
                   "the memory goes before the attention of an attention layer")
            problems.append(f"layer {number} is {symbol!r} ({kind}): {why}")
    if problems:
        raise ValueError(f"{flag} {' '.join(str(n) for n in layer_numbers)} with --hybrid-layer-pattern {pattern!r}: "
                         f"{'; '.join(problems)}. Its attention ('*') layers are {attention}")
    return sorted(attention.index(number) for number in layer_numbers)


def pipeline_segments(pattern: str, pipeline: int, first: int = None, last: int = None,
                      pipeline_flag: str = "--pipeline-model-parallel-size") -> list:
    """Each pipeline stage's layer numbers, as megatron-core's ``select_pipeline_segment`` splits the pattern:
    at its ``|`` (one segment per stage), else evenly, or with ``first``/``last`` layers on the first and last
    stages (``--decoder-first/last-pipeline-num-layers``)."""
    if PIPE in pattern:
        segments, start = [], 0
        for segment in pattern.split(PIPE):
            segments.append(list(range(start, start + len(segment))))
            start += len(segment)
        if len(segments) != pipeline:
            raise ValueError(f"hybrid_layer_pattern {pattern!r} has {len(segments)} pipeline segments for "
                             f"{pipeline_flag} {pipeline}: give one segment per stage")
        return segments
    total = len(pattern)
    counts = [0] * pipeline
    rest_stages = list(range(pipeline))
    remaining = total
    if first is not None and pipeline > 1:
        counts[0], remaining = first, remaining - first
        rest_stages.remove(0)
    if last is not None and pipeline > 1:
        counts[-1], remaining = last, remaining - last
        rest_stages.remove(pipeline - 1)
    for stage in rest_stages:
        counts[stage] = remaining // len(rest_stages)
    if sum(counts) != total:
        raise ValueError(f"hybrid_layer_pattern {pattern!r} ({total} layers) does not split evenly over "
                         f"{pipeline} pipeline stages: put '|' between the stages' segments")
    segments, start = [], 0
    for count in counts:
        segments.append(list(range(start, start + count)))
        start += count
    return segments


def stages_without_memory(pattern: str, memory_layers, pipeline: int, first: int = None, last: int = None) -> set:
    """The pipeline stages (ranks) whose segment of ``pattern`` holds none of the blocks ``memory_layers``."""
    positions = memory_positions(pattern, memory_layers)
    return {stage for stage, segment in enumerate(pipeline_segments(pattern, pipeline, first, last))
            if not any(number in positions for number in segment)}


def is_gpt_shaped(pattern: str) -> bool:
    """Whether ``pattern`` (pipeline splits aside) is made of ``*-`` pairs: the GPT (Llama) layer structure."""
    return re.fullmatch(r"(\*-)+", layers_of(pattern)) is not None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")  # a layer's tensor, in either model
# what each layer of a '*-' pair holds of a GPT layer (the memory: `fe_megatron.megatron.hybrid_model`)
_GPT_PARTS = {ATTENTION: ("input_layernorm.", "self_attention.", "memory."), MLP: ("pre_mlp_layernorm.", "mlp.")}


def _require_gpt_shaped(pattern: str) -> None:
    if not is_gpt_shaped(pattern):
        raise ValueError(f"hybrid_layer_pattern {pattern!r} is not made of '*-' pairs, the GPT layer structure")


def gpt_name_of(name: str, pattern: str) -> str:
    """The GPT model's name of the hybrid model's parameter or checkpoint tensor ``name`` when ``pattern`` is
    made of ``*-`` pairs (layers ``2i`` and ``2i+1`` are GPT layer ``i``; ``decoder.final_norm`` is
    ``decoder.final_layernorm``)."""
    _require_gpt_shaped(pattern)
    layers = layers_of(pattern)
    if name.startswith("decoder.final_norm."):
        return "decoder.final_layernorm." + name[len("decoder.final_norm."):]
    match = _LAYER.match(name)
    if not match:
        return name
    layer, rest = int(match.group(1)), match.group(2)
    if not rest.startswith(_GPT_PARTS[layers[layer]]):
        raise ValueError(f"{name}: layer {layer} is an {KINDS[layers[layer]]} layer ({layers[layer]!r}), "
                         f"which holds no {rest}")
    return f"decoder.layers.{layer // 2}.{rest}"


def hybrid_name_of(name: str, pattern: str) -> str:
    """The inverse of `gpt_name_of`: the hybrid model's name of the GPT model's ``name``."""
    _require_gpt_shaped(pattern)
    if name.startswith("decoder.final_layernorm."):
        return "decoder.final_norm." + name[len("decoder.final_layernorm."):]
    match = _LAYER.match(name)
    if not match:
        return name
    block, rest = int(match.group(1)), match.group(2)
    return f"decoder.layers.{2 * block + (0 if rest.startswith(_GPT_PARTS[ATTENTION]) else 1)}.{rest}"
