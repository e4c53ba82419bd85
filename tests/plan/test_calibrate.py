"""`megagate calibrate`: the overhead solve on hand-made timings, and a real (short) calibration of this machine whose
profile `megagate plan --profile` reads."""

from __future__ import annotations

import json

import pytest

from helpers import forked
from megagate.calibrate import framework
from megagate.plan import profile as profile_mod


def test_overheads_solve_the_hand_made_step_times() -> None:
    """Timings built from known overheads (ms): per step 5, per layer and step 0.5, per micro-batch 3, per layer 2,
    gate 0.25, MoE block 1, per expert 0.4; the modelled work (1 ms per layer and micro-batch) is subtracted; the
    non-negative least-squares fit of the ten timings gives them back."""
    truth = dict(per_step=5, per_layer_step=0.5, per_microbatch=3, per_layer=2, per_layer_gate=0.25,
                 per_layer_moe=1, per_expert=0.4)  # fmt: skip

    def step(layers: int, m: int, gate: bool = False, experts: int = 0) -> float:
        per_mb = truth["per_microbatch"] + layers * (
            truth["per_layer"]
            + (truth["per_layer_gate"] if gate else 0)
            + ((truth["per_layer_moe"] + experts * truth["per_expert"]) if experts else 0)
        )
        return truth["per_step"] + layers * truth["per_layer_step"] + m * per_mb + m * layers * 1.0

    measured = {
        "dense-1": {m: step(1, m) for m in (1, 2)},
        "dense-2": {m: step(2, m) for m in (1, 2)},
        "gate-1": {m: step(1, m, gate=True) for m in (1, 2)},
        "moe2-1": {m: step(1, m, experts=2) for m in (1, 2)},
        "moe4-1": {m: step(1, m, experts=4) for m in (1, 2)},
    }
    modelled = {n: {m: m * (2 if n == "dense-2" else 1) * 1.0 for m in (1, 2)} for n in measured}
    values, notes = framework.solve(measured, modelled)
    assert notes == []
    for k, v in truth.items():
        assert values[k] == pytest.approx(v, rel=1e-6), k
    # noise that would make an exact solve negative: the non-negative fit keeps every field >= 0 and says which are 0
    measured["dense-2"][2] -= 15
    values, notes = framework.solve(measured, modelled)
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
    plan = ["plan", "examples/tiny_cpu.yaml", "--nodes", "1", "--gpus-per-node", "1", "--profile", str(out), "--json"]
    planned = forked.run_cli(plan, timeout=300)
    assert planned.returncode == 0, planned.stderr
    step = json.loads(planned.stdout)["time"]["step_s"]
    assert 1e-3 < step < 60  # a tiny model's step on a CPU: milliseconds to seconds
