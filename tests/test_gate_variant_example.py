"""docs/gate_variants.md's worked example (a biased sigmoid gate, σ(XW + b)), run from the doc's own code blocks.

The doc's three blocks are added to copies of the three registries it names (gate.ACTIVATIONS,
gate_params.ACTIVATION_PARAMETERS, gate.PRESETS) for each test; nothing else in megagate learns about the variant.
"""

import pytest
import torch
from megatron.core.transformer.spec_utils import build_module

from helpers import distributed, doc_example, parallel_workers, reference
from megagate.errors import ConfigError
from megagate.model import gate as gates
from megagate.model import init
from megagate.model.build import build_gpt_model, meta_parameter_count, transformer_config
from megagate.model.counts import parameter_counts
from megagate.model.gate_params import gate_parameter_count, gate_parameters
from megagate.model.presets import model_preset
from megagate.model.spec import gated_layer_spec

PRESET = "g1-biased-sigmoid"
SEQ, BATCH = 7, 3
H, N, G, D = 64, 4, 2, 16  # the tiny model


@pytest.fixture
def example(monkeypatch):
    """The doc's variant, registered for one test."""
    return doc_example.register(monkeypatch.setattr)


def test_doc_blocks_are_the_three_registries_verbatim():
    blocks = doc_example.registry_blocks()
    assert [(b.path, b.registry) for b in blocks] == [
        ("megagate/model/gate.py", "ACTIVATIONS"),
        ("megagate/model/gate_params.py", "ACTIVATION_PARAMETERS"),
        ("megagate/model/gate.py", "PRESETS"),
    ]
    for block in blocks:  # the declaration the doc shows is the one in the file
        source = (doc_example.ROOT / block.path).read_text(encoding="utf-8")
        assert f"\n{block.declaration}\n" in source, block.declaration


def test_registered_only_inside_the_fixture(example):
    assert example == {
        "megagate/model/gate.py:ACTIVATIONS": ["biased_sigmoid"],
        "megagate/model/gate_params.py:ACTIVATION_PARAMETERS": ["biased_sigmoid"],
        "megagate/model/gate.py:PRESETS": [PRESET],
    }
    gate = gates.preset(PRESET)
    assert gate == gates.GateConfig(activation="biased_sigmoid")
    with pytest.raises(ConfigError, match="gate.combine='additive' with gate.activation='biased_sigmoid' is not a"):
        gates.GateConfig(combine="additive", activation="biased_sigmoid")


def test_not_registered_outside_the_fixture():
    assert "biased_sigmoid" not in gates.ACTIVATIONS and PRESET not in gates.PRESETS
    with pytest.raises(ConfigError, match="gate.activation='biased_sigmoid' is not one of sigmoid, silu"):
        gates.GateConfig(activation="biased_sigmoid")


def test_table_shapes_and_the_doc_listing(example):
    table = gate_parameters(gates.preset(PRESET), H, N, G, D)
    rows = [(p.name, p.shape, p.tp_axis, p.init, p.role) for p in table]
    assert rows == [
        ("linear_qkv.weight", (64, 64), 0, "normal", "qkv_rows"),
        ("gate_bias", (4, 16), 0, "ones", "activation"),
    ]
    doc = doc_example.DOC.read_text(encoding="utf-8")
    for row in rows:
        assert " ".join(map(str, row)) in doc
    assert gate_parameter_count(gates.preset(PRESET), H, N, G, D) == 64 * 64 + 4 * 16

    # the bias follows the score shape at every position / granularity / sharing
    def bias(**fields):
        (entry,) = [
            p
            for p in gate_parameters(gates.GateConfig(activation="biased_sigmoid", **fields), H, N, G, D)
            if p.name == "gate_bias"
        ]
        return entry.shape, entry.tp_axis, entry.sequence_parallel_grad

    assert bias(sharing="head_shared") == ((1, 16), None, False)
    assert bias(position="g2", granularity="headwise") == ((2, 1), 0, False)
    assert bias(position="g5") == ((1, 64), None, True)
    # 1.7B-28L: np·hn = 16·128 = 2,048 bias parameters per layer on top of the G1 rows (the doc's number)
    big = gate_parameter_count(gates.preset(PRESET), 2048, 16, 8, 128)
    assert big - gate_parameter_count(gates.preset("g1-elementwise"), 2048, 16, 8, 128) == 2048


CASES = {
    "g1-head-specific": {},
    "g1-head-shared": {"sharing": "head_shared"},
    "g2-headwise": {"position": "g2", "granularity": "headwise"},
    "g5": {"position": "g5"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_plain_torch(megatron_world, example, case):
    gate = gates.from_dict(CASES[case], preset=PRESET)
    model = model_preset("tiny", gate=gate)
    config = transformer_config(model)
    attn = build_module(gated_layer_spec(config, gate).submodules.self_attention, config=config, layer_number=1)
    (bias_entry,) = [p for p in attn.gate_params if p.name == "gate_bias"]
    assert attn.gate_bias.shape == bias_entry.shape and torch.equal(attn.gate_bias, torch.ones(bias_entry.shape))

    w64 = reference.make_weights(gate, H, N, G, D, seed=7)
    gen = torch.Generator().manual_seed(8)
    w64["b"] = torch.randn(bias_entry.shape, dtype=torch.float64, generator=gen).requires_grad_()
    w32 = {k: v.detach().float().requires_grad_() for k, v in w64.items()}
    params32 = reference.module_params(w32, gate, N, G) | {"gate_bias": w32["b"]}
    assert set(params32) == {name for name, _ in attn.named_parameters()}

    x64 = torch.randn(SEQ, BATCH, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    x32 = x64.detach().float().requires_grad_()
    grad_out = torch.randn(SEQ, BATCH, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out32, _ = torch.func.functional_call(attn, params32, (x32, None))

    def biased_sigmoid(z):  # the doc's formula, written out: σ(z + b), b broadcast over [s, b]
        return torch.sigmoid(z + w64["b"])

    out64 = reference.attention(x64, w64, gate, N, G, config.layernorm_epsilon, score_fn=biased_sigmoid)
    torch.testing.assert_close(out32.double(), out64, atol=2e-6, rtol=1e-5)
    # the bias matters: the plain sigmoid gate on the same weights differs
    plain = reference.attention(x64.detach(), w64, gates.GateConfig(**CASES[case]), N, G, config.layernorm_epsilon)
    assert (plain - out64.detach()).abs().max() > 1e-3
    out32.backward(grad_out.float())
    out64.backward(grad_out)
    torch.testing.assert_close(x32.grad.double(), x64.grad, atol=5e-6, rtol=1e-4)
    for name in w64:
        torch.testing.assert_close(
            w32[name].grad.double(), w64[name].grad, atol=5e-6, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert w32["b"].grad.abs().max() > 1e-4


def test_gpt_model_counts_and_initialisation(megatron_world, example):
    model = model_preset("tiny", gate=gates.preset(PRESET))
    counts = parameter_counts(model)
    assert counts["gate"] == model.num_layers * (64 * 64 + 4 * 16)
    assert meta_parameter_count(model) == counts["total"]

    gpt = build_gpt_model(model, transformer_config(model))
    assert sum(p.numel() for p in gpt.parameters()) == counts["total"]
    biases = {n: p for n, p in gpt.named_parameters() if n.endswith("gate_bias")}
    assert sorted(biases) == [f"decoder.layers.{i}.self_attention.gate_bias" for i in range(model.num_layers)]
    with torch.no_grad():
        for p in biases.values():
            p.fill_(-5.0)
    init.initialize([gpt], seed=1234, std=model.init_method_std, num_layers=model.num_layers)
    for p in biases.values():
        assert torch.equal(p, torch.ones(4, 16))  # the table's rule, not a random normal
    # by name alone nothing would cover it: without the table the initialisation refuses instead of guessing
    with pytest.raises(
        ValueError, match="no initialisation rule covers parameter 'decoder.layers.0.self_attention.gate_b"
    ):
        init.rule_for("decoder.layers.0.self_attention.gate_bias")

    tokens = torch.randint(0, model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(9).unsqueeze(0).expand(2, -1)
    loss = gpt(tokens, position_ids, None, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    for p in biases.values():
        assert p.grad is not None and p.grad.abs().max() > 0


@pytest.mark.distributed
def test_tp2_equals_tp1(tmp_path, example):
    variants = [
        gates.from_dict(fields, preset=PRESET) for fields in ({}, {"sharing": "head_shared"}, {"position": "g5"})
    ]
    results = distributed.run(parallel_workers.tp_worker, 2, tmp_path, variants, doc_example.register)
    for rank_result in results:
        assert len(rank_result) == len(variants)
        for variant, diff in rank_result.items():
            assert diff["loss"] < 1e-5, (variant, diff)
            assert diff["grad"] < 1e-5 * max(1.0, diff["grad_scale"]), (variant, diff)
            assert diff["checkpoint"] == [], (variant, diff)
