"""GateConfig: every paper row is expressible; invalid values and combinations are refused with the values named."""

import pytest

from megagate.errors import ConfigError
from megagate.model import gate as gates
from megagate.model.build import transformer_config
from megagate.model.kernels import check_backend, transformer_engine_available
from megagate.model.presets import model_preset
from megagate.model.spec import check_gate_compatible


def test_every_preset_is_valid_and_distinct():
    configs = {name: gates.preset(name) for name in gates.PRESETS}
    assert len(set(configs.values())) == len(configs)
    assert gates.preset("g1-elementwise") == gates.GateConfig()  # the paper's best is the default


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"position": "g7"}, "gate.position='g7' is not one of none, g1, g2, g3, g4, g5"),
        (
            {"position": "g5", "granularity": "headwise"},
            "gate.granularity='headwise' is invalid with gate.position='g5'",
        ),
        ({"position": "g5", "sharing": "head_shared"}, "gate.sharing='head_shared' is invalid with gate.position='g5'"),
        ({"combine": "additive", "activation": "sigmoid"}, "gate.combine='additive' with gate.activation='sigmoid'"),
        ({"activation": "tanh"}, "gate.activation='tanh' is not one of sigmoid, silu, ns_sigmoid, 2sigmoid, identity"),
        ({"sdpa_norm": "rmsnorm"}, "gate.sdpa_norm='rmsnorm' replaces the gate at the SDPA output"),
        (
            {"position": "none", "granularity": "headwise"},
            "gate.position='none' but gate fields are set: granularity='headwise'",
        ),
    ],
)
def test_invalid_combinations_name_the_values(fields, message):
    with pytest.raises(ConfigError) as err:
        gates.GateConfig(**fields)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_from_dict_rejects_unknown_preset_and_field():
    with pytest.raises(ConfigError, match="gate preset 'g9' is unknown"):
        gates.from_dict(preset="g9")
    with pytest.raises(ConfigError, match="gate.colour is not a gate field"):
        gates.from_dict({"colour": "red"})
    assert gates.from_dict({"granularity": "headwise"}, preset="g2-elementwise") == gates.preset("g2-headwise")


def test_model_level_checks(megatron_world):
    config = transformer_config(model_preset("tiny"))
    with pytest.raises(
        ConfigError, match=r"num_attention_heads \(4\) must be divisible by tensor_model_parallel_size \(3\)"
    ):
        check_gate_compatible(config, gates.GateConfig(), tp_size=3)
    check_gate_compatible(config, gates.GateConfig(), tp_size=4)  # fewer groups than TP: megatron replicates them
    odd = transformer_config(model_preset("tiny", num_attention_heads=6, num_query_groups=3))
    with pytest.raises(
        ConfigError, match=r"num_query_groups \(3\) must be a multiple or a divisor of tensor_model_parallel_size \(2\)"
    ):
        check_gate_compatible(odd, gates.GateConfig(), tp_size=2)
    mla = model_preset("tiny")
    import dataclasses

    mla_config = dataclasses.replace(config, multi_latent_attention=True)
    with pytest.raises(ConfigError, match="not supported with multi_latent_attention"):
        check_gate_compatible(mla_config, gates.GateConfig(), tp_size=1)
    check_gate_compatible(mla_config, gates.preset("baseline"), tp_size=1)  # MLA without a gate is megatron's business
    assert mla.gate.enabled


def test_backend_checks():
    with pytest.raises(ConfigError, match="backend='cuda' is not one of local, te"):
        check_backend("cuda")
    if not transformer_engine_available():
        with pytest.raises(ConfigError, match="backend='te' needs Transformer Engine"):
            check_backend("te")
