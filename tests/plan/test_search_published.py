"""`megagate plan --search` against NVIDIA's published layouts (by the planner's own estimates): Llama-3-70B on 64
H100 and Qwen3-30B-A3B on 16 H100 (Megatron Bridge 26.04.01) within 5 % of the search's best — where they are not,
the gap is listed with why (docs/planning.md, "NVIDIA's layouts against `--search`")."""

from __future__ import annotations

import dataclasses

import pytest

from megagate import config_reader as C
from megagate.distributed.layout import stage_layers
from megagate.model.model_config import ParallelConfig
from megagate.plan import published as P
from megagate.plan.core import plan
from megagate.plan.search import search

LLAMA, QWEN = "bridge-26.04.01-llama3-70b-h100-fp8", "bridge-26.04.01-qwen3-30b-h100-fp8"
# NVIDIA's own later fix of its Llama-3-70B H100 layout (perf_recipes/llama/h100/llama3.py, Bridge 56ae11d, Aug 2026:
# "the default split leaves the first and last stages heavier than the middle ones")
LLAMA_LAYOUT = "Et*2|(t*2|)*34,t*3|(t*2|)*3,tL"
GAPS = {
    # the even split of 26.04.01 leaves the last stage 2 layers + the 128k-vocabulary output layer heavier (16 %
    # over the others); the layout NVIDIA pinned later is within 3 % (asserted below)
    LLAMA: 1.09,
    # at micro-batch 2 (76 of 80 GB in the plan) the fitted MoE host sync per layer pass is paid half as often and
    # the expert GEMMs are twice as tall: 18 % faster by the planner; NVIDIA publishes no micro-batch-2 EP16 run
    QWEN: 1.19,
}


def _run(run_id: str) -> P.Run:
    return next(r for r in P.load_runs() if r.id == run_id)


def _search(run: P.Run):
    cfg = C.from_dict(P.run_config(run, P.model_fields()[run.entry["model"]]), environment=False)
    own = plan(cfg, run.workload.world, run.gpu, gpus_per_node=run.gpus_per_node)
    cands = search(cfg, run.workload.world, run.gpu, gpus_per_node=run.gpus_per_node)
    return own, cands


@pytest.mark.slow
@pytest.mark.parametrize("run_id", [LLAMA, QWEN])
def test_nvidia_layout_against_the_search(run_id: str) -> None:
    run = _run(run_id)
    own, cands = _search(run)
    assert own.fits and cands
    ratio = own.time.total / cands[0].plan.time.total
    same_micro = [c for c in cands if c.plan.workload.micro_batch == run.workload.micro_batch]
    ratio_same_micro = own.time.total / same_micro[0].plan.time.total
    print(f"{run_id}: NVIDIA {own.time.total:.2f} s, best {cands[0].label} {cands[0].plan.time.total:.2f} s, "
          f"x{ratio:.3f}; at NVIDIA's micro-batch x{ratio_same_micro:.3f}")  # fmt: skip
    assert ratio <= GAPS.get(run_id, 1.05)
    if run_id == QWEN:  # the whole gap is the micro-batch: at NVIDIA's own, its layout is the search's best
        assert ratio_same_micro <= 1.05
    if run_id == LLAMA:  # NVIDIA's later balanced layout of the same PP 8 x VP 5 is within 5 %
        layers = stage_layers(
            ParallelConfig(
                pipeline_model_parallel_size=8,
                virtual_pipeline_model_parallel_size=5,
                pipeline_model_parallel_layout=LLAMA_LAYOUT,
            ),
            80,
        )
        balanced = P.predict(run, workload=dataclasses.replace(run.workload, stage_layers=layers)).total
        assert balanced / cands[0].plan.time.total <= 1.05
