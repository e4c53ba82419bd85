"""`megagate variants`: the gate presets, and parameter counts of the paper's models for each."""

from __future__ import annotations

import argparse

from megagate.model import gate as gates
from megagate.model.build import meta_parameter_count
from megagate.model.counts import parameter_counts
from megagate.model.presets import PRESETS, model_preset

PAPER_MODELS = ("1.7b-28l", "1.7b-48l", "15a2b-moe")
# The softmax-sink baselines (model.softmax_type, not a gate): the ungated model with a sink in every attention row
SINK_BASELINES = {
    "off-by-one": ("baseline", {"softmax_type": "off-by-one"}, "no gate; softmax_type=off-by-one (exp(0) sink)"),
    "learnable-sink": ("baseline", {"softmax_type": "learnable"}, "no gate; softmax_type=learnable (a logit/head)"),
}
VARIANTS = [*gates.PRESETS, *SINK_BASELINES]


def variant_model(preset: str, variant: str):
    """The ModelConfig of a model preset with a gate preset or a sink baseline."""
    gate, fields, _ = SINK_BASELINES.get(variant, (variant, {}, ""))
    return model_preset(preset, gate=gates.preset(gate), **fields)


def parameter_table(model_presets: tuple[str, ...], variants: list[str], build: bool) -> list[dict]:
    """One row per (model, variant): analytic counts, and the count of the model megatron builds (meta device)."""
    rows = []
    for preset in model_presets:
        for variant in variants:
            model = variant_model(preset, variant)
            counts = parameter_counts(model)
            rows.append(
                {
                    "model": preset,
                    "variant": variant,
                    "total": counts["total"],
                    "active": counts["active"],
                    "gate": counts["gate"],
                    "ffn": model.effective_ffn_hidden_size,
                    "built": meta_parameter_count(model) if build else None,
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'model':10s} {'variant':30s} {'total':>15s} {'active':>15s} {'gate':>13s} {'ffn':>5s} {'built (meta)':>15s}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        built = "-" if r["built"] is None else f"{r['built']:,}"
        lines.append(
            f"{r['model']:10s} {r['variant']:30s} {r['total']:>15,} {r['active']:>15,} {r['gate']:>13,} "
            f"{r['ffn']:>5d} {built:>15s}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=list(PAPER_MODELS), choices=list(PRESETS))
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--build", action="store_true", help="also build each model on the meta device and count")


def run(args: argparse.Namespace) -> int:
    for name in args.variants:
        described = SINK_BASELINES[name][2] if name in SINK_BASELINES else gates.preset(name).describe()
        print(f"{name:32s} {described}")
    print()
    if args.build:
        from megagate.distributed import parallel

        with parallel.single_process():
            rows = parameter_table(tuple(args.models), args.variants, build=True)
    else:
        rows = parameter_table(tuple(args.models), args.variants, build=False)
    print(format_table(rows))
    return 0
