"""The acceptance's outputs (stdlib only): the result folder's few small files and the one-line summary.

The result folder gets at most these files, each kept under `FILE_CAP` bytes:
`gpu_acceptance.json` (everything), `gpu_acceptance.log` (the run's output, each part's cut to its head and tail),
`training_metrics.jsonl` (the trainer's per-step metrics), `gpu_tests.txt` (one line per GPU test) and
`device_profile.json` (`megagate calibrate`'s, where it exists). The last line on stdout is `summary_line`: the
JSON's essentials in under `SUMMARY_CAP` bytes, so the results survive even if no file comes back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tools.acceptance.child import finite, write_json

JSON_NAME = "gpu_acceptance.json"
LOG_NAME = "gpu_acceptance.log"
RESULT_FILES = (JSON_NAME, LOG_NAME, "training_metrics.jsonl", "gpu_tests.txt", "device_profile.json")
FILE_CAP = 1_000_000
PART_LOG_HEAD, PART_LOG_TAIL = 24_000, 100_000  # of each part's output, in the log (7 parts: < 900 kB)
SUMMARY_CAP = 2000

__all__ = ["write_json", "append_part_log", "copy_capped", "summary", "summary_line", "RESULT_FILES"]


def append_part_log(log: Path, title: str, part_log: Path) -> None:
    """Append a part's output to the run's log, its head and tail when it is long."""
    try:
        data = part_log.read_bytes()
    except OSError:
        data = b""
    if len(data) > PART_LOG_HEAD + PART_LOG_TAIL:
        cut = len(data) - PART_LOG_HEAD - PART_LOG_TAIL
        data = data[:PART_LOG_HEAD] + f"\n[... {cut} bytes cut ...]\n".encode() + data[-PART_LOG_TAIL:]
    with open(log, "ab") as f:
        f.write(f"\n===== {title} =====\n".encode() + data)


def log_line(log: Path, line: str) -> None:
    """A line of the orchestrator's own, in the log and on stdout."""
    print(line, flush=True)
    with open(log, "a") as f:
        f.write(line + "\n")


def copy_capped(src: Path, dst: Path, cap: int = FILE_CAP) -> bool:
    """Copy `src` to `dst` if it is at most `cap` bytes (True); a larger file stays where it is (False)."""
    if not src.is_file() or src.stat().st_size > cap:
        return False
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)
    return True


def _short(text: Any, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """The JSON's essentials: per-part status, the headline figures, and what failed."""
    parts = doc.get("parts", {})
    fig = {name: part.get("figures") or {} for name, part in parts.items()}
    out: dict[str, Any] = {
        "gpu_acceptance": doc.get("result"),
        "mode": doc.get("mode"),
        "device": fig.get("preflight", {}).get("device"),
        "elapsed_s": doc.get("elapsed_s"),
        "parts": {name: part.get("status") for name, part in parts.items()},
    }
    matmul = fig.get("preflight", {}).get("matmul") or {}
    if matmul:
        out["matmul_tflops"] = matmul.get("tflops_median")
    cases = fig.get("benchmark", {}).get("cases") or {}
    if cases:
        out["bench"] = {
            k: [c.get("tokens_per_s"), c.get("tflops"), c.get("mfu_datasheet"), c.get("mfu_measured_ceiling")]
            for k, c in cases.items()
            if "error" not in c
        }
        out["bench_columns"] = "tokens/s, TFLOP/s, MFU datasheet, MFU measured ceiling"
        out["ratios"] = fig.get("benchmark", {}).get("ratios")
    train = fig.get("training", {})
    keys = ("steps", "first_loss", "last_loss", "median_tokens_per_s", "median_tflops_per_gpu", "median_mfu_bf16")
    if train:
        out["train"] = {k: train.get(k) for k in (*keys, "mfu_measured_ceiling", "max_memory_gib") if k in train}
    plan = fig.get("plan", {})
    if plan.get("vs_training"):
        out["plan_vs_train"] = plan["vs_training"]
    tests = fig.get("gpu_tests", {})
    if "passed" in tests:
        out["tests"] = f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped"
    errors = {
        name: _short(part.get("reason") or part.get("error") or (part.get("error_tail") or ["?"])[-1])
        for name, part in parts.items()
        if part.get("status") in ("failed", "timed_out") or (part.get("status") == "skipped" and part.get("blocked"))
    }
    if errors:
        out["errors"] = errors
    out["json"] = doc.get("json_path")
    return finite(out)


def summary_line(doc: dict[str, Any]) -> str:
    """`summary(doc)` as one JSON line of at most SUMMARY_CAP bytes (details dropped, least important first)."""
    data = summary(doc)
    for drop in ("bench_columns", "ratios", "plan_vs_train", "bench", "train", "errors", "json"):
        line = json.dumps(data, separators=(",", ":"), allow_nan=False)
        if len(line.encode()) <= SUMMARY_CAP:
            return line
        if drop == "errors" and "errors" in data:
            data["errors"] = {k: _short(v, 60) for k, v in data["errors"].items()}
            continue
        data.pop(drop, None)
    return json.dumps({k: data[k] for k in ("gpu_acceptance", "mode", "device", "parts") if k in data})
