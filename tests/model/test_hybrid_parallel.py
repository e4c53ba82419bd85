"""A tiny hybrid (Gated DeltaNet + gated attention, MoE with a gated shared expert) under TP 2 (dense; and MoE with
sequence parallelism), PP 2 and EP 2 over
gloo with 2 real processes equals the single-process model: losses and every gradient."""

import pytest

from helpers import distributed, hybrid_workers

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("mode", ["tp", "tpsp", "pp", "ep"])
def test_hybrid_parallel_equals_one_process(tmp_path, mode):
    results = distributed.run(hybrid_workers.hybrid_worker, 2, tmp_path, mode, 2)
    for r in results:
        assert r["gdn_params"] > 0  # every rank holds Gated DeltaNet layers (PP: both stages)
        assert r["grad"] < 1e-5 * max(1.0, r["grad_scale"]), (mode, r)
    last = [r for r in results if r["num_losses"]]
    assert last and all(r["num_losses"] == 2 and r["loss"] < 1e-5 for r in last), (mode, results)
