"""What the server of helpers.forked imports before it forks anyone: the slow imports of a `megagate train` / `eval`
/ `analyze` start-up and of the gloo workers (torch, megatron-core, the trainer and what it pulls in)."""

from megagate.cli import _quiet_optional_dependency_notices

_quiet_optional_dependency_notices()  # the server's own import notices are no test's output

import megatron.core  # noqa: E402, F401
import torch  # noqa: E402, F401

import megagate.train.trainer  # noqa: E402, F401
