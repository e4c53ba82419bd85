"""Who the others wait for (megagate.health.arrival), the intermittent-straggler report built on it, and the job
slowdown with no culprit (megagate.health.slowdown): pure, from progress records written as the watchdog writes them.
"""

from __future__ import annotations

import pytest

from megagate.analysis.health_report import _describe
from megagate.health.arrival import arrivals, p90
from megagate.health.slowdown import SlowdownDetector, phase_medians
from megagate.health.straggler import LateReport, StragglerDetector, StragglerReport

REDUCE = 0.010  # the reduction itself: what the last rank to arrive waits


def stalled(first: int, last: int, stall_every: int = 2, stall: float = 0.4, compute: float = 0.1) -> dict:
    """Records of 2 ranks: rank 1's compute grows by `stall` on every `stall_every`-th step (a stall that comes and
    goes); on the other steps the ranks take turns arriving last, 1 ms apart (noise)."""
    recent = {0: [], 1: []}
    totals = {0: [], 1: []}
    entered = {0: [], 1: []}
    for s in range(first, last + 1):
        if s % stall_every == 0:
            c = {0: compute, 1: compute + stall}
            w = {0: REDUCE + stall, 1: REDUCE}
        else:
            c = {0: compute, 1: compute}
            w = {0: REDUCE + 0.001, 1: REDUCE} if s % 4 == 1 else {0: REDUCE, 1: REDUCE + 0.001}
        last = max(c, key=lambda r: (c[r], -w[r]))  # the one that waits least came last
        for r in (0, 1):
            recent[r].append([s, c[r], w[r]])
            totals[r].append([s, c[r] + w[r] + 0.02])  # + data, optimizer, callbacks
            # entered grad_sync: the step's start + its compute (+ 1 ms for the noise's last comer)
            entered[r].append([s, 1000.0 + s + c[r] + (0.001 if r == last and c[0] == c[1] else 0.0)])
    return {
        r: {"host": f"h{r}", "stage": 0, "recent": recent[r], "totals": totals[r], "arrivals": entered[r]}
        for r in (0, 1)
    }


def window(recs: dict) -> tuple[dict, dict, dict]:
    steps = {r: {s: (c, w) for s, c, w in rec["recent"]} for r, rec in recs.items()}
    totals = {r: {s: t for s, t in rec["totals"]} for r, rec in recs.items()}
    entered = {r: {s: t for s, t in rec.get("arrivals", [])} for r, rec in recs.items()}
    return steps, totals, entered


def test_the_last_to_arrive_and_what_it_costs():
    a = arrivals(*window(stalled(1, 20)))
    late, other = a[1], a[0]
    # 10 stalled steps, and half of the 10 others (the noise's turns: steps 3, 7, 11, 15, 19 are rank 0's)
    assert late.steps == 20 and late.last_share == pytest.approx(15 / 20) and other.last_share == pytest.approx(5 / 20)
    # the others lost 0.4 s on each stalled step and 1 ms on each noise step: per step of the window
    assert late.lost_s == pytest.approx((10 * 0.4 + 5 * 0.001) / 20)
    assert other.lost_s == pytest.approx(5 * 0.001 / 20)
    # the mean step: half the steps 0.1305 (the median of the ranks' 0.130 and 0.131), half 0.53
    assert late.step_s == pytest.approx((0.1305 + 0.53) / 2)
    assert late.slowdown == pytest.approx(late.step_s / (late.step_s - late.lost_s))
    assert late.compute_mean_s == pytest.approx(0.3) and late.compute_p90_s == pytest.approx(0.5)
    assert late.others_p90_s == pytest.approx(0.1) and other.slowdown == pytest.approx(1.0, abs=1e-3)
    assert p90([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 9 and p90([3.0]) == 3.0
    assert late.late_steps == 10 and other.late_steps == 0  # 0.4 s each > half the median step (0.33 s / 2)
    # the same steps without entry times (the wait gap alone): the same figures
    steps, totals, _ = window(stalled(1, 20))
    assert arrivals(steps, totals)[1].lost_s == pytest.approx(late.lost_s)


def test_a_stall_inside_the_reduction_or_a_skewed_clock_blames_no_one():
    recs = stalled(1, 20)
    steps, totals, entered = window(recs)
    # rank 1 stalls 0.4 s inside the reduction on every step (it had arrived first): both wait long, rank 1 longer;
    # by waits alone rank 0 (the shorter wait) would be the one the others waited 0.4 s for
    steps = {r: {s: (0.1, 0.4 + (0.001 if r == 1 else 0.0)) for s in steps[r]} for r in (0, 1)}
    entered = {r: {s: 1000.0 + s + (0.001 if r == 0 else 0.0) for s in steps[r]} for r in (0, 1)}
    a = arrivals(steps, totals, entered)
    assert a[0].last_share == 1.0 and a[0].lost_s == pytest.approx(0.001) and a[0].slowdown < 1.01
    # rank 1's clock 50 ms ahead: it "enters" last on every step, but the waits say 1 ms at most
    steps, totals, entered = window(stalled(1, 20, stall_every=1000))
    entered[1] = {s: t + 0.05 for s, t in entered[1].items()}
    a = arrivals(steps, totals, entered)
    assert a[1].last_share == 1.0 and a[1].lost_s <= 0.001 and a[1].slowdown < 1.01


def test_an_intermittent_straggler_is_reported_where_the_fastest_step_sees_nothing():
    det = StragglerDetector(margin=0.25, windows=2)
    first = det.observe(stalled(1, 20))
    assert first.ratios[1] == pytest.approx(1.0) and first.reports == ()  # its fastest step is normal
    assert first.costs[1] > 1.25 and first.costs[0] == pytest.approx(1.0, abs=1e-3)
    (report,) = det.observe(stalled(1, 40)).reports
    assert isinstance(report, LateReport) and (report.rank, report.host, report.step, report.windows) == (
        1,
        "h1",
        40,
        2,
    )
    assert report.line() == (
        "straggler: rank 1 (h1) arrived last in 75 % of steps; the others waited 200 ms/step (61 % of the step) for "
        "it; its compute p90 5.0x the others' (mean 300 ms, p90 500 ms, slowest 500 ms), the job 2.54x slower for 2 windows up to "
        "step 40"
    )
    event = report.to_dict()
    assert event["kind"] == "straggler" and event["pattern"] == "intermittent" and event["rank"] == 1
    assert _describe(event).startswith("step 40: rank 1 (h1) arrived last in 75 % of steps")
    # a rank stalling on one step in ten, 0.1 s: the job 1.07x slower, under the margin
    det = StragglerDetector(margin=0.25, windows=1)
    summary = det.observe(stalled(1, 20, stall_every=10, stall=0.1))
    assert summary.reports == () and 1.0 < summary.costs[1] < 1.25


def test_one_late_step_is_a_hiccup_not_a_pattern():
    # one stall of 1 s in a window of 4 steps of 0.13 s: the job 3x slower over the window, but a rank descheduled
    # once (a loaded machine) is no intermittent straggler
    det = StragglerDetector(margin=0.25, windows=1)
    summary = det.observe(stalled(1, 4, stall_every=4, stall=1.0))
    assert summary.costs[1] > 2.5 and summary.reports == ()
    (report,) = det.observe(stalled(5, 12, stall_every=4, stall=1.0)).reports  # two in a window: reported
    assert report.arrival.late_steps == 2


def test_a_rank_slow_on_every_step_stays_the_steady_report():
    recs = stalled(1, 20, stall_every=1, stall=0.1)  # every step 0.2 s: 2x, and late on every step
    (report,) = StragglerDetector(margin=0.25, windows=1).observe(recs).reports
    assert isinstance(report, StragglerReport) and report.ratio == pytest.approx(2.0)
    assert report.to_dict()["pattern"] == "steady"


def uniform(first: int, last: int, compute: float, wait: float, rest: float) -> dict:
    recent = [[s, compute, wait] for s in range(first, last + 1)]
    totals = [[s, compute + wait + rest] for s in range(first, last + 1)]
    return {r: {"host": f"h{r}", "stage": 0, "recent": recent, "totals": totals} for r in (0, 1)}


def test_a_job_slower_alike_on_every_rank_names_the_phase_that_grew():
    det = StragglerDetector(margin=0.25, windows=2)
    assert det.observe(uniform(1, 10, 0.5, 0.1, 0.1)).slowdown is None  # warm-up: not the baseline
    assert det.observe(uniform(1, 20, 0.1, 0.01, 0.02)).slowdown is None  # the baseline: 130 ms
    assert det.observe(uniform(1, 30, 0.1, 0.2, 0.02)).slowdown is None  # one slow window
    summary = det.observe(uniform(1, 40, 0.1, 0.2, 0.02))
    assert summary.reports == ()  # no rank stands out
    report = summary.slowdown
    assert report.ratio == pytest.approx(0.32 / 0.13) and report.windows == 2
    assert report.line() == (
        "slowdown: the job's step takes 320 ms, 2.46x its early median (130 ms at steps 11-20), every rank alike, "
        "for 2 windows up to step 40; grew most: grad_sync +190 ms (forward_backward +0 ms, data, optimizer and "
        "callbacks +0 ms)"
    )
    assert report.to_dict()["kind"] == "slowdown" and _describe(report.to_dict()).startswith("step 40: the job's")
    assert det.observe(uniform(1, 50, 0.1, 0.01, 0.02)).slowdown is None and det.slowdown.streak == 0  # recovered


def test_no_slowdown_when_a_straggler_explains_it():
    det = SlowdownDetector(margin=0.25, windows=1)
    steps, totals, _ = window(uniform(1, 10, 0.1, 0.01, 0.02))
    det.observe(10, phase_medians(steps, totals))
    det.observe(20, phase_medians(steps, totals))
    steps, totals, _ = window(uniform(21, 30, 0.3, 0.01, 0.02))
    assert det.observe(30, phase_medians(steps, totals), explained=True) is None
    assert det.observe(40, phase_medians(steps, totals)).grown["forward_backward"] == pytest.approx(0.2)


def test_late_share_gates_the_report_and_its_setting_is_checked():
    # rank 1 holds 4.005 s of the 4.010 s lost to late ranks; rank 0, 5 ms: 0.999 and 0.001
    blame = arrivals(*window(stalled(1, 20)))
    assert blame[1].blame == pytest.approx(4.005 / 4.010) and blame[0].blame == pytest.approx(0.005 / 4.010)
    det = StragglerDetector(margin=0.25, windows=1, late_share=0.9995)
    assert det.observe(stalled(1, 20)).reports == ()
    (report,) = StragglerDetector(margin=0.25, windows=1, late_share=0.99).observe(stalled(1, 20)).reports
    assert report.rank == 1
    from megagate.errors import ConfigError
    from megagate.health.config import StragglerConfig

    assert StragglerConfig().late_share == 0.5
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError, match=r"^straggler.late_share=.* must be a share in \[0, 1\)"):
            StragglerConfig.from_dict({"late_share": bad})


def test_bad_files_and_settings_found_by_the_issue_are_one_line_each(tmp_path):
    """A heartbeat that busy-loops, a frontier.json whose trials is a list, config.json fields of the wrong kind."""
    from megagate.errors import ConfigError, MegagateError
    from megagate.frontier.state import FrontierState
    from megagate.health.config import WatchdogConfig
    from megagate.interop.hf_config import model_config_from_hf

    with pytest.raises(ConfigError, match=r"^watchdog.heartbeat_s=1e-06 is below 0.05 s: the watchdog thread would"):
        WatchdogConfig(heartbeat_s=1e-6)
    path = tmp_path / "frontier.json"
    with pytest.raises(MegagateError, match=r"frontier.json: trials is a list, not a dict \(not a frontier state"):
        FrontierState.from_dict({"version": 1, "trials": []}, path)
    base = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "vocab_size": 256, "max_position_embeddings": 128, "rope_theta": 10000, "rms_norm_eps": 1e-6,
    }  # fmt: skip
    model_config_from_hf(base)
    for key, value, message in [
        ("rms_norm_eps", "tiny", "config.json rms_norm_eps='tiny' must be a positive number"),
        ("num_hidden_layers", -2, "config.json num_hidden_layers=-2 must be a positive integer"),
        ("hidden_size", 64.5, "config.json hidden_size=64.5 must be a positive integer"),
    ]:
        with pytest.raises(ConfigError) as exc:
            model_config_from_hf({**base, key: value})
        assert str(exc.value) == message
