"""``fe-convert deepspeed-to-hf``: a checkpoint of the DeepSpeed engine -> a transformers directory.

The fp32 weights are consolidated the way DeepSpeed's ``zero_to_fp32`` does it, in its lazy mode
(the ZeRO partitions are memory-mapped and each tensor is assembled only when its turn comes to
be written); tables kept outside ZeRO are read from their ``tables_rank_NNNNN.pt`` files (row-sharded
ones assembled from every rank's).  Tensors stream into safetensors shards one at a time.
"""

from __future__ import annotations

import glob
import os
from typing import Optional

import torch

from fe_megatron.checkpoint.files import read_run_info
from fe_megatron.checkpoint.reader import configs_of
from fe_megatron.convert.common import ConversionError, find_run_checkpoint, run_tokenizer, training_settings
from fe_megatron.convert.to_hf import write_hf_directory


class _DeepSpeedWeights:
    """The consolidated fp32 tensors of one checkpoint folder, by Hugging Face name."""

    def __init__(self, folder: str, info: dict, memory):
        from fe_megatron.deepspeed.tables import tables_file
        from fe_megatron.tables.plan import TablePlan

        layout = info["layout"]
        self.world = layout["world"]
        if layout.get("zero_stage", 0) == 0:
            state = torch.load(os.path.join(folder, "mp_rank_00_model_states.pt"), map_location="cpu", mmap=True,
                               weights_only=False)["module"]
        else:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(folder), os.path.basename(folder),
                                                             lazy_mode=True)
        self.state, self.memory, self._partitions = state, memory, {}
        self.table_files = []
        mode = TablePlan.saved_mode(info)
        if mode not in (None, "zero") and memory is not None:  # the tables were outside ZeRO, in their own files
            ranks = self.world if mode == "rows" else 1  # whole tables: rank 0's file
            self.table_files = [tables_file(folder, rank) for rank in range(ranks)]
            missing = [path for path in self.table_files if not os.path.isfile(path)]
            if missing:
                found = sorted(glob.glob(os.path.join(folder, "tables_rank_*.pt")))
                raise ConversionError(f"{folder}: the run kept its tables outside ZeRO in {ranks} file(s), but "
                                      f"{missing[0]} is missing (found {len(found)} table files)")
            self.table_shards = [torch.load(path, map_location="cpu", mmap=True, weights_only=False)["tables"]
                                 for path in self.table_files]

    def names(self) -> list:
        names = [name for name in self.state if not name.endswith("rotary_emb.inv_freq")]
        if self.table_files:
            names += list(self.table_shards[0])
        return names

    def shape(self, name: str) -> tuple:
        if self.table_files and name in self.table_shards[0]:
            return (sum(self._partition(name).branch_rows), self.table_shards[0][name].shape[1])
        return tuple(self.state[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        """fp32, or a trained table's own dtype (bf16 tables stay bf16: ``memory.table_dtype``)."""
        if self.table_files and name in self.table_shards[0]:
            return self.table_shards[0][name].dtype
        return torch.float32

    def get(self, name: str) -> torch.Tensor:
        if self.table_files and name in self.table_shards[0]:
            return self._partition(name).assemble([shards[name] for shards in self.table_shards])
        tensor = self.state[name]
        return (tensor.contiguous() if not isinstance(tensor, torch.Tensor) else tensor).float()

    def _partition(self, name: str):
        """The row partition of table ``name`` (its layer's hashing layout, at the run's ranks)."""
        from fe_megatron.tables.row_exchange import RowPartition
        from fe_megatron.ngram import NgramHasher

        if name not in self._partitions:
            layer = int(name.split(".layers.")[1].split(".")[0])
            layout = NgramHasher(self.memory, layer).layouts[0]
            self._partitions[name] = RowPartition(layout.moduli, layout.offsets, len(self.table_shards), 0)
        return self._partitions[name]


def deepspeed_to_hf(load: str, output: str, tag: Optional[str] = None, tokenizer: Optional[str] = None,
                    max_shard_bytes: int = 2 << 30, table_dtype: Optional[str] = None) -> str:
    """Convert the DeepSpeed engine's checkpoint in ``load`` into a transformers directory ``output``."""
    folder = find_run_checkpoint(load, _iteration_of(tag), engine="deepspeed")
    info = read_run_info(folder)
    backbone, memory = configs_of(info)
    tokenizer_path = run_tokenizer(info, tokenizer)
    weights = _DeepSpeedWeights(folder, info, memory)
    tied = backbone.tie_embeddings
    groups = [(name, [(name, weights.shape(name), weights.dtype(name))]) for name in weights.names()
              if not (tied and name == "lm_head.weight")]
    return write_hf_directory(output, backbone, memory, tokenizer_path, groups,
                              lambda name: [(name, weights.get(name))], f"deepspeed-to-hf {folder}",
                              max_shard_bytes, table_dtype, training_settings(info, folder))


def _iteration_of(tag: Optional[str]) -> Optional[int]:
    """The iteration of a ``--tag`` such as ``iter_0000100``."""
    if tag is None:
        return None
    digits = tag[len("iter_"):] if tag.startswith("iter_") else ""
    if not digits.isdigit():
        raise ConversionError(f"--tag {tag!r}: expected iter_NNNNNNN, the name of one of the run's checkpoint folders")
    return int(digits)
