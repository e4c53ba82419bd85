"""`--cpu-durations=N`: the N tests that used the most CPU (this process and the child processes it waited for).

Wall times (`--durations`) on a shared 2-core machine grow with whoever else is running; CPU seconds do not, so
they compare runs made at different loads. Each test's time covers its setup, call and teardown: a module- or
session-scoped fixture is paid by the first test that asks for it, as in `--durations`.
`--cpu-durations-json=PATH` also writes every test's {nodeid: [wall s, cpu s]} there. Under pytest-xdist each
worker measures its own tests and the figures travel to the controller in the teardown reports.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

_times: dict[str, tuple[float, float]] = {}


def _cpu() -> float:
    """User + system seconds of this process, of its finished and reaped children, and of helpers.forked's server
    with the children it forked and reaped (which are not this process's to reap)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + _server_cpu()


def _server_cpu() -> float:
    from helpers import forked

    pid = forked.server_pid()
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cpu-durations")
    group.addoption("--cpu-durations", type=int, default=None, metavar="N", help="list the N tests using most CPU")
    group.addoption("--cpu-durations-json", default=None, metavar="PATH", help="write every test's wall/CPU s")


_started: dict[str, tuple[float, float]] = {}
KEY = "cpu_durations"  # the report property that carries (wall, cpu) from an xdist worker to the controller


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _started[item.nodeid] = (time.perf_counter(), _cpu())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    if call.when == "teardown" and item.nodeid in _started:
        wall, cpu = _started.pop(item.nodeid)
        outcome.get_result().user_properties.append((KEY, (time.perf_counter() - wall, _cpu() - cpu)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collects the figures where the summary is printed (the controller, under pytest-xdist)."""
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == KEY:
                _times[report.nodeid] = (float(value[0]), float(value[1]))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    count, path = config.getoption("cpu_durations"), config.getoption("cpu_durations_json")
    if path:
        Path(path).write_text(json.dumps(_times, indent=0))
    if count is None or not _times:
        return
    ranked = sorted(_times.items(), key=lambda kv: -kv[1][1])
    total_wall, total_cpu = (sum(t[i] for t in _times.values()) for i in (0, 1))
    terminalreporter.write_sep("=", f"slowest {count or len(ranked)} tests by CPU seconds (with child processes)")
    for nodeid, (wall, cpu) in ranked[: count or None]:
        terminalreporter.write_line(f"{cpu:8.1f} cpu {wall:8.1f} wall  {nodeid}")
    terminalreporter.write_line(f"{total_cpu:8.1f} cpu {total_wall:8.1f} wall  in all ({len(_times)} tests)")
