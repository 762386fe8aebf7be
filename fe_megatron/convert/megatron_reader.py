"""Reading a Megatron-engine checkpoint for conversion and evaluation: its tensors one global
tensor at a time, under Hugging Face names (a torch_dist checkpoint stores each tensor whole, by global name, whatever the
TP/PP/DP layout that wrote it)."""

from __future__ import annotations

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


# An optimizer's state: "optimizer.", or "chained_<i>.optimizer." where Megatron prefixes each member of
# its chain (megatron-core 0.19 does for the distributed optimizer's dp_reshardable format)
OPTIMIZER_STATE = re.compile(r"(chained_\d+\.)?optimizer\.")


class DistCheckpoint:
    """A Megatron distributed checkpoint (torch_dist format) read one global tensor at a time."""

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

    def weight_names(self) -> list:
        """The model's weights in the checkpoint (no optimizer state, no extra state)."""
        names = []
        for name, meta in self.metadata.items():
            if OPTIMIZER_STATE.match(name) or not hasattr(meta, "size") or not weights.is_weight(name):
                continue
            if weights.hf_names(_one_layer_name(name)) is None:
                raise ConversionError(f"{self.folder}: tensor {name!r} is not a weight of fe_megatron's GPT model; "
                                      "this checkpoint was not written by fe-pretrain")
            names.append(name)
        return names

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

