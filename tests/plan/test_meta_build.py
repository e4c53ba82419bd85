"""The planner's per-rank parameters and buffers EQUAL what megatron builds, rank role by rank role.

Each case builds every pipeline stage (and virtual chunk) on the meta device under torch's fake process group of the
full world size (tests/plan/meta_ranks.py, one process per layout, forked by helpers.forked: a fake world cannot
share a process with the gloo worlds of other tests) and compares, exactly: the parameter list (names, sizes, expert flag, shared-embedding
flag), megatron's distributed-optimizer buffer layout (padded size and buckets, dense and expert) and the real
elements every data-parallel rank's optimizer shard covers.
"""

from __future__ import annotations

import json
import os

import pytest

from helpers import forked
from megagate.model import gate as gates
from megagate.model.presets import model_preset
from megagate.plan.params import RankShape, chunk_params, rank_buffers

HERE = os.path.dirname(__file__)

CASES = [
    # preset, gate, world, TP, PP, VPP, EP
    ("tiny", "g1-elementwise", 8, 2, 2, 0, 1),  # tied embedding across stages, 16-element QK-norms (alignment)
    ("tiny-moe", "g5-elementwise", 8, 1, 2, 0, 2),  # a separate gate weight, expert buffer
    ("1.7b-48l", "g1-headwise", 32, 2, 4, 2, 1),  # VPP chunks, TP, tied embedding over 4 stages
    ("1.7b-28l", "g1-elementwise", 64, 2, 2, 0, 1),
    ("15a2b-moe", "g1-elementwise", 64, 1, 1, 0, 8),  # the paper's 8x8 layout
    ("15a2b-moe", "g1-elementwise", 64, 2, 2, 0, 8),
    ("15a2b-moe", "g1-elementwise", 128, 1, 4, 0, 16),
    ("tiny-hybrid", "g1-elementwise", 8, 1, 2, 0, 2),  # GDN layers on both stages, a gated shared expert, EP
    ("tiny-hybrid", "g1-elementwise", 8, 2, 2, 2, 1),  # VPP: each chunk one layer of GGG* (stage 1 chunk 1: attention)
]


def _meta_ranks(argv: list[str]) -> None:
    import meta_ranks  # in the child only: it installs torch's fake process-group backend

    meta_ranks.main(argv)


def _built(case: tuple) -> list[dict]:
    argv = [*map(str, case)]
    out = forked.run(_meta_ranks, argv, argv=[os.path.join(HERE, "meta_ranks.py"), *argv], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("JSON:"))
    return json.loads(line[5:])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_planner_matches_megatron_meta_build(case: tuple) -> None:
    preset, gate, world, tp, pp, vpp, ep = case
    model = model_preset(preset, gate=gates.preset(gate))
    dp = world // (tp * pp)
    shape = RankShape(tp, pp, vpp or None, ep, 1, dp, world // (tp * ep * pp))
    built = _built(case)
    assert len(built) == pp
    for stage in built:
        r = stage["pp_rank"]
        assert (stage["dp"], stage["expert_dp"]) == (shape.dp, shape.expert_dp)
        planned_buffers = iter(rank_buffers(model, shape, r, fp32_norms=True))  # torch norms: fp32 weights
        for c, chunk in enumerate(stage["chunks"]):
            planned = [[p.name, p.numel, p.expert, p.shared_embedding] for p in chunk_params(model, shape, r, c)]
            assert planned == [p[:4] for p in chunk["params"]], f"stage {r} chunk {c}"
            norms = {p[0] for p in chunk["params"] if p[4] == "torch.float32"}
            fp32 = not model.norm_zero_centered  # megagate's zero-centred norm: params_dtype weights
            assert norms == {p.name for p in chunk_params(model, shape, r, c) if p.is_norm and fp32}
            for got in chunk["buffers"]:  # megatron's buffer order: groups by their first parameter
                mine = next(planned_buffers)
                assert (mine.expert, mine.fp32) == (got["expert"], got["fp32"])
                assert mine.numel == got["numel"]
                assert [list(b) for b in mine.buckets] == got["buckets"]
                assert [mine.owned(i) for i in range(mine.dp)] == got["owned"]
    total = sum(p[1] for s in built for c in s["chunks"] for p in c["params"])
    print(f"{case}: {total:,} parameters over the stages of one TP/EP rank")
