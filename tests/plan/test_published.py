"""The planner against published Megatron runs (megagate/plan/published_runs.yaml): the data and its sources, the
error on the held-out runs with the shipped constants, and NVIDIA's layout against the planner's best."""

from __future__ import annotations

import pytest

from megagate.plan import published as P
from megagate.plan.devices import GPUS
from megagate.yamlfile import load_mapping


@pytest.fixture(scope="module")
def runs() -> list[P.Run]:
    return P.load_runs()


def test_the_data_and_its_sources(runs) -> None:
    data = load_mapping(P.DATA)
    assert len(runs) >= 12 and len({r.id for r in runs}) == len(runs)
    for e in data["runs"]:
        source = data["sources"][e["source"]]
        assert source["url"].startswith("https://") and e.get("row"), e["id"]
        if source["repo"]:
            assert len(source["commit"]) == 40 and source["path"], e["id"]
        given = [k for k in ("tokens_per_s_per_gpu", "step_s", "tflops_per_gpu") if k in e]
        assert given, e["id"]  # a published figure, copied with its row
        assert e["use"] in ("fit", "held-out") and e["gpu"] in GPUS
    kinds = {(r.moe, r.gpu.startswith("h100"), r.workload.precision) for r in runs}
    assert {m for m, _, _ in kinds} == {True, False}  # dense and MoE
    assert {h for _, h, _ in kinds} == {True, False}  # H100 and B200/GB200
    assert {p for _, _, p in kinds} == {"bf16", "fp8"}
    assert sum(r.use == "held-out" for r in runs) >= 10


def test_megatron_flop_count_is_the_one_nvidia_divides_by(runs) -> None:
    """Where a row gives both tokens/s and TFLOP/s, their ratio is the FLOPs per token NVIDIA counted: the formula
    that converts the TFLOP/s-only rows must give it (within the rows' rounding; NeMo 2.0's own counter, for the
    Mixtral row, counts 4 % more)."""
    checked = 0
    for r in runs:
        e = r.entry
        if "tokens_per_s_per_gpu" in e and "tflops_per_gpu" in e:
            counted = e["tflops_per_gpu"] * 1e12 / e["tokens_per_s_per_gpu"]
            tolerance = 0.05 if e["source"] == "nemo-25.04" else 0.03
            assert P.megatron_flops_per_token(r.workload.model, r.workload.seq) == pytest.approx(counted, rel=tolerance)
            checked += 1
    assert checked >= 10


def test_held_out_error(runs) -> None:
    """With the shipped constants (fitted on the `fit` runs only): median |error| <= 15 %, none worse than 35 %,
    on the held-out runs."""
    errs = P.errors(runs)
    held = P.summary(errs, runs)["held-out"]
    assert held["median"] <= 0.15, held
    assert held["worst"] <= 0.35, {k: v for k, v in errs.items() if abs(v) > 0.35}


# Configurations whose NVIDIA layout the planner puts more than 10 % behind its best, with why (docs/planning.md).
LAYOUT_GAPS = {
    # the recipes' bf16 gradients (perf.grad_reduce_in_fp32: false) brought TP2 PP8 VPP6 EP16 under 80 GB in the
    # estimate: EP inside the node, the inter-node hop on PP (NVIDIA's own guideline); no EP16 run is published
    "bridge-26.04.01-qwen3-235b-h100-fp8": 1.20,
    # the best, TP1 PP1 EP64 inside the NVL72 domain, is what NVIDIA's later recipes of the model run; no BF16 figure
    "modelzoo-qwen3-235b-gb200-bf16": 1.12,
}


@pytest.mark.slow
def test_nvidia_layouts_against_the_planners_best(runs) -> None:
    """For each MoE configuration, the planner's step time of NVIDIA's layout over the fastest layout it finds for
    the same model, GPUs, batch and precision (memory-checked): within 10 % for every configuration but the
    listed ones (within their bound)."""
    ratios = {}
    for r in P.layout_check_runs(runs):
        _, best, fitting = P.best_layout(r)
        assert fitting > 10
        ratios[r.id] = P.predict(r).total / best
    assert len(ratios) >= 8
    assert all(ratio <= LAYOUT_GAPS.get(rid, 1.10) for rid, ratio in ratios.items()), ratios


def test_plan_config_reads_every_published_setting():
    """One mapping: each published run written as a megagate config (`published.run_config`) gives, through the
    trainer's own resolve and the planner's `core.workload` (what `megagate plan CONFIG` runs), the run's workload
    field by field (layout, ETP, split, recompute, dispatcher, TP/EP overlap, FSDP, precision) and the same step time."""
    import dataclasses

    from megagate import config_reader as C
    from megagate.machine import Machine
    from megagate.plan import published as P
    from megagate.plan.core import device_profile, workload
    from megagate.plan.time import step_time
    from megagate.run_setup import resolve
    from megagate.yamlfile import load_mapping

    models = load_mapping(P.DATA)["models"]
    runs = P.load_runs()
    assert len(runs) >= 29
    for run in runs:
        cfg = C.from_dict(P.run_config(run, models[run.entry["model"]]), environment=False)
        setup = resolve(cfg, run.workload.world, Machine.target(cfg))
        ours = workload(setup, device_profile(run.gpu), run.gpus_per_node, 1.0)
        theirs = run.workload
        # the model section carries what the planner's Workload keeps beside it (recompute, the context length)
        model = dataclasses.replace(
            ours.model, max_sequence_length=theirs.model.max_sequence_length, recompute_granularity=None
        )
        assert model == theirs.model, run.id
        for f in dataclasses.fields(theirs):
            if f.name not in ("model", "notes", "stage_layers", "etp"):
                assert getattr(ours, f.name) == getattr(theirs, f.name), (run.id, f.name)
        assert ours.layers() == theirs.layers() and ours.expert_tp == theirs.expert_tp, run.id
        profile = device_profile(run.gpu)
        assert step_time(ours, profile, ranks_per_node=run.gpus_per_node).total == pytest.approx(
            P.predict(run).total, rel=1e-12
        ), run.id
