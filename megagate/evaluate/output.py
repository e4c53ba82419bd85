"""`megagate eval`'s outputs: the printed table, results.json and ppl_vs_length.png (one line per checkpoint, one
panel per dataset), each written to a temporary name and renamed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megagate.console import cell
from megagate.console import table as table_text


def _cell(value: float | None, spec: str) -> str:
    return cell(value, spec, nan="-")  # this table has always shown a NaN as missing


def table(results: dict[str, Any]) -> str:
    """One row per checkpoint x dataset x length: loss, perplexity, perplexity of the first and last position
    bucket, F-Attn (first-token attention, layer mean) and M-Act (largest |hidden state|)."""
    header = ["checkpoint", "data", "length", "samples", "loss", "ppl", "ppl first", "ppl last", "F-Attn", "M-Act"]
    rows = [header]
    for c in results["checkpoints"]:
        for r in c["results"]:
            diag = r["diagnostics"] or {}
            rows.append(
                [
                    c["name"],
                    r["data"],
                    str(r["seq_length"]),
                    str(r["samples"]),
                    _cell(r["loss"], ".4f"),
                    _cell(r["ppl"], ".2f"),
                    _cell(r["buckets"][0]["ppl"], ".2f"),
                    _cell(r["buckets"][-1]["ppl"], ".2f"),
                    _cell(diag.get("f_attn"), ".3f"),
                    _cell(diag.get("m_act"), ".1f"),
                ]
            )
    return table_text(rows, right_from=2, rule="line")


def plot(results: dict[str, Any], path: str | Path) -> Path:
    """Perplexity vs evaluated length (log-log), one line per checkpoint, one panel per dataset."""
    from megagate.analysis import plotting

    plt = plotting.pyplot()
    names = results["data"]
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, data in zip(axes[0], names):
        for c in results["checkpoints"]:
            rows = sorted((r for r in c["results"] if r["data"] == data), key=lambda r: r["seq_length"])
            ax.plot([r["seq_length"] for r in rows], [r["ppl"] for r in rows], marker="o", label=c["name"])
            ax.axvline(c["train_seq_length"], color="grey", linestyle=":", linewidth=0.8)
        lengths = [r["seq_length"] for c in results["checkpoints"] for r in c["results"] if r["data"] == data]
        plotting.log2_ticks_at(ax, lengths)  # a tick per evaluated length, written 512 rather than 2^9
        ppls = [r["ppl"] for c in results["checkpoints"] for r in c["results"] if r["data"] == data]
        plotting.value_scale(ax, ppls)  # a log axis only where the curve spans decades
        ax.set_xlabel("evaluated length (tokens)")
        ax.set_ylabel("perplexity")
        ax.set_title(f"{data} (dotted: training length)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return plotting.save(fig, path)


def write(results: dict[str, Any], out: str | Path) -> dict[str, Path]:
    """results.json, table.txt and ppl_vs_length.png under `out`."""
    from megagate.files import write_atomic
    from megagate.monitor import runfiles

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "table": out / "table.txt", "png": out / "ppl_vs_length.png"}
    runfiles.write_json(paths["json"], results)
    write_atomic(paths["table"], table(results) + "\n")
    plot(results, paths["png"])
    return paths
