"""Did-you-mean: each refusal of a mistyped name ends with the closest allowed one, and with nothing when no name is
close (a wrong guess would mislead more than none)."""

from __future__ import annotations

import pytest

from megagate import cli
from megagate.errors import ConfigError
from megagate.model import gate
from megagate.plan.devices import gpu_spec
from megagate.sections import closest, refuse_unknown

TRAIN_KEYS = ["lr", "min_lr", "warmup_steps", "train_steps", "seq_length", "micro_batch_size", "weight_decay"]


@pytest.mark.parametrize(
    ("typed", "allowed", "meant"),
    [
        ("learning_rate", TRAIN_KEYS, "lr"),  # the initials of the words
        ("warmup", TRAIN_KEYS, "warmup_steps"),  # contained, and only one name contains it
        ("train_step", TRAIN_KEYS, "train_steps"),  # difflib
        ("Seq-Length", TRAIN_KEYS, "seq_length"),  # case and -/_ ignored
        ("g1-elementwize", list(gate.PRESETS), "g1-elementwise"),
        ("h100sxm", ["h100-sxm", "h100-pcie", "a100-80gb"], "h100-sxm"),
        ("colour", TRAIN_KEYS, None),
        ("steps", TRAIN_KEYS, None),  # two names contain it: no guess
        ("", TRAIN_KEYS, None),
        (3, TRAIN_KEYS, None),  # a YAML key need not be a string
    ],
)
def test_closest(typed, allowed, meant) -> None:
    assert closest(typed, allowed) == meant


def test_refusals_end_with_the_closest_name(capsys) -> None:
    with pytest.raises(
        ConfigError, match=r"^train\.learning_rate is not a known key; allowed: lr, micro_batch_size, .*; "
    ):
        refuse_unknown({"learning_rate": 1}, TRAIN_KEYS, "train")
    with pytest.raises(ConfigError, match=r"; did you mean 'lr'\?$"):
        refuse_unknown({"learning_rate": 1}, TRAIN_KEYS, "train")
    with pytest.raises(ConfigError, match=r"weight_decay$"):  # nothing close: the list, no guess
        refuse_unknown({"colour": 1}, TRAIN_KEYS, "train")
    with pytest.raises(ConfigError, match=r"; did you mean 'g1-elementwise'\?$"):
        gate.from_dict(preset="g1-elementwize")
    with pytest.raises(
        ConfigError, match=r"^--gpu 'h100sxm' is not a known GPU; known: .*; did you mean 'h100-sxm'\?$"
    ):
        gpu_spec("h100sxm")
    assert cli.main(["trian"]) == 2
    assert capsys.readouterr().err.endswith("; did you mean 'train'?\n")
    assert cli.main(["data", "inspec"]) == 2
    assert (
        "invalid choice: 'inspec' (choose from 'inspect', 'synth'); did you mean 'inspect'?" in capsys.readouterr().err
    )
