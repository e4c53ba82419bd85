"""The gate on every head layout: each attention preset x {MHA, GQA 4, GQA 2, MQA} x {local, sdpa, fused-norm} x
{fp32, bf16}, forward and backward, at TP 1 (one process) and TP 2 (one gloo process pair for all cells), against
the fp64 reference; G1 elementwise also against megatron-core's own `attention_output_gate` layer with the same
core attention, bit for bit. The cells and the tolerances are helpers.gate_matrix's."""

from __future__ import annotations

import pytest
import torch

from helpers import gate_matrix as gm
from megagate.errors import ConfigError
from megagate.model.attention import GatedSelfAttention


def _failures(key, errors: dict[str, float], exact: float | None) -> list[str]:
    dtype_name = key[-1]
    bad = [
        f"{key} {t}: {e:.3g} > {gm.tolerance(dtype_name, t):.3g}"
        for t, e in errors.items()
        if not e <= gm.tolerance(dtype_name, t)
    ]
    if exact is not None and exact != 0.0:
        bad.append(f"{key}: differs from megatron's attention_output_gate by {exact:.3g}")
    return bad


@pytest.mark.parametrize("variant", gm.MATRIX)
def test_every_layout_backend_and_dtype_at_tp1(megatron_world, variant):
    bad = []
    for lay, groups in gm.LAYOUTS.items():
        for backend in gm.BACKENDS:
            ref = gm.reference_run(variant, groups, backend, 1e-6)
            for dtype_name in gm.DTYPES:
                errors, exact = gm.compare_cell(variant, groups, backend, dtype_name, ref)
                assert len(errors) >= 4  # output, input gradient, and the layer's parameters
                bad += _failures((variant, lay, backend, dtype_name), errors, exact)
    assert not bad, "\n".join(bad)


def test_mha_g1_logits_need_the_copy_megatron_makes(megatron_world):
    """With one query head per group the G1 logits are a strided view of linear_qkv's output (the regression: a
    `view` to the output's shape raised); with several they are already contiguous."""
    seen = {}

    for groups in (8, 2):
        module, _, _ = gm.build_ours("g1-elementwise", groups, "sdpa", torch.float32)
        x = torch.randn(gm.SEQ, gm.BATCH, gm.HIDDEN)
        _, _, _, logits = GatedSelfAttention.get_query_key_value_tensors(module, x, output_gate=True)
        seen[groups] = logits.is_contiguous()
        module(x, None)  # the whole forward runs on both
    assert seen == {8: False, 2: True}


def test_the_tolerances_catch_a_wrong_gate_row(megatron_world):
    """The bf16 bound is far below what a gate applied to the wrong head costs: swap two heads' gate rows."""
    ref = gm.reference_run("g1-elementwise", 8, "sdpa", 1e-6)
    params = dict(ref["params"])
    w = params["linear_qkv.weight"].clone()  # MHA: per head [q | gate | k | v], 4 x 8 rows each
    rows = 4 * gm.HEAD_DIM
    g0, g1 = slice(gm.HEAD_DIM, 2 * gm.HEAD_DIM), slice(rows + gm.HEAD_DIM, rows + 2 * gm.HEAD_DIM)
    w[g0], w[g1] = ref["params"]["linear_qkv.weight"][g1], ref["params"]["linear_qkv.weight"][g0]
    params["linear_qkv.weight"] = w
    module, _, _ = gm.build_ours("g1-elementwise", 8, "sdpa", torch.bfloat16)
    x, grad = gm.inputs()
    out, _, _ = gm.run_module(module, params, x, grad, torch.bfloat16)
    assert gm.worst(out, ref["out"]) > 5 * gm.tolerance("bf16", "out")


@pytest.mark.distributed
def test_every_cell_at_tp2_in_one_process_pair(tmp_path):
    from helpers import distributed

    results = distributed.run(gm.matrix_worker, 2, tmp_path, gm.MATRIX)
    bad, refused = [], set()
    for rank, cells in enumerate(results):
        assert len(cells) == len(gm.MATRIX) * len(gm.LAYOUTS) * len(gm.BACKENDS) * len(gm.DTYPES)
        for key, result in cells.items():
            if isinstance(result, str):
                refused.add(key[:2])
                assert "\n" not in result and "tensor_model_parallel_size (2)" in result, result
                continue
            bad += _failures((rank, *key), *result)
    assert not bad, "\n".join(bad)
    expected = {(v, lay) for v in gm.MATRIX for lay, g in gm.LAYOUTS.items() if gm.refused_under_tp(v, g, 2)}
    assert refused == expected and expected  # g2/g3 headwise and truncated-input g2 on MQA, nothing else


def test_refusals_are_one_line_before_building():
    from megagate.model.gate import preset
    from megagate.model.gate_params import check_gate_tensor_parallel
    from megagate.model.qkv_layout import check_tensor_parallel

    with pytest.raises(ConfigError, match=r"^num_query_groups \(3\) must be a multiple or a divisor of .*\(2\)$"):
        check_tensor_parallel(6, 3, 2)
    with pytest.raises(ConfigError, match=r"^num_attention_heads \(6\) must be divisible by"):
        check_tensor_parallel(6, 2, 4)
    check_tensor_parallel(8, 1, 8)  # MQA at TP 8: megatron replicates the group
    with pytest.raises(ConfigError, match=r"fused qkv projection has 81 rows .* \(2\) does not divide"):
        check_gate_tensor_parallel(preset("g2-headwise"), 32, 8, 1, 8, 2)
    # a parameter per KV group cannot follow a replicated group (no preset has one; the table refuses it)
    kv_param = preset("g2-headwise").__class__(position="g2", input="input_independent")
    with pytest.raises(ConfigError, match=r"^gate parameter gate_param \[1, 8\] has 1 rows .* \(2\) cannot split"):
        check_gate_tensor_parallel(kv_param, 32, 8, 1, 8, 2)
