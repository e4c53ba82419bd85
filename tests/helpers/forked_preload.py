"""What the server of helpers.forked imports before it forks anyone: the slow imports of a `megagate train` / `eval`
/ `analyze` start-up and of the gloo workers (torch, megatron-core, the trainer and what it pulls in).

The notices megatron and torch print while they are imported are the server's, no test's output: they are
silenced for the imports only (no filter outlives them, so a child run with MEGAGATE_VERBOSE=1 filters nothing,
and megagate.console filters a child's notices exactly as it does a fresh process's)."""

import os
import sys
import warnings

sys.stderr.flush()
_saved, _null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
os.dup2(_null, 2)  # torch's C++ and logging write straight to file descriptor 2
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core  # noqa: F401
        import torch  # noqa: F401

        import megagate.train.trainer  # noqa: F401
finally:
    sys.stderr.flush()
    os.dup2(_saved, 2)
    os.close(_saved), os.close(_null)
