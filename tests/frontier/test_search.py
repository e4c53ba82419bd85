"""The pure frontier search (megagate.frontier.search / rule) and the early-stop rule (megagate.monitor.early_stop),
driven by synthetic trial outcomes: where the bracket ends, which trials it asks for, in which order, and why."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from megagate.errors import ConfigError
from megagate.frontier.rule import HEALTHY, UNHEALTHY, HealthRule, TrialOutcome, point_status
from megagate.frontier.search import bracket_of, coarse_points, decades, judge, midpoint, plan_variant
from megagate.monitor.early_stop import EarlyStopConfig, EarlyStopRule

LO, HI, SEEDS = 1e-2, 1.0, (0, 1, 2)


def world(frontier: float, bad_seed_at: dict[float, int] | None = None):
    """Trials of a variant whose loss is flat (4.9 + 0.02 per seed) up to `frontier` and 1 nat worse above (those are
    stopped at a rung, step 75); `bad_seed_at`: an LR where one seed fails anyway."""

    def run(lr: float, seed: int) -> TrialOutcome:
        if lr > frontier * (1 + 1e-9) or (bad_seed_at or {}).get(lr) == seed:
            return TrialOutcome(75, False, "rung", "clearly worse at step 75")
        return TrialOutcome(300, True, valid_loss=4.9 + 0.02 * seed + 0.01 * math.log10(lr / LO))

    return run


DEFAULT_RULE = HealthRule()
SCIENCE = Path(__file__).resolve().parents[2] / "docs" / "science"


def logged_science_trials(folder: str) -> tuple[dict[tuple[str, float, int], TrialOutcome], dict]:
    """A logged frontier search of the CPU study (docs/science/FOLDER): every trial's outcome keyed (variant, lr,
    seed), completed by the runs of the 48-run grid its report was written beside (grid runs are judged on their
    final validation loss and the spikes logged after warm-up), and the search's settings."""
    report = json.loads((SCIENCE / folder / "frontier_report.json").read_text())
    spec, known = report["spec"], {}
    for run in json.loads((SCIENCE / folder / "aggregate.json").read_text())["runs"]:
        if run["sweep"] == "qk-off":
            spikes = sum(step > spec["warmup_steps"] for step in run["event_steps"])
            known[(run["variant"], run["lr"], run["seed"])] = TrialOutcome(
                run["steps"], True, valid_loss=run["valid_loss"], loss_spikes=spikes
            )
    for variant, result in report["variants"].items():
        for t in result["trials"]:
            completed = t["outcome"] == "completed"
            spikes = re.match(r"(\d+) loss spikes after warm-up", t["why"])
            known[(variant, t["lr"], t["seed"])] = TrialOutcome(
                t["steps"],
                completed,
                None if completed else t["outcome"].removeprefix("stopped: "),
                t["why"],
                t["valid_loss"],
                loss_spikes=int(spikes.group(1)) if completed and spikes else 0,
            )
    return known, spec


def search(run, rule=DEFAULT_RULE, seeds=SEEDS, coarse=2, resolution=0.25, lo=LO, hi=HI, limit=40, schedule="wide"):
    """Drive the planner to the end like the driver does (every request run, in rounds); the rounds and the plan."""
    outcomes, rounds = {}, []
    for _ in range(limit):
        plan = plan_variant(lo, hi, coarse, resolution, seeds, rule, outcomes, schedule)
        if plan.done:
            return plan, rounds, outcomes
        assert plan.requests and not set(plan.requests) & set(outcomes), "a request repeats a trial"
        rounds.append((plan.phase, plan.requests))
        outcomes.update({key: run(*key) for key in plan.requests})
    raise AssertionError("the search did not end")


def test_lattice():
    assert coarse_points(1e-2, 1.0, 2) == [0.01, 1.0]
    assert coarse_points(1e-2, 1.0, 3) == [0.01, 0.1, 1.0]
    assert midpoint(0.01, 1.0) == 0.1
    assert midpoint(0.01, 0.1) == 0.0316228
    assert decades(0.0316228, 0.0562341) == pytest.approx(0.25, abs=1e-6)


def test_bisection_to_a_quarter_decade_then_confirms_on_every_seed():
    plan, rounds, outcomes = search(world(0.05))
    phases = [p for p, _ in rounds]
    assert phases == ["anchor", "coarse", "bisect", "bisect", "bisect", "confirm"]
    assert rounds[0][1] == ((0.01, 0),)  # the anchor alone: its curve is the next rounds' rung reference
    assert [r[1] for r in rounds[2:5]] == [((0.1, 0),), ((0.0316228, 0),), ((0.0562341, 0),)]
    assert rounds[5][1] == ((0.0316228, 1), (0.0316228, 2))  # the other seeds at h, at once
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (0.0316228, 0.0562341)
    assert plan.bracket.width == pytest.approx(0.25, abs=1e-6)
    assert len(outcomes) == 7  # against 9 LRs x 3 seeds for the full grid at this resolution


def test_a_seed_failing_at_h_moves_the_bracket_down_and_bisects_again():
    plan, rounds, _ = search(world(0.05, bad_seed_at={0.0316228: 2}))
    assert [p for p, _ in rounds][-3:] == ["confirm", "bisect", "confirm"]
    # h = 0.0316 failed seed 2: the bracket (0.01, 0.0316) is half a decade wide, so 0.0178 is bisected, confirmed
    assert rounds[-2][1] == ((0.0177828, 0),)
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (0.0177828, 0.0316228)


def test_healthy_up_to_the_top_and_below_the_range():
    plan, rounds, _ = search(world(10.0))
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (1.0, None)
    assert plan.bracket.describe().startswith(">= 1")
    assert [p for p, _ in rounds] == ["anchor", "coarse", "confirm"]
    plan, rounds, _ = search(world(1e-3))
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (None, 0.01)
    assert [p for p, _ in rounds] == ["anchor", "coarse"]  # one failing seed decides an LR under the all-seeds rule


def test_majority_rule_confirms_both_ends():
    rule = HealthRule(min_healthy_seeds=2)
    plan, rounds, _ = search(world(0.05), rule=rule)
    confirm = [r for p, r in rounds if p == "confirm"]
    # h needs one more healthy seed (2 of 3), u one more failing seed (2 failures > 3 - 2)
    assert confirm == [((0.0316228, 1), (0.0562341, 1))]
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (0.0316228, 0.0562341)


def test_delta_rule_against_the_variants_best_and_the_verdict_reasons():
    rule = HealthRule(delta=0.5, max_loss_spikes=1)
    outcomes = {
        (0.01, 0): TrialOutcome(300, True, valid_loss=4.9),
        (0.1, 0): TrialOutcome(300, True, valid_loss=5.5),  # 0.6 above the best
        (0.03, 0): TrialOutcome(300, True, valid_loss=5.0, loss_spikes=2),
        (0.05, 0): TrialOutcome(300, True, valid_loss=4.95, diverged=True),
        (1.0, 0): TrialOutcome(120, False, "nonfinite", "diverged: non-finite loss nan at step 120"),
    }
    status, verdicts = judge(outcomes, (0,), rule)
    assert verdicts[(0.01, 0)] == (HEALTHY, "final validation loss 4.9000")
    assert verdicts[(0.1, 0)] == (UNHEALTHY, "final validation loss 5.5000 > best 4.9000 + delta 0.5")
    assert verdicts[(0.03, 0)][1] == "2 loss spikes after warm-up > 1"
    assert verdicts[(0.05, 0)] == (UNHEALTHY, "diverged")
    assert verdicts[(1.0, 0)] == (UNHEALTHY, "diverged: non-finite loss nan at step 120")
    bracket, notes = bracket_of(status)
    assert (bracket.healthy, bracket.unhealthy) == (0.01, 0.03)
    assert notes == ()


def test_non_monotone_response_is_noted_first_failure_wins():
    outcomes = {
        (0.01, 0): TrialOutcome(300, True, valid_loss=4.9),
        (0.1, 0): TrialOutcome(75, False, "rung", "worse"),
        (1.0, 0): TrialOutcome(300, True, valid_loss=5.0),
    }
    bracket, notes = bracket_of(judge(outcomes, (0,), HealthRule())[0])
    assert (bracket.healthy, bracket.unhealthy) == (0.01, 0.1)
    assert notes == ("healthy again above 0.1 at 1 (not used: first failure wins)",)


FIXED = HealthRule(delta=0.5, reference=4.9)


def test_fixed_reference_runs_no_anchor_and_judges_each_trial_alone():
    plan, rounds, outcomes = search(world(0.05), rule=FIXED)
    # the lower bound is assumed healthy and never run: the bracket does not end next to it
    assert [p for p, _ in rounds] == ["coarse", "bisect", "bisect", "bisect", "confirm"]
    assert rounds[0][1] == ((1.0, 0),)
    assert (0.01, 0) not in outcomes and len(outcomes) == 6
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (0.0316228, 0.0562341)
    # the verdict names the fixed reference, and does not move when a better trial appears
    worse = {(0.1, 0): TrialOutcome(300, True, valid_loss=5.45)}
    assert judge(worse, (0,), FIXED)[1][(0.1, 0)] == (
        UNHEALTHY,
        "final validation loss 5.4500 > reference 4.9 + delta 0.5",
    )
    worse[(0.01, 0)] = TrialOutcome(300, True, valid_loss=4.0)  # 1.45 above this best, still 0.05 above 5.4
    assert judge(worse, (0,), FIXED)[1][(0.1, 0)][0] == UNHEALTHY
    worse[(0.1, 0)] = TrialOutcome(300, True, valid_loss=5.39)  # 1.39 above the best, within the fixed reference
    assert judge(worse, (0,), FIXED)[1][(0.1, 0)] == (HEALTHY, "final validation loss 5.3900")


def test_fixed_reference_tests_the_lower_bound_when_the_bracket_ends_on_it():
    plan, rounds, _ = search(world(0.012), rule=FIXED)
    # 1, 0.1, 0.0316, 0.0178 fail: the bracket (lo, 0.0178) is a quarter decade, so lo itself is run, then confirmed
    assert [r for _, r in rounds[1:4]] == [((0.1, 0),), ((0.0316228, 0),), ((0.0177828, 0),)]
    assert rounds[4] == ("anchor", ((0.01, 0),))
    assert rounds[5] == ("confirm", ((0.01, 1), (0.01, 2)))
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (0.01, 0.0177828)
    plan, rounds, _ = search(world(1e-3), rule=FIXED)
    assert rounds[-1] == ("anchor", ((0.01, 0),))
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (None, 0.01)


def test_decisive_seeds_skip_the_confirmation():
    # every seed of world() ends at 4.9-4.96, more than 0.3 below the threshold 5.4: the first seed decides
    rule = HealthRule(delta=0.5, reference=4.9, decisive=0.3)
    plan, rounds, outcomes = search(world(0.05), rule=rule)
    assert [p for p, _ in rounds] == ["coarse", "bisect", "bisect", "bisect"]
    assert len(outcomes) == 4 and (plan.bracket.healthy, plan.bracket.unhealthy) == (0.0316228, 0.0562341)
    # 0.25 below the threshold is not decisive: the other seeds still run, and a failing one decides the point
    near = {(0.03, 0): TrialOutcome(300, True, valid_loss=5.15)}
    status, _ = judge(near, SEEDS, rule)
    assert status[0.03].decided is None
    near[(0.03, 1)] = TrialOutcome(300, True, valid_loss=5.41)
    assert judge(near, SEEDS, rule)[0][0.03].decided == UNHEALTHY
    # decisively bad on one seed decides unhealthy even under a majority rule
    majority = HealthRule(delta=0.5, reference=4.9, decisive=0.3, min_healthy_seeds=2)
    bad = {(0.3, 0): TrialOutcome(300, True, valid_loss=5.9)}
    assert judge(bad, SEEDS, majority)[0][0.3].decided == UNHEALTHY and judge(bad, SEEDS, majority)[0][0.3].decisive
    assert not judge(near, SEEDS, rule)[0][0.03].decisive  # decided by the failing seed, as the count rule says
    assert judge({(0.3, 0): TrialOutcome(300, True, valid_loss=5.6)}, SEEDS, majority)[0][0.3].decided is None


def test_thrifty_probes_the_middle_first_and_runs_the_top_only_when_the_bracket_rests_on_it():
    wide = search(world(0.05), rule=FIXED)[2]
    plan, rounds, outcomes = search(world(0.05), rule=FIXED, schedule="thrifty")
    # 0.1 fails, so the top is never needed; the seeds at h are confirmed one per round
    assert rounds == [
        ("bisect", ((0.1, 0),)),
        ("bisect", ((0.0316228, 0),)),
        ("bisect", ((0.0562341, 0),)),
        ("confirm", ((0.0316228, 1),)),
        ("confirm", ((0.0316228, 2),)),
    ]
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (0.0316228, 0.0562341)
    assert (1.0, 0) in wide and (1.0, 0) not in outcomes and len(outcomes) == len(wide) - 1
    # healthy in the middle: the bracket rests on the assumed top, which is run next and ends the search there
    plan, rounds, _ = search(world(10.0), rule=FIXED, schedule="thrifty")
    assert [r for _, r in rounds] == [((0.1, 0),), ((1.0, 0),), ((1.0, 1),), ((1.0, 2),)]
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (1.0, None)
    # with an anchor (the variant's-best rule) the lower bound is run first, then the middle, never the top here
    plan, rounds, outcomes = search(world(0.05), schedule="thrifty")
    assert [r for _, r in rounds][:2] == [((0.01, 0),), ((0.1, 0),)] and (1.0, 0) not in outcomes
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (0.0316228, 0.0562341)


def test_thrifty_settles_a_healthy_point_near_the_threshold_before_probing_above_it():
    # seeds end at 4.90-4.96, 0.14-0.2 below the threshold 5.1: healthy, never decisive (0.3)
    near = HealthRule(delta=0.2, reference=4.9, decisive=0.3)
    # 0.0316 passes on seed 0 and fails on seed 1: settled before 0.0562 is ever probed, and the failing seed ends
    # the point (seed 2 never runs there); the search goes on below it
    plan, rounds, outcomes = search(world(0.05, bad_seed_at={0.0316228: 1}), rule=near, schedule="thrifty")
    assert rounds[:4] == [
        ("bisect", ((0.1, 0),)),
        ("bisect", ((0.0316228, 0),)),
        ("confirm", ((0.0316228, 1),)),
        ("bisect", ((0.0177828, 0),)),
    ]
    assert (0.0316228, 2) not in outcomes and (0.0562341, 0) not in outcomes
    assert (plan.bracket.healthy, plan.bracket.unhealthy) == (0.0177828, 0.0316228)
    # decisive first seeds (more than 0.3 below 5.4) let the bisection move on, and need no other seed
    plan, rounds, outcomes = search(world(0.05), rule=HealthRule(reference=4.9, decisive=0.3), schedule="thrifty")
    assert [p for p, _ in rounds] == ["bisect", "bisect", "bisect"] and len(outcomes) == 3


def replay(folder: str, schedule: str) -> dict[str, tuple[float | None, float | None, int]]:
    """Each variant's (h, u, trial-steps) when the search is replayed on a logged study's outcomes."""
    known, spec = logged_science_trials(folder)
    out = {}
    for variant in spec["variants"]:
        plan, _, outcomes = search(
            lambda lr, seed, v=variant: known[(v, lr, seed)], rule=HealthRule(**spec["rule"]), schedule=schedule
        )
        out[variant] = (plan.bracket.healthy, plan.bracket.unhealthy, sum(o.steps for o in outcomes.values()))
    return out


def test_the_thrifty_schedule_replays_the_wide_searchs_study_under_forty_percent_of_the_grid():
    """Trials are deterministic on one machine, so a schedule is replayed exactly from logged outcomes. The wide
    search of docs/science/frontier-wide gives back its own 6,366 trial-steps; the thrifty schedule on the same
    trials (and one grid run: sandwich norm at 0.1) reaches the same brackets with 5,466, 38.0 % of the 48-run
    grid's 14,400."""
    assert replay("frontier-wide", "wide") == {
        "baseline": (0.0316228, 0.0562341, 1800),
        "g1-elementwise": (0.177828, 0.316228, 2466),
        "g1-headwise": (0.0562341, 0.1, 1800),
        "sandwich-norm": (1.0, None, 300),
    }
    thrifty = replay("frontier-wide", "thrifty")
    assert thrifty == {
        "baseline": (0.0316228, 0.0562341, 1500),
        "g1-elementwise": (0.177828, 0.316228, 1866),
        "g1-headwise": (0.0562341, 0.1, 1500),
        "sandwich-norm": (1.0, None, 600),
    }
    assert sum(s for *_, s in thrifty.values()) == 5466 <= 0.40 * 48 * 300


def test_the_thrifty_run_of_the_cpu_study_is_what_its_schedule_replays():
    """docs/science/frontier: the real thrifty search (and the grid beside it, run on the same machine and code;
    the five completed trials at grid points equal the grid's runs). Replaying the schedule on its outcomes asks for
    exactly the trials it ran: 5,486 trial-steps, 38.1 % of the 48-run grid, the same brackets as the wide search."""
    assert replay("frontier", "thrifty") == {
        "baseline": (0.0316228, 0.0562341, 1500),
        "g1-elementwise": (0.177828, 0.316228, 1886),
        "g1-headwise": (0.0562341, 0.1, 1500),
        "sandwich-norm": (1.0, None, 600),
    }
    report = json.loads((SCIENCE / "frontier" / "frontier_report.json").read_text())
    assert report["spec"]["schedule"] == "thrifty" and report["spent_trial_steps"] == 5486
    assert report["grid"]["trial_steps"] == 14400 and 5486 <= 0.40 * 14400


def test_point_status_counts():
    rule = HealthRule()
    assert point_status({0: HEALTHY}, 3, rule).decided is None
    assert point_status({0: HEALTHY}, 3, rule).leaning == HEALTHY
    assert point_status({0: UNHEALTHY}, 3, rule).decided == UNHEALTHY
    assert point_status({0: HEALTHY, 1: HEALTHY, 2: HEALTHY}, 3, rule).decided == HEALTHY


@pytest.mark.parametrize(
    "rule, seeds, message",
    [
        (HealthRule(delta=-0.1), 3, "--delta -0.1 can never pass"),
        (HealthRule(max_loss_spikes=-1), 3, "--max-loss-spikes -1 can never pass"),
        (HealthRule(min_healthy_seeds=4), 3, "--min-healthy-seeds 4 can never pass with 3 seed(s)"),
        (HealthRule(min_healthy_seeds=0), 3, "--min-healthy-seeds 0 must be at least 1"),
        (HealthRule(reference=-0.6), 3, "--reference -0.6 + --delta 0.5 can never pass"),
        (HealthRule(reference=math.inf), 3, "--reference inf must be a finite number of nats"),
        (HealthRule(decisive=-1.0), 3, "--decisive -1 must be >= 0 nats"),
    ],
)
def test_rules_that_can_never_pass_are_refused(rule, seeds, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        rule.validate(seeds)


# --- the trial-side early-stop rule ---------------------------------------------------------------------------------
def test_early_stop_rules_fire_at_their_step():
    rule = EarlyStopRule(EarlyStopConfig(nonfinite=True), warmup_steps=3)
    assert [rule.observe(s, x) for s, x in [(1, 7.0), (2, 6.5)]] == [None, None]
    decision = rule.observe(3, math.nan)
    assert (decision.rule, decision.step) == ("nonfinite", 3)

    rule = EarlyStopRule(EarlyStopConfig(above_start=True, window=2), warmup_steps=3)
    # in the warm-up a loss above the start does not count; after it the mean of the last 2 losses does
    assert [rule.observe(s, x) for s, x in [(1, 7.0), (2, 8.0), (3, 9.0), (4, 6.0)]] == [None, None, None, None]
    decision = rule.observe(5, 8.5)  # mean(6.0, 8.5) = 7.25 > 7.0
    assert (decision.rule, decision.step) == ("above_start", 5)
    assert "7.25 > first loss 7" in decision.reason

    rule = EarlyStopRule(EarlyStopConfig(max_loss_spikes=1), warmup_steps=3)
    assert rule.observe(2, 7.0, loss_spike=True) is None  # warm-up
    assert rule.observe(5, 7.0, loss_spike=True) is None  # the one allowed
    assert rule.observe(6, 7.0, loss_spike=True).rule == "loss_spikes"

    cfg = EarlyStopConfig(rungs=((4, 5.0), (8, 4.0)), margin=0.5, window=2)
    rule = EarlyStopRule(cfg, warmup_steps=0)
    for s, x in [(1, 7.0), (2, 6.0), (3, 5.6), (4, 5.3)]:  # rung 4: mean(5.6, 5.3) = 5.45 <= 5.5
        assert rule.observe(s, x) is None
    state = rule.state_dict()
    resumed = EarlyStopRule(cfg, warmup_steps=0)
    resumed.load_state_dict(state)  # a resumed run decides exactly as the uninterrupted one
    for r in (rule, resumed):
        assert [r.observe(s, x) for s, x in [(5, 5.0), (6, 4.8), (7, 4.7)]] == [None, None, None]
        decision = r.observe(8, 4.6)  # mean(4.7, 4.6) = 4.65 > 4.0 + 0.5
        assert (decision.rule, decision.step) == ("rung", 8)


def test_early_stop_config_refusals():
    with pytest.raises(ConfigError, match="monitor.early_stop.rungs steps"):
        EarlyStopConfig.from_dict({"rungs": [[10, 5.0], [5, 4.0]]})
    with pytest.raises(ConfigError, match="must be a list of"):
        EarlyStopConfig.from_dict({"rungs": [[10, "x"]]})
    with pytest.raises(ConfigError, match="margin=-1"):
        EarlyStopConfig(margin=-1)
    with pytest.raises(ConfigError, match="monitor.early_stop.abort is not a known key"):
        EarlyStopConfig.from_dict({"abort": True})
    assert not EarlyStopConfig().enabled and EarlyStopConfig(control_file="/x").enabled
