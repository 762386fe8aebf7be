"""``fe-convert deepspeed-to-hf``: a checkpoint of the DeepSpeed engine -> a transformers directory.

The fp32 weights are consolidated the way DeepSpeed's ``zero_to_fp32`` does it, in its lazy mode
(the ZeRO partitions are memory-mapped and each tensor is assembled only when its turn comes to
be written); tables kept outside ZeRO are read from ``fe_tables/`` (the one table writer's, by global
row, `fe_megatron.megatron.table_checkpoint`) through the reader of every engine's ``torch_dist`` tables
(`fe_megatron.convert.megatron_reader.tables_beside`, as for Megatron-FSDP), or from the
``tables_rank_NNNNN.pt`` files of a checkpoint written before it (row-sharded ones assembled from every
rank's).  Tables as ZeRO's parameters are in DeepSpeed's own files and consolidate with every other
parameter.  Tensors stream into safetensors shards one at a time.
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
from fe_megatron.hf import weights


class DeepSpeedWeights:
    """The consolidated fp32 tensors of one checkpoint folder, by Hugging Face name; tables kept
    outside ZeRO in their own dtype, from the tables' checkpoint (`table_reader`)."""

    def __init__(self, folder: str, info: dict, memory):
        layout = info["layout"]
        if layout.get("zero_stage", 0) == 0:
            state = torch.load(os.path.join(folder, "mp_rank_00_model_states.pt"), map_location="cpu", mmap=True,
                               weights_only=False)["module"]
        else:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(folder), os.path.basename(folder),
                                                             lazy_mode=True)
        self.state = state
        self.tables = table_reader(folder, info, memory)
        # {Hugging Face name: the tables' reader's name}
        self.table_names = {weights.hf_names(name)[0]: name for name in self.tables.weight_names()} \
            if self.tables is not None else {}

    def names(self) -> list:
        return [name for name in self.state if not name.endswith("rotary_emb.inv_freq")] + list(self.table_names)

    def shape(self, name: str) -> tuple:
        if name in self.table_names:
            return self.tables.shape(self.table_names[name])
        return tuple(self.state[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        """fp32, or a trained table's own dtype (bf16 tables stay bf16: ``memory.table_dtype``)."""
        if name in self.table_names:
            return self.tables.dtype(self.table_names[name])
        return torch.float32

    def get(self, name: str) -> torch.Tensor:
        if name in self.table_names:
            return self.tables.load(self.table_names[name])
        tensor = self.state[name]
        return (tensor.contiguous() if not isinstance(tensor, torch.Tensor) else tensor).float()


def table_reader(folder: str, info: dict, memory):
    """The reader of the tables a DeepSpeed run kept outside ZeRO (None: ZeRO held them, or no memory):
    its ``fe_tables/`` (`fe_megatron.convert.megatron_reader.tables_beside`, the one table writer's format),
    else, for a checkpoint written before it, `RankFileTables`."""
    from fe_megatron.convert.megatron_reader import tables_beside
    from fe_megatron.tables.plan import TablePlan

    if TablePlan.saved_mode(info) in (None, "zero") or memory is None:
        return None
    beside = tables_beside(folder)
    return beside if beside is not None else RankFileTables(folder, info, memory)


class RankFileTables:
    """The tables of a DeepSpeed checkpoint written before ``fe_tables/``: ``tables_rank_NNNNN.pt`` files
    (row-sharded ones assembled from every rank's, whole ones rank 0's), read with `DistCheckpoint`'s
    methods and names."""

    def __init__(self, folder: str, info: dict, memory):
        from fe_megatron.deepspeed.tables import tables_file
        from fe_megatron.tables.plan import TablePlan

        world = info["layout"]["world"]
        ranks = world if TablePlan.saved_mode(info) == "rows" else 1  # whole tables: rank 0's file
        files = [tables_file(folder, rank) for rank in range(ranks)]
        missing = [path for path in files if not os.path.isfile(path)]
        if missing:
            found = sorted(glob.glob(os.path.join(folder, "tables_rank_*.pt")))
            raise ConversionError(f"{folder}: the run kept its tables outside ZeRO in {ranks} file(s), but "
                                  f"{missing[0]} is missing (found {len(found)} table files)")
        self.memory = memory
        self.shards = [torch.load(path, map_location="cpu", mmap=True, weights_only=False)["tables"] for path in files]
        self.stored = {f"decoder.{name[len('model.'):]}": name for name in self.shards[0]}  # Megatron's name: file's
        self._partitions = {}

    def weight_names(self) -> list:
        return list(self.stored)

    def shape(self, name: str) -> tuple:
        return (sum(self._partition(name).branch_rows), self.shards[0][self.stored[name]].shape[1])

    def dtype(self, name: str) -> torch.dtype:
        return self.shards[0][self.stored[name]].dtype

    def load(self, name: str) -> torch.Tensor:
        return self._partition(name).assemble([shards[self.stored[name]] for shards in self.shards])

    def _partition(self, name: str):
        """The row partition of table ``name`` (its layer's hashing layout, at the run's ranks)."""
        from fe_megatron.ngram import NgramHasher
        from fe_megatron.tables.row_exchange import RowPartition

        if name not in self._partitions:
            layer = int(name.split(".layers.")[1].split(".")[0])
            layout = NgramHasher(self.memory, layer).layouts[0]
            self._partitions[name] = RowPartition(layout.moduli, layout.offsets, len(self.shards), 0)
        return self._partitions[name]


def deepspeed_to_hf(load: str, output: str, tag: Optional[str] = None, tokenizer: Optional[str] = None,
                    max_shard_bytes: int = 2 << 30, table_dtype: Optional[str] = None) -> str:
    """Convert the DeepSpeed engine's checkpoint in ``load`` into a transformers directory ``output``."""
    folder = find_run_checkpoint(load, _iteration_of(tag), engine="deepspeed")
    info = read_run_info(folder)
    backbone, memory = configs_of(info)
    tokenizer_path = run_tokenizer(info, tokenizer)
    weights = DeepSpeedWeights(folder, info, memory)
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
