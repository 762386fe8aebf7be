"""Reading a Megatron-engine checkpoint for conversion and evaluation: its tensors one global
tensor at a time, under Hugging Face names (a torch_dist checkpoint stores each tensor whole, by global name, whatever the
TP/PP/DP layout that wrote it)."""

from __future__ import annotations

import os
import pickle
import re
import warnings

import torch

from fe_megatron.config import BackboneConfig
from fe_megatron.convert.common import ConversionError
from fe_megatron.hf import weights


_STACKED_LAYERS = re.compile(r"^decoder\.layers\.([a-z_].*)$")


def _one_layer_name(name: str) -> str:
    """Megatron stores the layers of a model whose layers are all alike stacked under one key,
    ``decoder.layers.<weight>`` with a leading layer axis (memory models are stored layer by layer)."""
    match = _STACKED_LAYERS.match(name)
    return f"decoder.layers.0.{match.group(1)}" if match else name


def split_checkpoint_tensor(name: str, tensor: torch.Tensor, backbone: BackboneConfig) -> list:
    """``[(hf_name, tensor)]`` of one checkpoint tensor, stacked layers included."""
    match = _STACKED_LAYERS.match(name)
    if not match:
        return weights.split(name, tensor, backbone)
    return [part for layer in range(tensor.shape[0])
            for part in weights.split(f"decoder.layers.{layer}.{match.group(1)}", tensor[layer], backbone)]


def model_weights(folder: str, names: list, writer: str) -> list:
    """The model weights among a checkpoint's tensor ``names`` (no extra state); a tensor that is no
    weight of fe_megatron's GPT model is refused (``writer``: the tool whose checkpoints these are)."""
    kept = []
    for name in names:
        if not weights.is_weight(name):
            continue
        if weights.hf_names(_one_layer_name(name)) is None:
            raise ConversionError(f"{folder}: tensor {name!r} is not a weight of fe_megatron's GPT model; "
                                  f"this checkpoint was not written by {writer}")
        kept.append(name)
    return kept


# An optimizer's state: "optimizer.", or "chained_<i>.optimizer." where Megatron prefixes each member of
# its chain (megatron-core 0.19 does for the distributed optimizer's dp_reshardable format)
OPTIMIZER_STATE = re.compile(r"(chained_\d+\.)?optimizer\.")


class DistCheckpoint:
    """A Megatron distributed checkpoint (torch_dist format) read one global tensor at a time."""

    gpt_named = frozenset()  # its tensors are under the model's own names (a HybridModel's are its layers')

    def __init__(self, folder: str):
        import torch.distributed.checkpoint as dcp

        self.folder = folder
        self.reader = dcp.FileSystemReader(folder)
        try:
            self.metadata = self.reader.read_metadata().state_dict_metadata
        except (ValueError, TypeError, AttributeError, EOFError, ImportError, pickle.UnpicklingError) as error:
            # a pickle of another torch release
            from fe_megatron.checkpoint.files import read_run_info

            stack = (read_run_info(folder) or {}).get("stack") or {}
            writer = f"torch {stack['torch']}" if stack.get("torch") else "another torch release"
            raise ConversionError(f"{folder}: torch {torch.__version__} cannot read this checkpoint's metadata "
                                  f"({error}); it was written by {writer}. Convert it with the release that wrote "
                                  "it (docs/compatibility.md)") from error

    def stored_names(self) -> list:
        """The tensors the checkpoint holds besides optimizer state, under the names the model gave them."""
        return [name for name, meta in self.metadata.items()
                if not OPTIMIZER_STATE.match(name) and hasattr(meta, "size")]

    def weight_names(self) -> list:
        """The model's weights in the checkpoint (no optimizer state, no extra state)."""
        return model_weights(self.folder, self.stored_names(), "fe-pretrain")

    def shape(self, name: str) -> tuple:
        return tuple(self.metadata[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self.metadata[name].properties.dtype

    def load(self, name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        tensor = torch.empty(self.shape(name), dtype=self.dtype(name))
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({name: tensor}, storage_reader=self.reader, no_dist=True)
        return tensor


def tables_beside(folder: str):
    """The tables a checkpoint folder holds beside its engine's own files, in ``fe_tables/`` (the one table
    writer's, `fe_megatron.megatron.table_checkpoint`: the DeepSpeed engine's tables outside ZeRO, and
    Megatron-FSDP's tables), as a `DistCheckpoint` under the Megatron engine's names; None: no ``fe_tables/``.
    Every converter and reader opens ``fe_tables/`` here; a folder it cannot read is refused by
    `DistCheckpoint`, naming it."""
    from fe_megatron.checkpoint.files import TABLES_BESIDE

    tables = os.path.join(folder, TABLES_BESIDE)
    return DistCheckpoint(tables) if os.path.isdir(tables) else None


# a Megatron-FSDP checkpoint's model tensors: "model." and its wrappers' "module." before each name
_FSDP_MODEL_TENSOR = re.compile(r"^model\.(module\.)+")
# SwiGLU's fc1, which Megatron-FSDP's checkpoint keeps as two halves (gate "_w", up "_v") so that each
# half reshards across tensor-parallel sizes on its own
_SWIGLU_HALF = re.compile(r"^(.*\.linear_fc1\.(weight|bias))_([wv])$")


class FsdpDtensorCheckpoint:
    """A Megatron-FSDP checkpoint (``--ckpt-format fsdp_dtensor``) read one global tensor at a time, with
    `DistCheckpoint`'s methods and names: its DTensors under ``model.module.<name>``, SwiGLU's
    ``linear_fc1`` as the halves ``<name>_w`` and ``<name>_v`` (joined here in that order, Megatron's
    layout at one tensor-parallel rank), and the tables in stores beside it, in ``fe_tables/``
    (`tables_beside`)."""

    def __init__(self, folder: str, model: DistCheckpoint = None):
        self.folder = folder
        self.model = DistCheckpoint(folder) if model is None else model
        self.tables = tables_beside(folder)
        self.sources = {}  # {name: (checkpoint, [stored names, concatenated along dim 0])}
        for stored, meta in self.model.metadata.items():
            if not _FSDP_MODEL_TENSOR.match(stored) or not hasattr(meta, "size"):
                continue
            name = _FSDP_MODEL_TENSOR.sub("", stored)
            half = _SWIGLU_HALF.match(name)
            if half:
                name = half.group(1)
                halves = self.sources.setdefault(name, (self.model, {}))[1]
                halves[half.group(3)] = stored
            else:
                self.sources[name] = (self.model, {"": stored})
        for name, (_, parts) in self.sources.items():
            if set(parts) not in ({""}, {"w", "v"}):
                raise ConversionError(f"{folder}: {name} is stored as {sorted(parts)}; a Megatron-FSDP checkpoint "
                                      "keeps SwiGLU's fc1 as the halves _w and _v")
        # fe_tables/ names every model's tables as the GPT model's (by memory block, `table_shards.table_name`)
        self.gpt_named = frozenset(self.tables.weight_names() if self.tables is not None else ())
        for name in self.gpt_named:
            self.sources[name] = (self.tables, {"": name})

    def _stored(self, name: str) -> tuple:
        checkpoint, parts = self.sources[name]
        return checkpoint, [parts[key] for key in ("", "w", "v") if key in parts]

    def stored_names(self) -> list:
        """The model's tensors (fc1 joined) and the tables beside them, under the names the model gave them."""
        return list(self.sources)

    def weight_names(self) -> list:
        return model_weights(self.folder, self.stored_names(), "fe_megatron")

    def shape(self, name: str) -> tuple:
        checkpoint, stored = self._stored(name)
        shapes = [checkpoint.shape(part) for part in stored]
        return (sum(shape[0] for shape in shapes),) + shapes[0][1:]

    def dtype(self, name: str) -> torch.dtype:
        checkpoint, stored = self._stored(name)
        return checkpoint.dtype(stored[0])

    def load(self, name: str) -> torch.Tensor:
        checkpoint, stored = self._stored(name)
        return torch.cat([checkpoint.load(part) for part in stored]) if len(stored) > 1 else checkpoint.load(stored[0])


class HybridAsGpt:
    """A HybridModel checkpoint whose ``hybrid_layer_pattern`` is made of ``*-`` pairs, read through ``source``
    (its format's reader: `DistCheckpoint` for torch_dist, `FsdpDtensorCheckpoint` for Megatron-FSDP's, with the
    tables beside it) under the GPT model's names (`fe_megatron.hybrid_pattern`): layers ``2i`` and ``2i+1``
    are GPT layer ``i``. Other patterns have no GPT (Hugging Face) form and are refused by name."""

    def __init__(self, folder: str, pattern: str, source):
        from fe_megatron.hybrid_pattern import gpt_name_of, is_gpt_shaped

        if not is_gpt_shaped(pattern.split("/")[0]):
            raise ConversionError(f"{folder}: a hybrid model with --hybrid-layer-pattern {pattern!r}; only patterns "
                                  "of '*-' pairs (attention then MLP: the Llama layer) have a Hugging Face form")
        self.folder = folder
        self.checkpoint = source
        self.stored = {}  # {GPT name: stored name}
        for name in source.stored_names():
            if not weights.is_weight(name):
                continue
            if name in source.gpt_named:  # the tables beside the model (fe_tables/): by memory block already
                self.stored[name] = name
                continue
            try:
                self.stored[gpt_name_of(name, pattern)] = name
            except ValueError as error:
                raise ConversionError(f"{folder}: {error}; this checkpoint is not the hybrid model its run info "
                                      f"names (pattern {pattern!r})") from None

    def weight_names(self) -> list:
        return model_weights(self.folder, list(self.stored), "fe_megatron.megatron_lm.pretrain_hybrid")

    def shape(self, name: str) -> tuple:
        return self.checkpoint.shape(self.stored[name])

    def dtype(self, name: str) -> torch.dtype:
        return self.checkpoint.dtype(self.stored[name])

    def load(self, name: str) -> torch.Tensor:
        return self.checkpoint.load(self.stored[name])


def open_checkpoint(folder: str):
    """The reader of a Megatron-engine checkpoint folder: `FsdpDtensorCheckpoint` for Megatron-FSDP's
    format, else `DistCheckpoint` (torch_dist); a HybridModel's (its run info names a ``hybrid_layer_pattern``)
    through `HybridAsGpt` over either."""
    from fe_megatron.checkpoint.files import read_run_info

    info = read_run_info(folder) or {}
    # a Megatron-LM run's pattern (pretrain_hybrid), or an fe-pretrain run's model section's
    pattern = info.get("hybrid_layer_pattern") or ((info.get("config") or {}).get("model") or {}).get(
        "hybrid_layer_pattern")
    checkpoint = DistCheckpoint(folder)
    if any(_FSDP_MODEL_TENSOR.match(name) for name in checkpoint.metadata):
        checkpoint = FsdpDtensorCheckpoint(folder, checkpoint)
    return HybridAsGpt(folder, pattern, checkpoint) if pattern else checkpoint
