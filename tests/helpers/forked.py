"""Child processes forked from one preloaded server: torch, megatron-core and megagate are imported once a session.

A fresh `python -m megagate train` (or a spawned gloo rank) spends ~10 s of CPU importing torch and megatron-core
(megatron's fusions pull in torch.compile's inductor at import) before it does anything, and the suite starts well
over a hundred of them. Here a multiprocessing forkserver imports them once; each child is a fork of it: a new
process with its own pid, memory, megatron state and process group, given the test's environment, working directory,
argv and output files, as a fresh interpreter would have them. What the child runs is the real thing:
`megagate.cli.main(argv)` (what `python -m megagate` calls) or a worker function.

    proc = forked.run_cli(["train", "--config", ...], env=env, timeout=600)   # a subprocess.CompletedProcess
    procs = forked.start(worker, [args_rank0, args_rank1])                     # multiprocessing.Process objects

Tests whose subject is the process itself (signals to a process group, a mount namespace, an interpreter's own
start-up and notices, the real torchrun launcher) keep starting `python -m megagate` with subprocess.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

from megagate.distributed.utils import free_port

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "megagate" / "__main__.py")  # sys.argv[0] of `python -m megagate`
# Imported by the server before it forks anyone (a missing import is an error: _check_preloaded).
PRELOAD = ["helpers.forked_preload"]
# what a launcher sets: never inherited from the test process, set per rank by run_cli
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
_context = multiprocessing.get_context("forkserver")
_lock = threading.Lock()
_started = False


@contextlib.contextmanager
def _plain_environment() -> Iterator[None]:
    """The server starts with the session's environment, not a test's monkeypatched one (children get their own)."""
    saved = dict(os.environ)
    base = {k: v for k, v in saved.items() if k not in DIST_VARS}
    # the server imports PRELOAD before it takes the sys.path multiprocessing hands it: helpers must be on PYTHONPATH
    base["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT / "tests"), str(ROOT), saved.get("PYTHONPATH")) if x)
    os.environ.clear()
    os.environ.update(base)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _ensure_server() -> None:
    global _started
    with _lock:
        if not _started:
            _context.set_forkserver_preload(PRELOAD)
            with _plain_environment():
                forkserver.ensure_running()
            _started = True
    if not _checked:
        _check_preloaded()


_checked = False


def _preloaded() -> int:
    """In a child: 0 if the server imported PRELOAD (multiprocessing ignores a preload's ImportError, and every
    child would then import torch and megatron itself), else the import's traceback and 1."""
    if all(name in sys.modules for name in PRELOAD):
        return 0
    for name in PRELOAD:
        __import__(name)  # raises: the reason the server could not
    return 1


def _check_preloaded() -> None:
    global _checked
    _checked = True
    proc = run(_preloaded, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"helpers.forked: the server could not import {PRELOAD}:\n{proc.stderr[-3000:]}")


def server_pid() -> int | None:
    """The pid of the preloaded server, if this process started one."""
    return forkserver._forkserver._forkserver_pid if _started else None


def stop_server(timeout: float = 10.0) -> None:
    """Stop the server: closing this process's end of its "alive" pipe asks it to exit, which it does once every
    child it forked is gone (a leaked child keeps it alive, and the session's leftover check reports both). A server
    left without children is only tearing down its imports: it is killed after a moment rather than waited for."""
    global _started
    server = forkserver._forkserver
    with _lock:
        if not _started or server._forkserver_pid is None:
            return
        os.close(server._forkserver_alive_fd)
        pid = server._forkserver_pid
        server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
        _started = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
        if time.monotonic() > deadline - timeout + 1 and not _children(pid):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    """Live children of `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                    found.append(int(entry))
    return found


def start(
    target: Callable[..., Any], arg_lists: Sequence[tuple], env: dict[str, str] | None = None, cwd: Path | str = ""
) -> list[Any]:
    """Start one forked child per argument tuple, each running target(*args) with `env` (default: this process's
    environment) in `cwd` (default: this process's working directory)."""
    _ensure_server()
    env, cwd = dict(os.environ if env is None else env), str(cwd or os.getcwd())
    procs = [_context.Process(target=_in_child, args=(target, args, env, cwd)) for args in arg_lists]
    for proc in procs:
        proc.start()
    return procs


def _in_child(target: Callable[..., Any], args: tuple, env: dict[str, str], cwd: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:  # read by torch at import, in the server
        sys.modules["torch"].set_num_threads(int(threads))
    target(*args)


def join_all(procs: Sequence[Any], timeout: float) -> list[int | None]:
    """Wait for every child up to `timeout` s in all; the ones still running then are killed (exit code None).
    Once one has failed, the others get 30 s to notice (their collectives fail) before they are killed."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending and time.monotonic() < deadline:
        pending[0].join(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
        pending = [p for p in pending if p.exitcode is None]
        if any(p.exitcode not in (0, None) for p in procs):
            deadline = min(deadline, time.monotonic() + 30)
    codes = [p.exitcode for p in procs]
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    return codes


# --- a program in a forked child, its output captured -------------------------------------------------------------
def _as_program(fn: Callable[..., Any], args: tuple, argv: list[str], out_path: str, err_path: str) -> None:
    """The child: sys.exit(fn(*args)) with sys.argv = argv and stdout/stderr in the given files, as a script run by
    a fresh interpreter would (an uncaught exception prints its traceback and exits 1), then the interpreter's
    shutdown."""
    sys.stdout.flush(), sys.stderr.flush()
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = out if err_path == out_path else os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1), os.dup2(err, 2)
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True), sys.stderr.reconfigure(write_through=True)
    sys.argv = list(argv)
    code: Any = 0
    try:
        code = fn(*args)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - an uncaught exception: the traceback and exit 1, as the interpreter does
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # the interpreter's shutdown: wait for non-daemon threads, then the atexit handlers, then flush
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        sys.stdout.flush(), sys.stderr.flush()
    os._exit(code & 0xFF)


def _megagate(argv: list[str]) -> int:
    from megagate.cli import main

    return main(argv)


def run(
    fn: Callable[..., Any],
    *args: Any,
    argv: Sequence[str] = (),
    envs: Sequence[dict[str, str]] | None = None,
    cwd: Path | str = ROOT,
    timeout: float = 600,
    stderr_to_stdout: bool = False,
) -> subprocess.CompletedProcess:
    """fn(*args) as a program (its sys.argv: `argv`) in forked children, one per environment in `envs` (default:
    one, this process's):
    exit code (fn's return value), stdout and stderr (merged if asked) as subprocess.run(..., capture_output=True,
    text=True) returns them. Several children run at once; their outputs follow each other in order and the exit code
    is the first failing child's. Children that outlive `timeout` are killed and subprocess.TimeoutExpired raised."""
    envs = list(envs or [dict(os.environ)])
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        outs = [f"{tmp}/out{i}" for i in range(len(envs))]
        errs = outs if stderr_to_stdout else [f"{tmp}/err{i}" for i in range(len(envs))]
        procs = []
        for env, out, err in zip(envs, outs, errs):
            procs += start(_as_program, [(fn, args, list(argv), out, err)], env=env, cwd=cwd)
        codes = join_all(procs, timeout)
        stdout = "".join(_read(out) for out in outs)
        stderr = None if stderr_to_stdout else "".join(_read(err) for err in errs)
    cmd = list(argv) or [fn.__name__, *map(str, args)]
    if any(code is None for code in codes):
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, next((c for c in codes if c != 0), 0), stdout, stderr)


def run_cli(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    nproc: int = 1,
    cwd: Path | str = ROOT,
    timeout: float = 600,
    stderr_to_stdout: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m megagate ARGV` (megagate.cli.main) as forked children, see `run`. nproc > 1 starts the ranks of
    one job on this host with the variables torchrun gives its workers (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT)."""
    base = {k: v for k, v in (os.environ if env is None else env).items() if k not in DIST_VARS}
    envs = [base]
    if nproc > 1:
        port = str(free_port())
        envs = [
            {**base, "RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(nproc)}
            | {"GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            for r in range(nproc)
        ]
    proc = run(
        _megagate,
        list(argv),
        argv=[MAIN, *argv],
        envs=envs,
        cwd=cwd,
        timeout=timeout,
        stderr_to_stdout=stderr_to_stdout,
    )
    proc.args = ["megagate", *argv]
    return proc


def _read(path: str) -> str:
    return Path(path).read_text(errors="replace") if Path(path).exists() else ""
