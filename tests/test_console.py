"""megagate.console: the listed third-party notices are filtered exactly (whole message, source, category), nothing
else is (megagate's own messages, a changed text, another category or module, an incomplete gloo mesh), and the
verbose switch shows everything. The real processes: a megatron import and a gloo world with and without
MEGAGATE_VERBOSE=1 (a fresh training run and a resume: tests/train/test_trainer.py)."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import warnings

import pytest

from megagate import console

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARNINGS = [n for n in console.NOTICES if n.kind == "warning"]
LOGS = [n for n in console.NOTICES if n.kind == "log"]


def _shown(
    notice: console.Notice, *, text: str | None = None, module: str | None = None, category=None, cpu: bool = True
) -> bool:
    """Whether `warnings` shows the warning (the filters as console.install() leaves them, and install_cpu() where
    a gloo world starts)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        console.uninstall()
        console.install()
        if cpu:
            console.install_cpu()
        warnings.warn_explicit(
            text if text is not None else notice.text,
            category or notice.category,
            filename="x.py",
            lineno=1,
            module=module if module is not None else notice.source,
        )
    return bool(seen)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv(console.VERBOSE_ENV, "0")  # restored after the test, whatever it sets
    yield
    monkeypatch.setenv(console.VERBOSE_ENV, "0")
    console.uninstall()
    console.install()  # the session's console as tests/conftest.py set it


@pytest.mark.parametrize("notice", WARNINGS, ids=lambda n: f"{n.source}:{n.text[:30]}")
def test_each_listed_warning_is_filtered_exactly(notice):
    assert not _shown(notice)
    # megagate's own code saying the same is shown, and so is a changed text, another category or module
    assert _shown(notice, module="megagate.train.trainer")
    assert _shown(notice, text=notice.text + " (and more)")
    assert _shown(notice, text=notice.text.replace(" ", "  ", 1))
    assert _shown(notice, category=RuntimeWarning)
    assert _shown(notice, module=notice.source + ".sub")


def test_cpu_only_notices_show_on_gpu_runs():
    """A CUDA tuning hint is filtered once a CPU (gloo) world starts, never before (a GPU run keeps it)."""
    cpu_only = [n for n in WARNINGS if n.cpu_only]
    assert cpu_only
    for notice in cpu_only:
        assert _shown(notice, cpu=False) and not _shown(notice, cpu=True)


def _log_shown(logger: str, text: str) -> bool:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    log = logging.getLogger(logger)
    log.addHandler(handler)
    try:
        log.warning("%s", text)
    finally:
        log.removeHandler(handler)
    return bool(records)


@pytest.mark.parametrize("notice", LOGS, ids=lambda n: n.source)
def test_each_listed_log_record_is_filtered_exactly(notice):
    console.uninstall()
    console.install()
    assert not _log_shown(notice.source, notice.text)
    assert _log_shown(notice.source, notice.text + " Something else happened.")
    assert _log_shown("megagate", notice.text)  # another logger (megagate's) is never filtered
    assert _log_shown(notice.source, "checkpoint iter_0000012 is damaged")


def test_megagate_warnings_always_show():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console.install()
        warnings.warn_explicit(
            "Apex is not installed. Falling back to Torch Norm", UserWarning, "m.py", 1, "megagate.x"
        )
    assert len(seen) == 1


def test_gloo_lines():
    assert console.is_native_notice(
        "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n"
    )
    # an incomplete mesh is a problem: shown, with gloo's list of the missing peers
    assert not console.is_native_notice(
        "[Gloo] Rank 3 is connected to 6 peer ranks. Expected number of connected peer ranks is : 7"
    )
    assert not console.is_native_notice("[Gloo] Rank 3 is NOT connected to: [5]")
    assert not console.is_native_notice("step      2/2 | loss   7.6298")


def test_native_stdout_keeps_every_other_line_in_order(capfd):
    gloo = "[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0\n"
    with console.native_stdout_filtered():
        os.write(1, gloo.encode())
        print("from python", flush=True)
        os.write(1, b"from C: something else\n")
        os.write(1, gloo.encode())
    assert capfd.readouterr().out == "from python\nfrom C: something else\n"


def test_verbose_filters_nothing(monkeypatch, capfd):
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    assert _shown(WARNINGS[0])
    assert _log_shown(LOGS[0].source, LOGS[0].text)
    gloo = "[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0\n"
    with console.native_stdout_filtered():
        os.write(1, gloo.encode())
    assert capfd.readouterr().out == gloo


def test_verbose_flag_of_the_cli(capsys):
    from megagate.cli import build_parser, main

    assert main(["--verbose", "report"]) == 2  # the flag is taken off; the command's own usage error remains
    assert console.verbose() and "megagate report: error: " in capsys.readouterr().err
    assert "--verbose" in build_parser().format_help()


_PROBE = """
import sys
from megagate import console
console.install()
import megatron.core.models.backends  # 'Apex is not installed' at import
from megagate.distributed import parallel
with parallel.single_process():  # gloo: a line per process group
    print("world up")
"""


@pytest.mark.slow  # two processes importing megatron (~15 s each on an idle machine)
@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_a_real_process(verbose):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", **{console.VERBOSE_ENV: "1" if verbose else "0"})
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    gloo = [line for line in proc.stdout.splitlines() if line.startswith("[Gloo]")]
    if verbose:
        assert "Apex is not installed. Falling back to Torch Norm" in proc.stderr and len(gloo) >= 5
        assert "No CUDA runtime is found" in proc.stderr
    else:
        assert proc.stderr == "" and gloo == [] and proc.stdout == "world up\n", (proc.stdout, proc.stderr)


def test_table_cells_and_layouts() -> None:
    from megagate.console import cell, table

    assert [cell(None), cell(True), cell(False), cell(0.000123456), cell(3e-3, ".3f"), cell(7)] == [
        "-",
        "yes",
        "no",
        "0.0001235",
        "0.003",
        "7",
    ]
    assert [cell(math.nan), cell(math.inf), cell(math.nan, nan="-"), cell(-math.inf, nan="-")] == [
        "nan",
        "inf",
        "-",
        "-inf",
    ]
    rows = [["name", "lr"], ["baseline", "0.001"], ["g1", "0.01"]]
    assert table(rows) == "name      lr\n--------  -----\nbaseline  0.001\ng1        0.01"
    assert (
        table(rows, right_from=1, rule="line") == "name         lr\n---------------\nbaseline  0.001\ng1         0.01"
    )
