"""``fe-pretrain``: parse the command line, pick the engine, run it, shut down.

The engines are `fe_megatron.megatron.engine` (the default) and `fe_megatron.deepspeed.engine`
(``training.engine: deepspeed``); each has ``set_up(cfg)`` returning its run and ``shut_down()``.
See `DESCRIPTION` (the ``--help`` text) and docs/training.md.

Nothing heavy is imported at module level (torch, the engines: inside the functions).  A process
that multiprocessing's ``spawn`` starts imports the parent's main module again, and this is that
module under ``-m fe_megatron.train`` and ``fe-pretrain``: megatron-core's checkpoint writer starts
its helper process so at the first save (`fe_megatron.megatron.checkpointing`), which took 1 s of
the trainer's time while it imported torch again.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import os
import sys

from fe_megatron.training.error_file import tell_the_launcher
from fe_megatron.training.third_party_warnings import silence_known_third_party_warnings

DESCRIPTION = """\
Pretrain a FactorEngram, Engram or plain Transformer GPT with megatron.core (or, with
training.engine=deepspeed, the Hugging Face model under DeepSpeed ZeRO), in one process or
under torchrun / srun / the deepspeed launcher.

examples:
  fe-pretrain --config examples/configs/demo_cpu.yaml --save runs/demo_run
  fe-pretrain --config examples/configs/demo_cpu.yaml memory=null training.train_steps=100
  torchrun --nproc_per_node 8 -m fe_megatron.train \\
      --config examples/configs/paper_340m_factorengram.yaml --save checkpoints/run1

Every training.log_interval steps it prints and records (TensorBoard and SAVE/metrics.jsonl)
the LM loss, the sparsity loss (lambda x Eq. 12), the learning rate, the gradient norm,
tokens/s, memory and the time left; every training.eval_interval the validation perplexity;
every training.save_interval a distributed checkpoint. --load DIR resumes from DIR's latest
checkpoint; a new run is never written into a --save folder that holds another run's
checkpoints. The config's sections and fields: docs/training.md.
"""


def engine_module(name: str):
    """The engine ``training.engine`` names (`fe_megatron.training.config.ENGINES`): the package
    of that name's ``engine`` module."""
    return importlib.import_module(f"fe_megatron.{name}.engine")


def check_kernel_backend(name: str, device) -> None:
    """A forced kernel backend must be built and take tensors of the run's device (a torch.device):
    the tables' gathers, their (row-exchanged) gradients and the hash all run on it."""
    from fe_megatron import ops

    backend = ops.get_backend(name)
    if device.type not in backend.devices:
        raise ValueError(f"kernel backend {name!r} runs on {'/'.join(backend.devices)} tensors, but this run's "
                         f"tables are on {device.type}; use kernel_backend=auto or one of "
                         f"{[n for n in ops.available_backends() if device.type in ops.get_backend(n).devices]}")


def check_data_fits_tokenizer(cfg) -> None:
    """Data made with another tokenizer is refused before anything starts (process groups, the
    model, ``metrics.jsonl``): every token id of ``data.train_data`` must lie below the tokenizer's
    piece count and ``model.vocab_size`` (`fe_megatron.data.vocab_check`).  A tokenizer larger than
    the embedding is refused first, as such (`fe_megatron.training.run.load_run_tokenizer`)."""
    from fe_megatron.data.datasets import parse_blend
    from fe_megatron.data.vocab_check import check_token_ids_fit
    from fe_megatron.training.run import load_run_tokenizer

    tokenizer = load_run_tokenizer(cfg)
    prefixes, _ = parse_blend(cfg.data.train_data)
    check_token_ids_fit(prefixes, cfg.model.vocab_size, cfg.data.tokenizer_model, tokenizer.vocab_size)


def pretrain(cfg) -> dict:
    """Run (or resume) the configured pretraining; returns the final metrics."""
    import torch

    from fe_megatron import ops
    from fe_megatron.config import ConfigError
    from fe_megatron.training.loop import train

    t = cfg.training
    if t.kernel_backend != "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            check_kernel_backend(t.kernel_backend, device)
        except ValueError as err:
            raise ConfigError("kernel_backend", f"{err} (docs/kernels.md)", section="training") from None
    check_data_fits_tokenizer(cfg)
    ops.set_deterministic_backward(t.deterministic_table_grads)
    engine = engine_module(t.engine)
    with ops.use_backend(t.kernel_backend):  # the whole process's, every thread's, for the run
        run = engine.set_up(cfg)
        try:
            return train(run)
        finally:
            run.metrics.close()


def fail(message: str, exit_code: int, on_this_rank: bool = True) -> int:
    """Print ``message`` (where ``on_this_rank``) and return ``exit_code``; under torchrun every worker also
    writes it into its error file, so that torchrun's closing summary, the end of the log, shows it."""
    if on_this_rank:
        print(message, file=sys.stderr)
    tell_the_launcher(message)
    return exit_code


def build_parser() -> argparse.ArgumentParser:
    """fe-pretrain's command line: the config, --load/--save, --check and the config overrides."""
    parser = argparse.ArgumentParser(prog="fe-pretrain", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True,
                        help="YAML training config, e.g. examples/configs/demo_cpu.yaml (docs/training.md)")
    parser.add_argument("--load", help="resume from this run directory's newest checkpoint (an earlier --save); on a "
                                       "first start that later starts resume, the same folder as --save. The "
                                       "DeepSpeed engine also takes a Hugging Face model directory")
    parser.add_argument("--save", help="checkpoint and metrics directory")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.train_steps=100; before, "
                                                     "between or after the options")
    parser.add_argument("--check", action="store_true",
                        help="load and check the configuration (with --load/--save and the overrides), print it "
                             "resolved, and exit: 0 when it is valid, 2 with the error otherwise; the launch scripts "
                             "run this once before they start the workers")
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return parser


def missing_datasets(cfg) -> str:
    """--check: the first ``PREFIX.bin`` or ``PREFIX.idx`` of ``data.train_data`` that does not exist ("" when
    all do), as the run itself refuses it (`fe_megatron.data.datasets.build_datasets`)."""
    from fe_megatron.data.datasets import missing_dataset_files, parse_blend

    missing = missing_dataset_files(parse_blend(cfg.data.train_data)[0])
    return missing[0][1] if missing else ""


def print_checked_config(cfg, args) -> None:
    """--check: print the resolved configuration as JSON, and say on stderr that it is valid."""
    import dataclasses
    import json

    print(json.dumps(dataclasses.asdict(cfg), indent=1, default=str))
    print(f"fe-pretrain: {args.config} with {len(args.overrides)} override(s) is a valid configuration",
          file=sys.stderr)


def main(argv=None) -> int:
    # a crash in native code (a kernel, a collective, the exit) prints every thread's Python stack
    if not faulthandler.is_enabled():
        faulthandler.enable()
    silence_known_third_party_warnings()
    # Megatron's tensor-parallel layers rely on one device connection to order their overlapped
    # communication (Megatron-LM's launch scripts set it); a value the user set is kept.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = build_parser().parse_intermixed_args(argv)  # overrides may sit between the options
    import torch

    from fe_megatron.config import ConfigError
    from fe_megatron.data.sources import DataError
    from fe_megatron.training.config import load_train_config
    from fe_megatron.training.loop import NONFINITE_EXIT_CODE, REQUEUE_EXIT_CODE, NonFiniteError

    overrides = list(args.overrides)
    if args.load:
        overrides.append(f"load={args.load}")
    if args.save:
        overrides.append(f"save={args.save}")
    try:
        cfg = load_train_config(args.config, overrides)
    except (ValueError, FileNotFoundError) as err:  # ConfigError, invalid YAML, a missing file
        # every rank reads the same config: one message, not one per rank (SLURM_PROCID under a bare srun)
        return fail(f"fe-pretrain: error: {err}", 2,
                    on_this_rank=os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0")
    if args.check:
        missing = missing_datasets(cfg)
        if missing:
            return fail(f"fe-pretrain: error: data.train_data: {missing} does not exist; create it with fe-data "
                        f"preprocess, or give the prefix of its .bin/.idx pair", 2)
        print_checked_config(cfg, args)
        return 0
    from fe_megatron.checkpoint.files import CheckpointError

    try:
        result = pretrain(cfg)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as err:
        return fail(f"fe-pretrain: error: {err}", 2)
    except NonFiniteError as err:
        return fail(f"fe-pretrain: error: {err}", NONFINITE_EXIT_CODE)
    finally:
        if torch.distributed.is_initialized():
            engine_module(cfg.training.engine).shut_down()
    if result.get("event") == "preempted":
        # Under torchrun a non-zero exit would make the agent restart the workers here; the launch
        # script reads the marker file that the run wrote instead (launch_scripts/slurm/pretrain.sbatch).
        return 0 if "TORCHELASTIC_RESTART_COUNT" in os.environ else REQUEUE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
