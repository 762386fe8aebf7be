"""Silence the warnings of third-party libraries that say nothing to a user of fe_megatron.

Every command-line entry point calls `silence_known_third_party_warnings` before importing
megatron.core.  Only the warnings listed here, and only when a third-party module raises them,
are filtered; fe_megatron's own warnings, and any other, still show.
"""

import logging
import re
import warnings

# (category, message regex, module regex of the code that warns)
KNOWN_THIRD_PARTY_WARNINGS = (
    # megatron.core on a machine without Transformer Engine or Apex (every CPU machine)
    (UserWarning, r".*(Transformer Engine|Apex).*not installed", r"megatron\."),
    # megatron.core's TransformerConfig defaults its own cuda_graph_scope to a deprecated value
    (UserWarning, r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config"),
    # megatron.core's checkpoint loader calls torch's deprecated load_state_dict
    (FutureWarning, r"`load_state_dict` is deprecated", r"megatron\.core\.dist_checkpointing"),
    # torch's checkpoint planner, on the ShardedTensors megatron.core's loader builds
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor",
     r"torch\.distributed\.checkpoint"),
    # torch 2.15's checkpoint loader, as megatron-core 0.19 reads a checkpoint's common state in one process
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized", r"torch\.distributed\.checkpoint"),
    (UserWarning, r"The argument order of load has been changed", r"torch\.distributed\.checkpoint"),
    # torch's own collectives wrapper, on the calls DeepSpeed's ZeRO makes on every step
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
     r"torch\.distributed\.c10d_logger"),
    # megatron.core's own migration notices to its callers
    (DeprecationWarning, r"Warning: tp_group is None", r"megatron\."),
    (DeprecationWarning, r"MLP requires ffn_hidden_size", r"megatron\."),
    # megatron.core 0.19 announces an experimental multimodal config on import
    (UserWarning, r"MimoModelConfig is experimental", r"megatron\."),
)

# (logger name, message regex): log records of third-party libraries that say nothing to a user
KNOWN_THIRD_PARTY_LOG_RECORDS = (
    # torch's extension builder, imported by megatron.core, on a CUDA build of torch without a GPU
    ("torch.utils.cpp_extension", r"No CUDA runtime is found"),
    # megatron.core 0.19 on every save through dist_checkpointing.save (fe_megatron saves synchronously)
    ("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated"),
    # megatron.core 0.19 on every GPTModel (docs/compatibility.md says what it means for fe_megatron)
    ("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED"),
)


class _DropKnownRecords(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def silence_known_third_party_warnings() -> None:
    for category, message, module in KNOWN_THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, pattern in KNOWN_THIRD_PARTY_LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownRecords) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropKnownRecords(pattern))
