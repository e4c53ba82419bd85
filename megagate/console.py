"""What a run prints: `log` once per job (global rank 0), `warn` as one `warning:` line on stderr; and what the
third-party libraries print that is known and harmless, filtered in this one place.

Layer 0: any module may import it. torch is not imported for a print: a process that has not imported torch has
no process group either, and prints as rank 0.

The known notices. megatron-core, torch and gloo announce optional libraries that are absent (Transformer Engine,
Apex, a CUDA runtime), their own API transitions and deprecations, and connection counts, on every run; none of it
is about the user's run, and a user reads it as a problem. `NOTICES` lists each one: where it comes from (the module
a warning is attributed to, a logger's name, or gloo's C++ output), the whole message (exact, or a regular
expression naming the parts that vary, so a changed or new message still shows), and why it is harmless. Nothing
of megagate's own is in the list, and nothing is filtered by category or module alone.

`install()` (called by `megagate.cli.main` before any command runs) adds a `warnings` filter per warning and a
`logging.Filter` per logger record; `native_stdout_filtered()` wraps the calls that create gloo process groups
(torch's C++ writes its line straight to file descriptor 1). `megagate --verbose COMMAND` or `MEGAGATE_VERBOSE=1`
turns all of it off: everything third-party is shown again.

The text tables every report prints come from one renderer here: `table(rows)` lays out cells that `cell(value)`
formats.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

VERBOSE_ENV = "MEGAGATE_VERBOSE"


def _global_rank0() -> bool:
    if "torch" not in sys.modules:
        return True
    from megagate.distributed.utils import is_global_rank0

    return is_global_rank0()


def log(message: str, *, file: Any = None) -> None:
    """Print `message` once per job (on global rank 0), flushed; `file` defaults to stdout."""
    if _global_rank0():
        print(message, file=sys.stdout if file is None else file, flush=True)


def warn(message: str) -> None:
    """`warning: message` on stderr, once per job."""
    log(f"warning: {message}", file=sys.stderr)


# --- the known third-party notices ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Notice:
    """One known, harmless third-party notice: `text` as printed, matched exactly unless `pattern` (a regular
    expression for the whole message) names the parts that vary."""

    kind: str  # "warning" (warnings.warn), "log" (a logging record) or "stdout" (a native library's line)
    source: str  # warning: the module it is attributed to; log: the logger's name; stdout: the library
    text: str
    why: str
    category: type[Warning] = UserWarning  # warnings only
    pattern: str | None = None
    cpu_only: bool = False  # harmless only when the run is on CPU (filtered once a gloo world starts: install_cpu)

    @property
    def regex(self) -> str:
        return self.pattern if self.pattern is not None else re.escape(self.text)


_GRAD = (
    "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad attribute won't be "
    "populated during autograd.backward(). If you indeed want the .grad field to be populated for a non-leaf Tensor, "
    "use .retain_grad() on the non-leaf Tensor. If you access the non-leaf Tensor by mistake, make sure you access the "
    "leaf Tensor instead. See github.com/pytorch/pytorch/pull/30531 for more information."
)
_TE_APEX = "Transformer Engine and Apex are not installed. Falling back to "
_NO_APEX = "optional dependency: megatron's fallback is the path megagate runs without TE/Apex"
_DCP = "torch.distributed.checkpoint as megatron's dist_checkpointing calls it (0.19 on torch 2.9); loads are exact"
NOTICES: tuple[Notice, ...] = (
    # optional dependencies absent (CPU machines, GPU machines without TE/Apex)
    Notice("warning", "megatron.core.optimizer", _TE_APEX + "Torch optimizers.", _NO_APEX),
    *(
        Notice(
            "warning",
            module,
            (_TE_APEX + "local implementations of multi_tensor_applier and multi_tensor_scale"),
            _NO_APEX,
        )
        for module in (
            "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
            "megatron.core.optimizer.optimizer",
        )
    ),
    Notice(
        "warning",
        "megatron.core.optimizer.clip_grads",
        (_TE_APEX + "local implementations of multi_tensor_applier, multi_tensor_l2norm, and multi_tensor_scale"),
        _NO_APEX,
    ),
    *(
        Notice("warning", module, ("Apex is not installed. Falling back to Torch Norm"), _NO_APEX)
        for module in ("megatron.core.models.backends", "megatron.core.models.gpt.gpt_layer_specs")
    ),
    Notice(
        "log",
        "torch.utils.cpp_extension",
        "No CUDA runtime is found, using CUDA_HOME='/usr/local'",
        "optional dependency: no CUDA on a CPU machine; torch's C++-extension helper is never used",
        pattern=r"No CUDA runtime is found, using CUDA_HOME='[^']*'",
    ),
    # megatron-core 0.19's notices about its own API transitions, printed whatever the run's settings
    Notice(
        "warning",
        "megatron.core.transformer.transformer_config",
        "full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.",
        "a default of megatron's TransformerConfig; megagate sets no CUDA-graph scope",
    ),
    Notice(
        "warning",
        "megatron.core.models.mimo.config.base_configs",
        (
            "MimoModelConfig is experimental and still under active development. The API may change without "
            "notice in future releases."
        ),
        "printed when megatron imports its multimodal models; unused",
    ),
    Notice(
        "log",
        "megatron.core.distributed.distributed_data_parallel",
        (
            "DistributedDataParallel: full_param_layout not provided with use_distributed_optimizer=True. "
            "Auto-computing layout inside DDP. Callers should pre-compute layouts via "
            "DistributedOptimizer.compute_full_param_layout() and pass them in."
        ),
        "megatron computes the same layout itself",
    ),
    Notice(
        "log",
        "megatron.core.dist_checkpointing.strategies.torch",
        (
            "MCore's async save is deprecated and will be removed in the future releases. Please, use NVRx "
            "async solution by setting `async_strategy` to `nvrx`."
        ),
        "megagate's checkpoint writer uses megatron's async queue deliberately (train.checkpoint)",
    ),
    Notice(
        "warning",
        "megatron.core.optimizer.optimizer",
        _GRAD + " (Triggered internally at /pytorch/build/aten/src/ATen/core/TensorBody.h:489.)",
        "megatron's zero_grad looks at .grad of the distributed optimizer's shard views; gradients live in its buffers",
        pattern=re.escape(_GRAD) + r"( \(Triggered internally at [^)]*\))?",
    ),
    Notice(
        "warning",
        "megatron.core._rank_utils",
        "Could not determine rank from torch.distributed, RANK, or SLURM_PROCID. Defaulting to rank 0.",
        "eval builds megatron's sample indices before its process group starts (rank 0 is right)",
    ),
    # a CUDA tuning hint of megatron's tensor-parallel layers: meaningless on CPU, a real hint on a GPU (where
    # megagate's Slurm scripts set CUDA_DEVICE_MAX_CONNECTIONS=1 and it does not appear)
    *(
        Notice(
            "warning",
            "megatron.core.tensor_parallel.layers",
            f"When using {what} it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1 "
            "for maximum speedup",
            "a CUDA stream setting; a CPU run (gloo) has no CUDA streams",
            cpu_only=True,
        )
        for what in ("async grad allreduce", "sequence parallelism")
    ),
    # torch.distributed.checkpoint on resume / evaluation / export (loading megatron's dist_checkpointing format)
    Notice(
        "warning",
        "torch.distributed.checkpoint.state_dict_loader",
        (
            "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a "
            "single process."
        ),
        _DCP + " (the common state is read by each rank on its own)",
    ),
    Notice(
        "warning",
        "torch.distributed.checkpoint.utils",
        "The argument order of load has been changed. Please check the document to avoid future breakages.",
        _DCP,
    ),
    *(
        Notice(
            "warning",
            module,
            "Please use DTensor instead and we are deprecating ShardedTensor.",
            _DCP + ": megatron's checkpoints are ShardedTensors",
            FutureWarning,
        )
        for module in ("torch.distributed.checkpoint.planner_helpers", "torch.distributed.checkpoint.default_planner")
    ),
    # torch 2.9's gloo prints every process group it connects (gloo made this a log line later, pytorch/gloo#466);
    # an incomplete mesh (connected != expected) still shows, and so does gloo's "is NOT connected to" line
    Notice(
        "stdout",
        "gloo",
        "[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0",
        "gloo's connection count of every process group it creates, all connected",
        pattern=r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. Expected number of connected peer ranks is : \1",
    ),
)


def verbose() -> bool:
    """Whether the console shows everything (MEGAGATE_VERBOSE set to anything but '', '0', 'false', 'no')."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def set_verbose(on: bool = True) -> None:
    """Turn the verbose console on for this process and the processes it starts."""
    os.environ[VERBOSE_ENV] = "1" if on else "0"


class _LogNoticeFilter(logging.Filter):
    def __init__(self, patterns: list[re.Pattern[str]]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.fullmatch(message) for p in self.patterns)


_log_filters: list[tuple[str, _LogNoticeFilter]] = []
_installed = False
_installed_cpu = False


def _filter(notices: list[Notice]) -> None:
    by_logger: dict[str, list[re.Pattern[str]]] = {}
    for notice in notices:
        if notice.kind == "warning":
            # message and module are matched from their start: \Z makes both whole-string matches
            warnings.filterwarnings(
                "ignore",
                message=notice.regex + r"\Z",
                category=notice.category,
                module=re.escape(notice.source) + r"\Z",
            )
        elif notice.kind == "log":
            by_logger.setdefault(notice.source, []).append(re.compile(notice.regex))
    for name, patterns in by_logger.items():
        log_filter = _LogNoticeFilter(patterns)
        logging.getLogger(name).addFilter(log_filter)
        _log_filters.append((name, log_filter))


def install() -> None:
    """Filter the known notices of `NOTICES` in this process (nothing when verbose; idempotent)."""
    global _installed
    if verbose() or _installed:
        return
    _filter([n for n in NOTICES if not n.cpu_only])
    _installed = True


def install_cpu() -> None:
    """Also filter the notices harmless on CPU only: called where a gloo (CPU) world starts, after `install`."""
    global _installed_cpu
    if verbose() or not _installed or _installed_cpu:
        return
    _filter([n for n in NOTICES if n.cpu_only])
    _installed_cpu = True


def uninstall() -> None:
    """Remove the logging filters `install` added (tests: the warnings filters go with their catch_warnings)."""
    global _installed, _installed_cpu
    for name, log_filter in _log_filters:
        logging.getLogger(name).removeFilter(log_filter)
    _log_filters.clear()
    _installed = _installed_cpu = False


_STDOUT = [re.compile(n.regex) for n in NOTICES if n.kind == "stdout"]


def is_native_notice(line: str) -> bool:
    """Whether a line a native library wrote to stdout is one of the known notices."""
    return any(p.fullmatch(line.rstrip("\r\n")) for p in _STDOUT)


@contextlib.contextmanager
def native_stdout_filtered() -> Iterator[None]:
    """Run a block whose native code writes notices straight to file descriptor 1 (gloo, when it creates a
    process group): fd 1 goes to a temporary file meanwhile, and every line that is not a known notice is written
    to stdout afterwards, in order. Python's own prints inside the block are kept the same way."""
    try:
        saved = -1 if verbose() else os.dup(1)
    except OSError:  # no file descriptor 1 (a daemonised process): nothing to filter
        saved = -1
    if saved < 0:
        yield
        return
    sys.stdout.flush()
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            held.seek(0)
            text = held.read().decode(errors="replace")
            kept = "".join(line for line in text.splitlines(keepends=True) if not is_native_notice(line))
            if kept:
                sys.stdout.write(kept)
                sys.stdout.flush()


# --- tables -------------------------------------------------------------------------------------------------------
def cell(value: Any, spec: str = ".4g", *, nan: str | None = None) -> str:
    """One table cell: "-" for None, yes / no for a bool, a finite float by `spec` (a NaN as `nan` when given, else
    like an infinity: "nan", "inf"), anything else as its str()."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isfinite(value):
            return format(value, spec)
        return nan if nan is not None and math.isnan(value) else str(value)
    return str(value)


def table(rows: Sequence[Sequence[str]], *, right_from: int | None = None, rule: str = "columns") -> str:
    """Fixed-width text: `rows[0]` the header, then a rule (`columns`: dashes under each column; `line`: one line
    as wide as the header), then the other rows; columns two spaces apart, those from index `right_from` on
    right-aligned, trailing spaces dropped."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    right = len(widths) if right_from is None else right_from

    def line(row: Sequence[str]) -> str:
        cells = (c.ljust(w) if i < right else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        return "  ".join(cells).rstrip()

    lines = [line(row) for row in rows]
    lines.insert(1, "-" * len(lines[0]) if rule == "line" else "  ".join("-" * w for w in widths))
    return "\n".join(lines)
