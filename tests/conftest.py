"""Shared fixtures: a one-process megatron world for CPU unit tests, the demo corpus and the reference tiny run
(built once a session), and a session-end check for leftover processes."""

import contextlib
import os
import signal
import sys
import uuid
import warnings
from pathlib import Path

import pytest

# --cpu-durations=N / --cpu-durations-json=PATH: per-test CPU seconds, comparable across machine loads
from helpers.cpu_durations import (  # noqa: F401
    pytest_addoption,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    pytest_terminal_summary,
)

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")
# the CLI's console (megagate.console) for in-process tests too: a third-party log record printed while a test
# builds a model would otherwise land in the stderr a test reads (tests call megagate.cli.main in process)
from megagate import console  # noqa: E402

console.install()


@pytest.fixture(scope="session")
def megatron_world():
    """megatron's parallel state for a world of one process (gloo), shared by the unit tests of a session."""
    from megagate.distributed import parallel

    with parallel.single_process():
        yield


@pytest.fixture(scope="session")
def session_demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo corpus + tokenizer of examples/tiny_cpu.yaml, built once a session (before any trainer process can
    race to build it), in the folder helpers.trainer_jobs.demo_data gives every caller."""
    from helpers import trainer_jobs

    return trainer_jobs.demo_data(tmp_path_factory)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory, session_demo_dir: Path) -> Path:
    """The uninterrupted 12-step tiny run (helpers.tiny_runs.BASE: seq 64, global batch 8, micro-batch 2, no
    checkpoint but the final one at step 12, validated at its end), trained once a session: what resumed, resharded,
    recomputed, evaluated and extended runs are compared with. Tests only read it (one reruns it and checks that
    the rerun changed nothing)."""
    from helpers import tiny_runs

    out = tmp_path_factory.mktemp("reference-run")
    tiny_runs.run_train(out, session_demo_dir)
    return out


# --- two workers (pytest-xdist, `make test`'s -n 2 --dist loadgroup) ---------------------------------------------------
@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One xdist group per test module, so a module's tests share one worker and its module-scoped runs are made
    once; every Slurm test in one group, since a session starts one local cluster and its tests expect it idle."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        slurm = item.get_closest_marker("slurm") is not None or item.path.parent.name == "slurm"
        item.add_marker(pytest.mark.xdist_group("slurm" if slurm else item.nodeid.split("::")[0]))


def _xdist_controller(config: pytest.Config) -> bool:
    """The process that only hands tests to xdist's workers (each worker checks its own leftovers)."""
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


# --- no process outlives the session ---------------------------------------------------------------------------------
# Every process the tests start inherits this marker (subprocess env copies os.environ, spawn and fork children
# too), so leftovers are found even after they were reparented to init; other sessions on the machine have their own.
SESSION_MARKER = "MEGAGATE_TEST_SESSION"
_session_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
os.environ[SESSION_MARKER] = _session_id
# the local Slurm cluster's daemons are stopped by their fixture; never count them as test leftovers
_DAEMONS = {"slurmctld", "slurmd", "slurmdbd", "munged", "slurmstepd"}


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """`megagate train` run in this process (the CLI, in-process) installs its stop-signal handlers and Ctrl-C's
    wakeup pipe (megagate.train.signals.install_early); the next test gets the session's own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    yield
    for s, handler in saved.items():
        if handler is not None:
            signal.signal(s, handler)
    signal.set_wakeup_fd(wakeup)


@pytest.fixture(autouse=True)
def _fresh_moe_metrics_tracker():
    """megatron's global MoE metrics tracker sizes its per-layer tensors by the first MoE model that records into
    it; an in-process test with another layer count would then index past them. Each test starts without one."""
    yield
    logging_module = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    if logging_module is not None:
        logging_module.destroy_moe_metrics_tracker()


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) of every process (from /proc/<pid>/stat)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        table[int(entry)] = (int(fields[1]), fields[0])
    return table


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _has_marker(pid: int) -> bool:
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        return False
    return f"{SESSION_MARKER}={_session_id}".encode() in environ.split(b"\0")


def session_leftovers() -> dict[int, str]:
    """pid -> command line of the live processes this session started: descendants of this process, and any
    process carrying this session's marker (orphans reparented to init included)."""
    me = os.getpid()
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(children.get(me, []))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    found |= {pid for pid in table if pid != me and _has_marker(pid)}
    # this process's own multiprocessing resource tracker (started by an in-process DataLoader worker, say) is no
    # leak: it exits when its pipe to this process closes, after the session
    from multiprocessing import resource_tracker

    found.discard(getattr(resource_tracker._resource_tracker, "_pid", None))
    out = {}
    for pid in found:
        if pid not in table or table[pid][1] in ("Z", "X"):  # gone, or a zombie waiting to be reaped
            continue
        comm = _cmdline(pid)
        if comm and os.path.basename(comm.split()[0]) in _DAEMONS:
            continue
        out[pid] = comm
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session if a process it started is still alive (a leaked trainer, checkpoint-writer Manager,
    resource tracker, ...): list them, kill them. A short grace period lets dying children finish. helpers.forked's
    server is asked to stop first: it exits once the last child it forked is gone (a leak keeps it alive too)."""
    import time

    from helpers import forked

    if _xdist_controller(session.config):
        return
    forked.stop_server()
    deadline = time.monotonic() + 10
    left = session_leftovers()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = session_leftovers()
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(left)} process(es) started by this test session are still alive (killed now):"]
    lines += [f"  pid {pid}: {cmd[:300]}" for pid, cmd in sorted(left.items())]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if reporter is not None:
        reporter.write_sep("=", "leftover processes", red=True)
        reporter.write_line("\n".join(lines), red=True)
    else:
        print("\n".join(lines))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
