"""What every conversion shares: the error it raises, progress lines, the run's tokenizer, and
output folders written under ``OUTPUT.tmp`` and renamed into place at the end (a failed
conversion leaves nothing half-written under ``OUTPUT``)."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Optional

from fe_megatron.checkpoint.files import file_digest
from fe_megatron.checkpoint.reader import NotARunError, find_checkpoint_folder



class ConversionError(ValueError):
    """The input cannot be converted; the message says why and what to do."""


# ----------------------------------------------------------------------------- progress
class Progress:
    """One line per finished tensor group on a terminal (tqdm), a summary line otherwise."""

    def __init__(self, total_bytes: int, what: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=what, file=sys.stderr,
                        disable=not sys.stderr.isatty())
        self.what, self.done = what, 0

    def __call__(self, name: str, nbytes: int) -> None:
        self.done += nbytes
        self.bar.update(nbytes)

    def close(self) -> None:
        self.bar.close()
        print(f"{self.what}: {self.done / 1e6:,.1f} MB done", flush=True)


# ----------------------------------------------------------------------------- tokenizers
def find_run_checkpoint(load: str, iteration: Optional[int] = None, engine: str = "megatron",
                        require_run_info: bool = True) -> str:
    """The checkpoint folder to convert (`fe_megatron.checkpoint.reader.find_checkpoint_folder`); a
    path that is not a run of ``engine`` is a `ConversionError`, a damaged checkpoint a `CheckpointError`."""
    try:
        return find_checkpoint_folder(load, iteration, engine, require_run_info)
    except NotARunError as err:
        raise ConversionError(str(err)) from None


# What a transformers directory converted from a run keeps of that run's training config (every section but
# the model and memory, which config.json holds), so that hf-to-mcore can continue with the run's settings.
TRAINING_SETTINGS = "fe_training.json"


def training_settings(info: dict, folder: str) -> dict:
    """The training settings of the run whose checkpoint ``folder`` is, from its run info."""
    config = dict((info or {}).get("config") or {})
    for key in ("model", "memory", "save", "load", "tensorboard_dir"):
        config.pop(key, None)
    return {"converted_from": os.path.abspath(folder), "config": config}


def run_tokenizer(info: dict, override: Optional[str]) -> str:
    from fe_megatron.data.tokenizer import tokenizer_file

    recorded = info.get("tokenizer") or {}
    path = override or recorded.get("path")
    if not path or not os.path.exists(path):
        raise ConversionError(f"the run's tokenizer {path!r} does not exist here; pass --tokenizer PATH (the "
                              f"sentencepiece model or tokenizer directory with sha256 {recorded.get('sha256')})")
    digest = file_digest(tokenizer_file(path))["sha256"]
    if recorded.get("sha256") and digest != recorded["sha256"]:
        raise ConversionError(f"tokenizer {path} has sha256 {digest}, the run was trained with "
                              f"{recorded['sha256']}; pass --tokenizer with the run's tokenizer")
    return path


def check_vocabulary(size: int, vocab_size: int, where: str) -> None:
    """Refuse a tokenizer of ``size`` tokens for an embedding of ``vocab_size`` rows."""
    if size > vocab_size:
        raise ConversionError(f"{where}: the tokenizer has {size} tokens but the model's vocabulary has "
                              f"{vocab_size} rows; ids >= {vocab_size} would have no embedding. Use the model's "
                              "own tokenizer")



def fresh_output(output: str) -> str:
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ConversionError(f"--output {output} already exists and is not empty; choose a new directory")
    tmp = output.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def publish(tmp: str, output: str) -> str:
    if os.path.isdir(output):
        os.rmdir(output)  # empty, checked by fresh_output
    os.replace(tmp, output)
    return output


