"""Parameter counts of the paper's three models, built on the meta device, equal the analytic formulas."""

import pytest

from megagate.commands.variants import PAPER_MODELS, format_table, parameter_table
from megagate.model import gate as gates
from megagate.model.model_config import matched_ffn_width


@pytest.mark.slow  # ~47 s of CPU: 45 paper-sized models built on the meta device
def test_paper_models_every_variant(megatron_world, capsys):
    rows = parameter_table(PAPER_MODELS, list(gates.PRESETS), build=True)
    with capsys.disabled():
        print("\n" + format_table(rows))
    for row in rows:
        assert row["built"] == row["total"], row
    by = {(r["model"], r["variant"]): r for r in rows}
    # the paper's headline sizes: ~1.7B dense models, 15B-total MoE
    assert 1.70e9 < by["1.7b-28l", "baseline"]["total"] < 1.74e9
    assert 1.69e9 < by["1.7b-48l", "baseline"]["total"] < 1.72e9
    assert 15.0e9 < by["15a2b-moe", "baseline"]["total"] < 16.0e9
    # G1 elementwise adds h·(np·hn) per layer: 24 · 2048 · 4096 = 201M in the MoE (paper Table 1: 201M)
    assert by["15a2b-moe", "g1-elementwise"]["gate"] == 24 * 2048 * 4096
    assert by["15a2b-moe", "g1-headwise"]["gate"] == 24 * 2048 * 32
    # dense gated models shrink the FFN to stay within 0.5% of the baseline's size (the paper's matching rule)
    for preset in ("1.7b-28l", "1.7b-48l"):
        base = by[preset, "baseline"]["total"]
        for variant in gates.PRESETS:
            assert abs(by[preset, variant]["total"] - base) / base < 0.005, (preset, variant)


@pytest.mark.parametrize(
    "ffn, hidden, added, expected",
    [(6144, 2048, 2048 * 2048, 5440), (6144, 2048, 2048 * 4096, 4800), (4608, 1536, 0, 4608)],
)
def test_matched_ffn_width(ffn, hidden, added, expected):
    assert matched_ffn_width(ffn, hidden, added, 64) == expected
