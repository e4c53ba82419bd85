"""The gate variants seen in practice: 2·sigmoid, zero-initialised gate weights, a gate reading only the first
input_fraction·h channels of X. The fp64 forward/backward cells of every layout are tests/model/test_gate_matrix.py's
(g1-2sigmoid, g1-input-half and the truncated-input gates of helpers.gate_matrix.EXTRA_GATES); here: the formula,
the initial weights (exact zeros, the other rows untouched, TP 2 = TP 1), the identity at the start, PP 2 = PP 1,
TP 2 = TP 1 on the whole model, parameter counts and the refusals."""

from __future__ import annotations

import pytest
import torch

from helpers import gate_matrix as gm
from helpers.gate_practice import SEED
from megagate.errors import ConfigError
from megagate.model import gate as gates
from megagate.model import init
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.gate_params import gate_parameter_count
from megagate.model.presets import model_preset
from megagate.model.qkv_layout import qkv_layout

NEW_PRESETS = ["g1-2sigmoid", "g1-zero-init", "g1-2sigmoid-zero-init", "g1-input-half"]


def test_2sigmoid_is_twice_the_sigmoid_and_one_at_zero():
    z = torch.linspace(-30, 30, 601, dtype=torch.float64)
    scores = gates.gate_scores(z.float(), "2sigmoid")
    assert scores.dtype == torch.float32
    assert (scores.double() - 2.0 / (1.0 + torch.exp(-z))).abs().max().item() < 1e-6
    assert gates.gate_scores(torch.zeros(3), "2sigmoid").tolist() == [1.0, 1.0, 1.0]
    assert gates.ACTIVATIONS["2sigmoid"].positive  # so combine='additive' is refused with it


def _initialised(model) -> dict[str, torch.Tensor]:
    """The tiny GPT at TP 1 in this process, initialised layout-independently: {name: parameter}."""
    gpt = build_gpt_model(model, transformer_config(model))
    init.initialize([gpt], seed=SEED, std=model.init_method_std, num_layers=model.num_layers)
    return dict(gpt.named_parameters())


def _gate_rows(gate, model) -> torch.Tensor:
    keys = qkv_layout(gate, model.num_attention_heads, model.num_query_groups, model.head_dim).row_keys()
    return torch.tensor([k[0] in ("q_gate", "kv_gate") for k in keys])


@pytest.mark.parametrize(
    "fields",
    [
        {},  # G1 elementwise: rows fused into linear_qkv
        {"position": "g2", "granularity": "headwise"},  # one kv-side row per group, fused
        {"input_fraction": 0.5},  # its own projection gate_weight
        {"sharing": "head_shared"},  # shared_gate_weight
        {"position": "g5"},  # output_gate_weight
    ],
    ids=["g1", "g2-headwise", "g1-input-half", "g1-head-shared", "g5"],
)
def test_zero_init_zeroes_the_gate_weights_and_nothing_else(megatron_world, fields):
    base = gates.GateConfig(**fields)
    zero = gates.GateConfig(**fields, init="zeros")
    model0, model1 = model_preset("tiny", gate=base), model_preset("tiny", gate=zero)
    default, zeroed = _initialised(model0), _initialised(model1)
    assert sorted(default) == sorted(zeroed)
    fused = base.fused_rows
    rows = _gate_rows(base, model0) if fused else None
    gate_names = {"gate_weight", "shared_gate_weight", "output_gate_weight"}
    checked = 0
    for name, p in zeroed.items():
        d = default[name]
        if fused and name.endswith("self_attention.linear_qkv.weight"):
            assert rows.any() and torch.equal(p[rows], torch.zeros_like(p[rows])), name
            assert d[rows].abs().min() > 0, name  # the default init draws them
            assert torch.equal(p[~rows], d[~rows]), name  # q, k, v rows: the default init's, bit for bit
            checked += 1
        elif name.rsplit(".", 1)[-1] in gate_names:
            assert torch.equal(p, torch.zeros_like(p)) and d.abs().min() > 0, name
            checked += 1
        else:
            assert torch.equal(p, d), name
    assert checked == model0.num_layers


def test_2sigmoid_zero_init_starts_as_the_ungated_layer(megatron_world):
    """2·σ(0) = 1 exactly: with zero gate rows the G1 2·sigmoid layer computes the baseline layer, bit for bit."""
    gated, model, _ = gm.build_ours("g1-2sigmoid-zero-init", 2, "sdpa", torch.float32)
    plain, _, _ = gm.build_ours("baseline", 2, "sdpa", torch.float32)
    rows = _gate_rows(model.gate, model)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.normal_()
            target = dict(gated.named_parameters())[name]
            if name == "linear_qkv.weight":
                target[~rows] = p
                target[rows] = 0.0
            else:
                target.copy_(p)
    x = torch.randn(gm.SEQ, gm.BATCH, gm.HIDDEN)
    assert torch.equal(gated(x, None)[0], plain(x, None)[0])
    # and it is a gate: non-zero rows change the output
    with torch.no_grad():
        dict(gated.named_parameters())["linear_qkv.weight"][rows] = 1.0
    assert not torch.allclose(gated(x, None)[0], plain(x, None)[0])


@pytest.mark.distributed
def test_tp2_initial_weights_equal_tp1(tmp_path):
    from helpers import distributed
    from helpers.gate_practice import init_worker

    for report in distributed.run(init_worker, 2, tmp_path, NEW_PRESETS):
        assert set(report) == set(NEW_PRESETS)
        for variant, r in report.items():
            assert r["names"] and r["diff"] == 0.0, (variant, r)
        assert any(n.endswith("self_attention.gate_weight") for n in report["g1-input-half"]["sharded"])


@pytest.mark.distributed
def test_tp2_model_equals_tp1(tmp_path):
    """Loss, every gradient and the checkpoint split of the whole tiny model at TP 2 against TP 1 (perturbed
    weights), for the new presets and the truncated input at the other projections."""
    from helpers import distributed, parallel_workers

    variants = [
        "g1-2sigmoid",
        "g1-input-half",
        gates.GateConfig(position="g2", input_fraction=0.25),
        gates.GateConfig(sharing="head_shared", input_fraction=0.5),
        gates.GateConfig(position="g5", input_fraction=0.5, activation="2sigmoid"),
    ]
    for rank_result in distributed.run(parallel_workers.tp_worker, 2, tmp_path, variants):
        assert len(rank_result) == len(variants)
        for variant, diff in rank_result.items():
            print(f"{variant}: |loss TP2 - TP1| {diff['loss']:.2e}, max |grad Δ| {diff['grad']:.2e}")  # pytest -s
            assert diff["loss"] < 1e-5, (variant, diff)
            assert diff["grad"] < 1e-5 * max(1.0, diff["grad_scale"]), (variant, diff)
            assert diff["checkpoint"] == [], (variant, diff)


@pytest.mark.distributed
def test_pp2_schedule_equals_pp1(tmp_path):
    from helpers import distributed, parallel_workers

    variants = ["g1-2sigmoid-zero-init", "g1-input-half"]
    results = distributed.run(parallel_workers.pp_worker, 2, tmp_path, variants, 4)
    for variant in variants:
        first, last = sorted((r[variant] for r in results), key=lambda r: r["stage"])
        assert last["num_losses"] == 4 and first["num_losses"] == 0
        assert last["loss"] < 1e-5, (variant, last)
        assert first["grad"] < 1e-5 and last["grad"] < 1e-5, (variant, first, last)


def test_parameter_counts_are_the_analytic_ones(megatron_world):
    """Per attention layer: G1 elementwise adds h·np·hn (fused rows), the truncated input (h/2)·np·hn; 2·sigmoid and
    zero init add nothing. The meta-device build of the tiny and the 1.7B models agrees (megagate variants --build)."""
    from megagate.commands.variants import parameter_table

    h, n, g, d = 2048, 16, 8, 128
    expected = {"g1-2sigmoid": h * n * d, "g1-zero-init": h * n * d, "g1-2sigmoid-zero-init": h * n * d}
    expected["g1-input-half"] = h // 2 * n * d
    for name, count in expected.items():
        assert gate_parameter_count(gates.preset(name), h, n, g, d) == count, name
    rows = parameter_table(("tiny", "1.7b-28l"), NEW_PRESETS, build=True)
    assert len(rows) == 2 * len(NEW_PRESETS)
    for row in rows:
        assert row["built"] == row["total"], row
    by = {(r["model"], r["variant"]): r for r in rows}
    assert by["1.7b-28l", "g1-input-half"]["gate"] == 28 * 1024 * 16 * 128
    assert by["1.7b-28l", "g1-2sigmoid"]["gate"] == 28 * 2048 * 16 * 128
    tiny = model_preset("tiny")
    assert by["tiny", "g1-input-half"]["gate"] == tiny.num_layers * tiny.hidden_size // 2 * 4 * 16


@pytest.mark.parametrize(
    "fields, hidden, message",
    [
        ({"activation": "2sigmod"}, 64, r"^gate\.activation='2sigmod' is not one of .*did you mean '2sigmoid'"),
        ({"init": "ones"}, 64, r"^gate\.init='ones' is not one of normal, zeros"),
        ({"input_fraction": 0}, 64, r"^gate\.input_fraction=0 must be a number in \(0, 1\]$"),
        ({"input_fraction": 1.5}, 64, r"^gate\.input_fraction=1\.5 must be a number in \(0, 1\]$"),
        ({"input_fraction": "half"}, 64, r"^gate\.input_fraction='half' must be a number"),
        ({"input_fraction": True}, 64, r"^gate\.input_fraction=True must be a number"),
        ({"input_fraction": 0.3}, 64, r"^gate\.input_fraction=0\.3 gives 19\.2 of hidden_size 64 .* 1\.\.64$"),
        ({"input_fraction": 0.01}, 64, r"^gate\.input_fraction=0\.01 gives 0\.64 of hidden_size 64"),
        ({"input_fraction": 0.5, "input": "input_independent"}, 64, r"needs a query-dependent gate"),
        ({"activation": "2sigmoid", "combine": "additive"}, 64, r"^gate\.combine='additive' with .*'2sigmoid'"),
        ({"position": "none", "init": "zeros"}, 64, r"^gate\.position='none' but gate fields are set: init='zeros'"),
    ],
)
def test_refusals_are_one_line(fields, hidden, message):
    with pytest.raises(ConfigError, match=message) as err:
        model_preset("tiny", gate=gates.GateConfig(**fields), hidden_size=hidden)
    assert "\n" not in str(err.value)
