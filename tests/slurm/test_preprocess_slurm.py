"""`megagate preprocess --slurm` on the real local cluster: a 3-task array + a merge job over Parquet, JSONL.zst and
JSONL; one task SIGKILLed mid-write; the rerun of the same command submits only that task; the merged bytes are the
single process's."""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from helpers.mixed_corpus import paragraphs, write_mixed

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]


def _job(printed: str, what: str) -> int:
    m = re.search(rf"^{what}: .* job (\d+)$", printed, flags=re.M)
    assert m, printed
    return int(m.group(1))


def test_array_and_merge_give_the_single_run_bytes_and_a_killed_task_is_redone_alone(
    slurm, tmp_path, monkeypatch, capsys
):
    from megagate import cli
    from megagate.data.tokenizer import train_bpe

    texts = paragraphs(200_000)
    inputs = write_mixed(tmp_path / "in", texts)
    tok = str(train_bpe(iter(texts), tmp_path / "tok.json", vocab_size=1024))
    assert cli.main(["preprocess", "-i", *map(str, inputs), "-o", str(tmp_path / "one"), "-t", tok, "-w", "1"]) == 0
    for key in ("SLURM_CONF", "PYTHONPATH", "PATH"):
        monkeypatch.setenv(key, slurm.env[key])
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out" / "corpus"
    argv = ["preprocess", "-i", *map(str, inputs), "-o", str(out), "-t", tok, "-w", "1", "--no-progress"]
    argv += ["--unit-mb", "0.02", "--tasks", "3", "--slurm", "--slurm-time", "10:00"]
    hold = tmp_path / "held"
    monkeypatch.setenv("MEGAGATE_PREPROCESS_HOLD", f"unit-00001:{hold}")  # task 1's first unit waits to be killed
    capsys.readouterr()
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "array: tasks 0,1,2 (" in printed
    array, merge = _job(printed, "array"), _job(printed, "merge")
    deadline = time.monotonic() + 300
    while not hold.exists():
        assert time.monotonic() < deadline, "task 1 never started its unit"
        time.sleep(0.2)
    pid = int(hold.read_text())
    assert list(out.parent.glob("corpus.units/unit-00001_text_document.bin.tmp-*"))  # mid-way: writing
    os.kill(pid, signal.SIGKILL)  # as the OOM killer or a dying node would
    assert slurm.wait(merge, timeout=300)["JobState"] == "FAILED"  # afterany: it ran, and named the missing units
    logs = "".join(p.read_text() for p in (out.parent / "corpus.units" / "logs").glob("*.out"))
    manifest = json.loads((out.parent / "corpus.units" / "manifest.json").read_text())
    task1 = [u["id"] for u in manifest["units"] if u["task"] == 1]  # the killed task never reached the others
    assert f"{len(task1)} of {len(manifest['units'])} units not done ({', '.join(map(str, task1))}: missing" in logs, (
        logs
    )
    assert not Path(f"{out}_text_document.bin").exists()
    assert not list(out.parent.glob("corpus.units/unit-00001*.done.json"))
    done_before = sorted(p.name for p in out.parent.glob("corpus.units/unit-*.done.json"))
    mtimes = {n: (out.parent / "corpus.units" / n).stat().st_mtime_ns for n in done_before}

    monkeypatch.delenv("MEGAGATE_PREPROCESS_HOLD")
    assert cli.main(argv) == 0  # the same command again
    printed = capsys.readouterr().out
    assert "array: tasks 1 (" in printed, printed  # only the killed task's units
    merge = _job(printed, "merge")
    info = slurm.wait(merge, timeout=300)
    assert info["JobState"] == "COMPLETED", "".join(
        p.read_text() for p in (out.parent / "corpus.units" / "logs").glob("*.out")
    )
    assert slurm.show(array)["JobState"] in ("FAILED", "COMPLETED", "")
    assert {n: (out.parent / "corpus.units" / n).stat().st_mtime_ns for n in done_before} == mtimes  # not redone
    for suffix in (".bin", ".idx", ".meta.json"):
        assert (
            Path(f"{out}_text_document{suffix}").read_bytes() == (tmp_path / f"one_text_document{suffix}").read_bytes()
        )
    assert not list(out.parent.glob("corpus.units/*.tmp-*"))
