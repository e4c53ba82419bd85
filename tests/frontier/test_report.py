"""The frontier report against a grid: the same rule applied to a grid's run folders, side by side with a search's
state (both written here as the trainer and the driver write them: config.yaml, metrics.jsonl, summary.json,
frontier.json), the compute comparison and the ordering verdict; `megagate report` on both folders."""

from __future__ import annotations

import math

import pytest

from megagate.cli import main
from megagate.files import write_atomic
from megagate.frontier import state as state_mod
from megagate.frontier.report import grid_result, ordering, same_order, text_report
from megagate.frontier.rule import HealthRule, TrialOutcome
from megagate.frontier.search import Bracket
from megagate.frontier.spec import FrontierSpec
from megagate.frontier.state import FrontierState, Trial
from megagate.monitor import runfiles

STEPS = 40
# final validation loss per (variant, lr): "a" is healthy up to 0.1 (0.3 above its best), "b" only at 0.01
LOSSES = {
    ("a", 0.01): 4.9,
    ("a", 0.1): 5.2,
    ("a", 1.0): 6.2,
    ("b", 0.01): 4.8,
    ("b", 0.1): 5.6,
    ("b", 1.0): 6.5,
}


def write_run(folder, variant: str, lr: float, seed: int, valid: float, spike_at: int | None = None) -> None:
    run = folder / f"{variant}_lr{lr:g}_s{seed}"
    run.mkdir(parents=True)
    write_atomic(
        run / runfiles.CONFIG,
        f"seed: {seed}\ntrain: {{lr: {lr}, train_steps: {STEPS}, warmup_steps: 4}}\nmodel: {{gate: {{preset: {variant}}}}}\n",
    )
    for step in range(1, STEPS + 1):
        loss = 7.0 - 2.0 * step / STEPS + 0.01 * ((step * 7919) % 13 - 6) + (3.0 if step == spike_at else 0.0)
        runfiles.write_metrics(run, step, "train", loss=loss, grad_norm=1.0, lr=lr)
    runfiles.write_summary(run, STEPS, 5.0, valid, False)


@pytest.fixture
def grid(tmp_path):
    folder = tmp_path / "grid"
    for (variant, lr), valid in LOSSES.items():
        for seed in (0, 1):
            # a loss spike after warm-up at step 30 of one seed of "a" at 1.0: unhealthy there anyway
            write_run(
                folder,
                variant,
                lr,
                seed,
                valid + 0.02 * seed,
                spike_at=30 if (variant, lr, seed) == ("a", 1.0, 1) else None,
            )
    return folder


def frontier_state(tmp_path) -> tuple[FrontierState, object]:
    spec = FrontierSpec(
        config="c.yaml", variants=("a", "b"), lo=0.01, hi=1.0, seeds=(0, 1), resolution=0.5, train_steps=STEPS
    )
    state = FrontierState(spec, {"kind": "local"}, done=True)
    rows = {
        ("a", 0.01, 0): TrialOutcome(STEPS, True, valid_loss=4.9),
        ("a", 1.0, 0): TrialOutcome(10, False, "rung", "worse at step 10"),
        ("a", 0.1, 0): TrialOutcome(STEPS, True, valid_loss=5.2),
        ("a", 0.316228, 0): TrialOutcome(20, False, "rung", "worse at step 20"),
        ("a", 0.1, 1): TrialOutcome(STEPS, True, valid_loss=5.22),
        ("b", 0.01, 0): TrialOutcome(STEPS, True, valid_loss=4.8),
        ("b", 1.0, 0): TrialOutcome(10, False, "rung", "worse at step 10"),
        ("b", 0.1, 0): TrialOutcome(STEPS, True, valid_loss=5.6),
        ("b", 0.0316228, 0): TrialOutcome(STEPS, True, valid_loss=5.1),
        ("b", 0.0316228, 1): TrialOutcome(STEPS, True, valid_loss=5.12),
    }
    for (variant, lr, seed), outcome in rows.items():
        name = spec.trial_name(variant, lr, seed)
        state.trials[name] = Trial(variant, lr, seed, status="done", attempts=1, round=1, outcome=outcome)
    state.rounds = [{"index": 1, "trials": list(state.trials), "finished": "x"}]
    return state, spec


def test_the_rule_on_a_grid_and_side_by_side(grid, tmp_path):
    state, spec = frontier_state(tmp_path)
    g = grid_result([grid], spec)
    assert g.runs == 12 and g.spent == 12 * STEPS and g.lrs == [0.01, 0.1, 1.0]
    assert g.brackets == {"a": Bracket(0.1, 1.0), "b": Bracket(0.01, 0.1)}
    text, record = text_report(state, tmp_path, g)
    spent = 7 * STEPS + 10 + 20 + 10
    assert state.spent == spent
    assert (
        f"compute: frontier {spent:,} trial-steps vs grid {12 * STEPS:,} ({100 * spent / (12 * STEPS):.1f} %)" in text
    )
    # at resolution 0.5 decades the full grid has 5 LRs x 2 variants x 2 seeds x 40 steps
    assert (
        f"against 800 for the full grid at the same resolution (5 LRs x 2 variants x 2 seeds x {STEPS} steps)" in text
    )
    assert "same ordering as the grid: yes" in text
    assert "frontier ordering: a (0.1) > b (0.0316)" in text
    row = next(line for line in text.splitlines() if line.startswith("b ") and "[0.01, 0.1)" in line)
    assert "[0.0316, 0.1)" in row and " yes " in row  # inside the grid's bracket, at a finer resolution
    assert record["grid"]["brackets"] == {"a": [0.1, 1.0], "b": [0.01, 0.1]}
    assert record["variants"]["a"]["bracket"] == [0.1, 0.316228]


def test_a_thrifty_search_is_reported_by_its_own_schedule(tmp_path):
    """The top of the range never ran (the middle failed first): the report plans with the search's schedule, so the
    bracket is there and the search done, not "nothing run" and waiting for a coarse point."""
    spec = FrontierSpec(
        config="c.yaml",
        variants=("b",),
        lo=0.01,
        hi=1.0,
        seeds=(0, 1),
        resolution=0.5,
        schedule="thrifty",
        train_steps=STEPS,
    )
    state = FrontierState(spec, {"kind": "local"}, done=True)
    for lr, seed, valid in ((0.01, 0, 4.8), (0.1, 0, 5.6), (0.0316228, 0, 5.1), (0.0316228, 1, 5.12)):
        outcome = TrialOutcome(STEPS, True, valid_loss=valid)
        state.trials[spec.trial_name("b", lr, seed)] = Trial(
            "b", lr, seed, status="done", attempts=1, round=1, outcome=outcome
        )
    text, record = text_report(state, tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("b "))
    assert "[0.0316, 0.1)" in row and "2/2 healthy" in row and row.endswith("done")
    assert record["variants"]["b"]["bracket"] == [0.0316228, 0.1]


def test_loss_spikes_of_a_grid_are_replayed_with_this_monitor(grid, tmp_path):
    from megagate.frontier.trials import replayed_loss_spikes

    assert replayed_loss_spikes(grid / "a_lr1_s1", warmup_steps=4) == 1  # the +3 nats at step 30
    assert replayed_loss_spikes(grid / "a_lr1_s0", warmup_steps=4) == 0
    # a rule allowing no spike: "a" at 1.0 fails on seed 1 as well as on delta; the brackets are unchanged
    spec = FrontierSpec(config="c", variants=("a",), lo=0.01, hi=1.0, seeds=(0, 1), rule=HealthRule(delta=5.0))
    assert grid_result([grid], spec).brackets["a"] == Bracket(0.1, 1.0)


def test_ordering_and_pairs_the_grid_cannot_separate():
    grid = {"x": Bracket(0.03, 0.1), "y": Bracket(0.03, 0.1), "z": Bracket(0.1, 1.0), "w": Bracket(1.0, None)}
    front = {
        "x": Bracket(0.0562, 0.1),
        "y": Bracket(0.0316, 0.0562),
        "z": Bracket(0.178, 0.316),
        "w": Bracket(1.0, None),
    }
    agree, ties = same_order(grid, front)
    assert agree and ties == ["x/y"]
    assert ordering(front) == "w (>= 1) > z (0.178) > x (0.0562) > y (0.0316)"
    assert ordering(grid) == "w (>= 1) > z (0.1) > x = y (0.03)"
    assert not same_order(grid, {**front, "z": Bracket(0.01, 0.0316)})[0]
    assert math.isinf(float("inf"))


def test_megagate_report_prints_the_frontier_next_to_the_grid(grid, tmp_path, capsys):
    state, _ = frontier_state(tmp_path)
    out = tmp_path / "frontier"
    out.mkdir()
    state_mod.save(out, state)
    assert main(["report", str(out), str(grid), "--out", str(tmp_path / "r")]) == 0
    text = capsys.readouterr().out
    assert "side by side with the grid in" in text and "same ordering as the grid: yes" in text
    assert (tmp_path / "r" / "frontier.txt").exists() and (tmp_path / "r" / "frontier_lr.png").exists()
    assert runfiles.read_json(tmp_path / "r" / "frontier_report.json")["grid"]["runs"] == 12
