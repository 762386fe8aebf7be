"""Silence the warnings of third-party libraries that say nothing to a user of fe_megatron.

Every command-line entry point calls `silence_known_third_party_warnings` before importing
megatron.core.  Only the warnings listed here, and only when a third-party module raises them,
are filtered; fe_megatron's own warnings, and any other, still show.
"""

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
    # torch's own collectives wrapper, on the calls DeepSpeed's ZeRO makes on every step
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
     r"torch\.distributed\.c10d_logger"),
    # megatron.core's own migration notices to its callers
    (DeprecationWarning, r"Warning: tp_group is None", r"megatron\."),
    (DeprecationWarning, r"MLP requires ffn_hidden_size", r"megatron\."),
)


def silence_known_third_party_warnings() -> None:
    for category, message, module in KNOWN_THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
