"""A failing worker's message, where torchrun's agent looks for it.

torchrun (torch.distributed.elastic) gives each worker a file to write its error into
(``TORCHELASTIC_ERROR_FILE``), and ends its log with a summary of the first worker that failed: that
file's message, or ``<N/A>`` and the exit code when the worker wrote none. An entry point that refuses
its input returns exit status 2 rather than raising, so it writes the file itself, in the format torch's
``ErrorHandler.record_exception`` writes: the message then ends the log, not 40 lines of the agent's
traceback after it. Outside torchrun the variable is unset and nothing is written.
"""

import json
import os
import time


def tell_the_launcher(message: str) -> None:
    """Write ``message`` into this worker's torchrun error file, if it has one."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    record = {"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                             "timestamp": str(int(time.time()))}}}
    with open(error_file, "w") as fh:
        json.dump(record, fh)
