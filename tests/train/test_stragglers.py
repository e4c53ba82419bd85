"""A slow rank (an injected `slow_rank`: 1.5x the compute time) is reported within the configured window, with its
rank and host, on the console, in TensorBoard, in health.jsonl and by `megagate report`.

The other multi-process runs of the suite (tests/helpers/tiny_runs.run_train with nproc > 1, the torchrun and Slurm
runs of tests/helpers/trainer_runs, the hang tests' references) run with the same small window (`STRAGGLER`) and
check that they reported no straggler.
"""

from __future__ import annotations

import statistics

import pytest

from helpers import fault_runs as F
from helpers import tiny_runs as T
from megagate.health import watchdog

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
INTERVAL, WINDOWS = 4, 2


def test_a_slow_rank_is_reported_within_the_window(tmp_path, session_demo_dir, capsys):
    out = tmp_path / "run"
    launch = F.torchrun(
        out,
        session_demo_dir,
        2,
        "train.train_steps=32",
        # a step that computes long enough (~0.2 s here: 4 micro-batches of 8) for a 1.5x slowdown to stand out of the
        # scheduling noise of a loaded machine
        "train.seq_length=128",
        "train.micro_batch_size=8",
        "train.global_batch_size=64",
        "logging.tensorboard=true",
        f"straggler.interval={INTERVAL}",
        f"straggler.windows={WINDOWS}",
        # records 4 times a second: at the default 1 s a step of ~0.1 s (this machine) leaves most 4-step windows
        # without a record from every rank, and the first report comes late
        "watchdog.heartbeat_s=0.25",
        "monitor.faults=[{step: 1, kind: slow_rank, rank: 1, factor: 1.5}]",
    )
    assert launch.rc == 0, launch.log[-3000:]
    reports = F.events(out, "straggler")
    host = watchdog.host_name()
    assert reports and {(r["rank"], r["host"]) for r in reports} == {(1, host)}, reports  # rank 0 never
    first = reports[0]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(out / "tensorboard"))
    tb.Reload()
    ratios = {e.step: e.value for e in tb.Scalars("straggler/max_compute_ratio")}
    slowest = {e.step: e.value for e in tb.Scalars("straggler/slowest_rank")}
    # reported after WINDOWS slow windows of INTERVAL steps; a window ends at the last step every rank's record holds
    # and spans at least 3/4 of the interval: records written a heartbeat (0.25 s, ~2 steps here) apart may delay the
    # first windows by up to two looks (reported at steps 6-11 here, quiet or beside two busy processes). The first
    # window holds rank 1's first step, which the injected slowdown cannot scale yet (no recent compute time): when
    # that step is its fastest, the window reads under the margin (1.23 on an idle VM). A host busy with the other
    # worker's ranks may hide one more window (rank 0 descheduled on each of its steps: CI runs read 1.22 and 1.17 at
    # the first two looks, and reported at step 19)
    assert first["step"] <= INTERVAL * (WINDOWS + 4), (reports, ratios, slowest)
    # the looks (TensorBoard's steps; a report's step is its window's last) up to the first report's
    reported = [e.step for e in tb.Tensors("straggler/reports/text_summary")]
    slow = [slowest[s] == 1.0 and ratios[s] > 1.25 for s in sorted(ratios) if s <= reported[0]]
    assert slow[-WINDOWS:] == [True] * WINDOWS and slow.count(False) <= 2, (reports, ratios, slowest)
    # the injected 1.5x reads 1.3-1.7 on a quiet machine; a loaded one deschedules the slow rank on top (4.0 seen in
    # a 47-minute suite run on a slower 2-core machine), so the upper bound only catches a gross error
    assert 1.25 < first["ratio"] < 6 and first["windows"] == WINDOWS, first
    # the other rank waits for it in the gradient reduction: over the whole run (one window's medians can be turned
    # round by a few steps of the other rank descheduled on a loaded machine), from the progress records' step times
    (folder,) = F.launches(out)
    waits = {r: statistics.median(w for _, _, w in F.record(folder, r)["recent"]) for r in (0, 1)}
    assert waits[0] > 2 * waits[1], waits
    assert any(r["others_wait_s"] > r["wait_s"] for r in reports), reports
    assert f"straggler: rank 1 ({host}) computes {first['ratio']:.2f}x as long as the other ranks" in launch.log

    assert len(reported) == len(reports), (reported, reports)
    # at each report rank 1 was the slowest, over the margin (in a window without a report, a few steps of rank 0
    # descheduled on a loaded machine may make it the slowest: one window is no report)
    assert all(slowest[s] == 1.0 and ratios[s] > 1.25 for s in reported), (reported, slowest, ratios)

    from megagate import cli

    assert cli.main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cluster health" in text and f"rank 1 ({host}) computes" in text and "injected slow_rank" not in text


def test_losses_unchanged_by_the_straggler_report(tmp_path, session_demo_dir):
    """The report reads files on the logging rank only: a run with it on has the losses of a run with it off."""
    on = T.run_train(tmp_path / "on", session_demo_dir, *T.STRAGGLER, nproc=2)
    off = T.run_train(tmp_path / "off", session_demo_dir, "straggler.enabled=false", "watchdog.enabled=false", nproc=2)
    assert on.returncode == off.returncode == 0
    assert T.losses(tmp_path / "on") == T.losses(tmp_path / "off")
