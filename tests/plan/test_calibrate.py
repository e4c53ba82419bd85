"""`megagate calibrate`: the overhead solve on hand-made timings, and a real (short) calibration of this machine whose
profile `megagate plan --profile` reads."""

from __future__ import annotations

import json

import pytest

from helpers import forked
from megagate.calibrate import collectives, framework
from megagate.plan import curves
from megagate.plan import profile as profile_mod


def test_overheads_and_scales_solve_the_hand_made_step_times() -> None:
    """Timings built from known overheads (ms): per step 5, per layer and step 0.5, per micro-batch 3, per layer 2,
    gate 0.25, MoE block 1, per expert 0.4, and from modelled work that takes 1.6x (GEMMs), 1.3x (attention) and 2.5x
    (the rest) its modelled time inside a step; the non-negative least-squares fit of the eighteen timings gives them
    back."""
    truth = dict(per_step=5, per_layer_step=0.5, per_microbatch=3, per_layer=2, per_layer_gate=0.25,
                 per_layer_moe=1, per_expert=0.4)  # fmt: skip
    scales = {"gemm_scale": 1.6, "attention_scale": 1.3, "work_scale": 2.5}
    # modelled (GEMM, attention, rest) ms per micro-batch: small for the tiny variants, dominant for the larger ones
    work = {
        "work-gemm-1": (10.0, 1.0, 3.0),
        "work-attention-1": (1.5, 7.0, 1.0),
        "work-loss-1": (3.0, 0.5, 5.0),
        "work-moe2-1": (3.0, 2.0, 3.0),
    }

    def modelled(name: str, m: int) -> tuple[float, ...]:
        layers = framework.VARIANTS[name]["num_layers"]
        tiny = (0.1 * layers, 0.05 * layers, 0.3 * layers + 0.05 * len(name))
        return tuple(m * x for x in work.get(name, tiny))

    def step(name: str, m: int) -> float:
        v = framework.VARIANTS[name]
        layers, experts = v["num_layers"], v.get("num_experts", 0)
        per_mb = truth["per_microbatch"] + layers * (
            truth["per_layer"]
            + (truth["per_layer_gate"] if "gate" in v else 0)
            + ((truth["per_layer_moe"] + experts * truth["per_expert"]) if experts else 0)
        )
        device = sum(scales[k] * x for k, x in zip(framework.SCALES, modelled(name, m)))
        return truth["per_step"] + layers * truth["per_layer_step"] + m * per_mb + device

    measured = {n: {m: step(n, m) for m in (1, 2)} for n in framework.VARIANTS}
    model = {n: {m: modelled(n, m) for m in (1, 2)} for n in framework.VARIANTS}
    values, notes = framework.solve(measured, model)
    assert notes == []
    for k, v in {**truth, **scales}.items():
        assert values[k] == pytest.approx(v, rel=1e-6), k

    # a GPU's fit: the scales stay 1 and the overheads come from the timings minus the modelled work
    def extra(n: str, m: int) -> float:  # what the scales add over the modelled work
        return sum((scales[k] - 1) * x for k, x in zip(framework.SCALES, model[n][m]))

    plain = {n: {m: step(n, m) - extra(n, m) for m in (1, 2)} for n in framework.VARIANTS}
    values, notes = framework.solve(plain, model, fit_scale=False)
    assert [values[k] for k in framework.SCALES] == [1.0, 1.0, 1.0]
    for k, v in truth.items():
        assert values[k] == pytest.approx(v, rel=1e-6), k
    # out of time before the work-dominated variants (a small budget): the scales stay 1, the overheads still fitted
    tiny = [n for n in framework.VARIANTS if "work" not in framework.VARIANTS[n]]
    values, notes = framework.solve({n: plain[n] for n in tiny}, model)
    assert [values[k] for k in framework.SCALES] == [1.0, 1.0, 1.0] and "the in-step scales are 1" in notes[0]
    for k, v in truth.items():
        assert values[k] == pytest.approx(v, rel=1e-6), k
    # only the dense pair (the least calibrate measures): its four overheads, the gate's and MoE's left at 0
    values, notes = framework.solve({n: plain[n] for n in ("dense-1", "dense-2")}, model)
    for k in ("per_step", "per_layer_step", "per_microbatch", "per_layer"):
        assert values[k] == pytest.approx(truth[k], rel=1e-6), k
    assert values["per_layer_gate"] == values["per_layer_moe"] == values["per_expert"] == 0.0
    # noise that would make an exact solve negative: the non-negative fit keeps every field >= 0 and says which are 0
    measured["dense-2"][2] -= 15
    values, notes = framework.solve(measured, model)
    assert min(values.values()) >= 0 and notes and all("fitted as 0" in n for n in notes)


@pytest.mark.slow
@pytest.mark.distributed
def test_calibrate_writes_a_profile_plan_reads(tmp_path) -> None:
    out = tmp_path / "cpu.json"
    # `megagate calibrate` and `megagate plan` forked from the preloaded server (helpers.forked); calibrate's two
    # collective ranks are its own processes, as on any machine
    run = forked.run_cli(["calibrate", "--out", str(out), "--budget-s", "90", "--ranks", "2"], timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    p = profile_mod.load(str(out))
    assert p.kind == "cpu" and set(p.gemm) == {"fp32", "bf16"} and {"sdpa", "local"} <= set(p.attention)
    assert p.memory_bandwidth > 1e8 and p.host.serial and p.threads >= 1
    assert len(p.samples["gemm_fp32"]) >= 6 and set(p.samples["framework"]["measured"]) == set(framework.VARIANTS)
    assert "2" in p.local_ranks and p.intra.bandwidth > 0  # the two-rank gloo world was measured
    # the link is fitted on the collectives timed after compute (as the trainer calls them), not the idle ones
    world = p.samples["collectives"]
    for kind in ("all_gather", "all_reduce"):
        assert [b for b, _ in world[kind]] == [b for b, _ in world["idle_" + kind]] and len(world[kind]) == 4
    busy, _ = curves.fit_link([tuple(x) for x in world["all_gather"] + world["all_reduce"]])
    assert (p.intra.latency, p.intra.bandwidth) == pytest.approx((busy.latency, busy.bandwidth), rel=1e-9)
    plan = ["plan", "examples/tiny_cpu.yaml", "--nodes", "1", "--gpus-per-node", "1", "--profile", str(out), "--json"]
    planned = forked.run_cli(plan, timeout=300)
    assert planned.returncode == 0, planned.stderr
    step = json.loads(planned.stdout)["time"]["step_s"]
    assert 1e-3 < step < 60  # a tiny model's step on a CPU: milliseconds to seconds


def test_gemm_timings_that_do_not_grow_with_the_work_are_one_line(monkeypatch) -> None:
    """On a busy machine the GEMM timings can shrink as the work grows: no curve with a positive rate fits, and
    calibrate says so in one line (a MegagateError, exit 2) rather than a traceback."""
    from megagate.calibrate import core, measure
    from megagate.errors import MegagateError

    monkeypatch.setattr(measure, "bandwidth", lambda seconds: (1e10, 0.0, 0))
    shapes = [(m, 256, 256) for m in (4, 64, 1024)]
    # the larger the GEMM, the shorter its time: noise, not a device
    monkeypatch.setattr(
        measure, "gemm_samples", lambda dt, seconds: [(*s, 1e-3 / (i + 1)) for i, s in enumerate(shapes)]
    )
    with pytest.raises(MegagateError, match=r"the fp32 GEMM timings of 3 shapes do not grow with their work") as e:
        core.calibrate(5.0, ranks=1, log=lambda line: None)
    assert "\n" not in str(e.value) and "--budget-s" in str(e.value)


def test_grouped_gemm_timings_too_few_or_flat_give_no_curve_not_a_traceback() -> None:
    """The grouped GEMM section's share of the budget can run out after one token count, or its few timings can
    shrink as the work grows (a noisy moment): calibrate then times experts as one GEMM each. Before, fit_gemm's
    ValueError ended the calibration with a traceback."""
    from megagate.calibrate import core

    # (experts, tokens per expert, n, k, seconds): 8 experts of 128 x 64
    assert core.grouped_curve([]) is None
    assert core.grouped_curve([(8, 1, 128, 64, 1e-4)]) is None  # one token count: no curve
    assert core.grouped_curve([(8, 1, 128, 64, 1e-3), (8, 8, 128, 64, 5e-4), (8, 32, 128, 64, 2e-4)]) is None
    # per expert 2*t*128*64 FLOPs at 1 GFLOP/s plus 10 us: the rate and latency come back
    good = [(8, t, 128, 64, 8 * (1e-5 + 2 * t * 128 * 64 / 1e9)) for t in (1, 8, 32, 128)]
    curve = core.grouped_curve(good)
    assert curve is not None and curve.rate == pytest.approx(1e9, rel=1e-6)
    assert curve.latency == pytest.approx(1e-5, rel=1e-6) and curve.half == 0.0


def test_a_collective_is_timed_after_the_compute_before_it(monkeypatch) -> None:
    """`before` (the compute every rank runs first) runs after the barrier and outside the timed span, once per
    repetition: on a clock that only the two advance, 30 s of compute before a 1 s collective time 1 s."""
    clock = [0.0]
    calls: list[str] = []
    monkeypatch.setattr(collectives.time, "perf_counter", lambda: clock[0])

    def step(name: str, seconds: float):
        def run() -> None:
            calls.append(name)
            clock[0] += seconds

        return run

    seconds = collectives._time(step("fn", 1.0), 3, lambda: calls.append("barrier"), step("before", 30.0))
    assert calls == ["fn"] + ["barrier", "before", "fn"] * 3
    assert seconds == 1.0
