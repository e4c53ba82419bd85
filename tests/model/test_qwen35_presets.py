"""The Qwen3.5 presets (`qwen3.5-27b` dense, `qwen3.5-35b-a3b` MoE): the published text-model shapes, counted.

The shapes are the `text_config` of the released config.json files; the published sizes are those of the whole
vision-language models ("27B"; "35B in total and 3B activated"), whose vision encoders (~0.4 B) and MTP heads
megagate does not build: the text models count 26.90 B and 34.66 B (3.45 B active), i.e. the published figures to
the billion. `megagate variants --build` builds each on the meta device and counts what megatron allocates: equal to
the analytic count.
"""

from __future__ import annotations

import pytest

from megagate.interop import hf
from megagate.model import gate as gates
from megagate.model.counts import parameter_counts
from megagate.model.presets import model_preset

G1 = gates.preset("g1-elementwise")
# (preset, total, active, published total, published active, the format its folders are in)
PUBLISHED = [
    ("qwen3.5-27b", 26_895_998_464, 26_895_998_464, 27e9, 27e9, "qwen3_5"),
    ("qwen3.5-35b-a3b", 34_660_610_688, 3_454_988_928, 35e9, 3e9, "qwen3_5_moe"),
]


@pytest.mark.parametrize(("name", "total", "active", "published", "published_active", "fmt"), PUBLISHED)
def test_counts_are_the_published_sizes(name, total, active, published, published_active, fmt):
    model = model_preset(name, gate=G1)
    counts = parameter_counts(model)
    assert (counts["total"], counts["active"]) == (total, active)
    assert round(total / 1e9) == published / 1e9 and round(active / 1e9) == published_active / 1e9
    assert fmt in hf.formats_for(model)  # the preset leaves as its Qwen3.5 format (and as qwen3_next)
    config = hf.hf_config(model, fmt)
    back, detected = hf.model_config_from_hf(config)
    assert detected == fmt and hf.same_architecture(back, model)


def test_variants_build_counts_what_megatron_builds():
    """`megagate variants --build` on the whole models (meta device; its own process: the command opens its own
    one-process megatron world): megatron's parameter count is the analytic total."""
    from helpers import forked

    names = [p[0] for p in PUBLISHED]
    proc = forked.run_cli(["variants", "--models", *names, "--variants", "g1-elementwise", "--build"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name, total, *_ in PUBLISHED:
        row = [line for line in proc.stdout.splitlines() if line.startswith(name + " ")]
        assert len(row) == 1, proc.stdout
        cells = row[0].split()
        print(f"\n{row[0]}")
        assert int(cells[2].replace(",", "")) == int(cells[-1].replace(",", "")) == total
