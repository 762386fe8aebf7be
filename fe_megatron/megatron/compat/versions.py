"""Which megatron-core is installed, and what it ships: the supported range, the release's own
version, and the pieces that arrived inside that range (Megatron-LM's trainer, HybridModel)."""

from __future__ import annotations

import importlib.util
import re

SUPPORTED_MEGATRON_CORE = (">=0.16.1", "<0.20")
OLDEST_TESTED, NEWEST_TESTED = "0.16.1", "0.19.2"


def megatron_core_version() -> str:
    """The installed release, as its package metadata names it (megatron-core's own ``package_info``
    appends the git commit of the working directory)."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:  # a source checkout on the path
        from megatron.core import package_info

        return package_info.__version__


def _version_tuple(version: str) -> tuple:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = re.match(r"\d*", piece).group()  # "1rc2" -> 1
        parts.append(int(digits or 0))
    return tuple(parts)


def is_supported_version(version: str) -> bool:
    low, high = (_version_tuple(bound.lstrip("<>=")) for bound in SUPPORTED_MEGATRON_CORE)
    return low <= _version_tuple(version) < high


# megatron.training (Megatron-LM's trainer with the config-container ``pretrain``), as
# `fe_megatron.megatron_lm` runs it
TRAINER_MINIMUM = "0.19"


def has_megatron_lm_trainer() -> bool:
    """Whether the installed megatron-core ships the Megatron-LM trainer this project drives
    (megatron.training with the config-container ``pretrain`` of 0.19)."""
    from packaging.version import Version

    return Version(megatron_core_version()) >= Version(TRAINER_MINIMUM) and \
        importlib.util.find_spec("megatron.training") is not None


HYBRID_MINIMUM = "0.19"


def has_hybrid_model() -> bool:
    """Whether the installed megatron-core builds ``HybridModel`` (``megatron.core.models.hybrid``, 0.19 on;
    `fe_megatron.megatron.hybrid_specs` needs it)."""
    from packaging.version import Version

    return Version(megatron_core_version()) >= Version(HYBRID_MINIMUM) and \
        importlib.util.find_spec("megatron.core.models.hybrid") is not None
