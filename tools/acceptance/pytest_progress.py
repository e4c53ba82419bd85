"""pytest plugin (`-p tools.acceptance.pytest_progress`): one JSON line per test as soon as it ends.

The file is named by MEGAGATE_ACCEPTANCE_TEST_LOG. A test run killed at its deadline has reported every test that
finished, where pytest's own JUnit file is written only at the end.
"""

from __future__ import annotations

import json
import os


def _message(report) -> str:
    text = str(report.longrepr) if report.longrepr is not None else ""
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])
    lines = [line for line in text.splitlines() if line.strip()]
    return " | ".join(line.strip()[:200] for line in lines[-3:])


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("MEGAGATE_ACCEPTANCE_TEST_LOG")
    if not path:
        return
    # a test's outcome: its call, or the setup that failed or skipped it, or a failing teardown
    if not (report.when == "call" or report.outcome != "passed"):
        return
    record = {"test": report.nodeid, "when": report.when, "outcome": report.outcome, "s": round(report.duration, 2)}
    if report.outcome != "passed":
        record["message"] = _message(report)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
