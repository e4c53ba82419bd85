"""megagate.sections: the one reader of typed sections (flat, nested, tuples, mappings, JSON's text keys)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from megagate.errors import ConfigError
from megagate.sections import build_section, read_fields


@dataclass(frozen=True)
class Inner:
    depth: int = 1
    rate: float = 0.5


@dataclass(frozen=True)
class Outer:
    name: str = "x"
    on: bool = True
    names: tuple[str, ...] = ("a",)
    limits: Mapping[str, float] = field(default_factory=dict)
    means: dict[int, float] = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)
    maybe: Inner | None = None


def test_flat_nested_and_converted() -> None:
    got = build_section(
        Outer,
        {
            "names": ["p", "q"],
            "limits": {"loss": 20},
            "means": {"100": 2, "200": "1.5"},
            "inner": {"depth": 3, "rate": "3e-4"},  # YAML 1.1 reads 3e-4 as text: the number
            "maybe": None,
        },
        "sec",
    )
    assert got == Outer(names=("p", "q"), limits={"loss": 20}, means={100: 2.0, 200: 1.5}, inner=Inner(3, 3e-4))
    assert isinstance(got.limits, dict) and isinstance(got.names, tuple)
    assert build_section(Outer, {"names": "solo", "maybe": {}}, "sec") == Outer(names=("solo",), maybe=Inner())
    assert build_section(Outer, None, "sec") == Outer()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"nmae": "y"},
            "sec.nmae is not a known key; allowed: inner, limits, maybe, means, name, names, on; did you mean 'name'?",
        ),
        ({"inner": {"dpeth": 2}}, "sec.inner.dpeth is not a known key; allowed: depth, rate; did you mean 'depth'?"),
        ({"inner": {"depth": 2.5}}, "sec.inner.depth=2.5 must be an integer"),
        ({"on": "yes"}, "sec.on='yes' must be true or false"),
        ({"names": 3}, "sec.names=3 must be a list"),
        ({"limits": [1]}, "sec.limits=[1] must be a mapping"),
        ({"means": {"ten": 1.0}}, "sec.means.ten=1.0: keys must be integers, values numbers"),
        ({"inner": {"rate": math.inf}}, "sec.inner.rate=inf must be a finite number"),
    ],
)
def test_refusals_name_the_key_path(values: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_section(Outer, values, "sec")
    assert str(err.value) == message


def test_item_names_and_unchecked_scalars() -> None:
    with pytest.raises(ConfigError, match=r"^sec.names=3 must be a metric name or a list of them$"):
        read_fields(Outer, {"names": 3}, "sec", item="metric")
    with pytest.raises(ConfigError, match=r"^sec.limits=\[1\] must be a mapping of metric -> value$"):
        read_fields(Outer, {"limits": [1]}, "sec", item="metric")
    # scalars=False: numbers and text are the section's own rules (NaN kept, ints stay ints); bools still checked
    kwargs = read_fields(Outer, {"name": 7, "inner": {"rate": math.nan, "depth": 2}}, "sec", scalars=False)
    assert kwargs["name"] == 7 and kwargs["inner"].depth == 2 and math.isnan(kwargs["inner"].rate)
    with pytest.raises(ConfigError, match="must be true or false"):
        read_fields(Outer, {"on": 1}, "sec", scalars=False)
