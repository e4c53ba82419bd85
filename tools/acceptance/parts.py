"""The acceptance's parts, in order: their caps, what each needs, its command and how its output becomes figures
(stdlib only: the orchestrator runs where megatron-core may not import).

    install -> preflight -> benchmark -> training -> plan -> gpu_tests -> calibrate

The benchmark gives the headline figures, so it runs first after the preflight; the GPU tests, which take what
they are given, come after the training; `megagate calibrate` (where it exists) takes what is left.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.acceptance import report
from tools.acceptance.runner import Outcome

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tools" / "acceptance" / "acceptance.yaml"
# toy sizes on CPU: the same parts, files and JSON, in seconds (figures meaningless)
SMOKE_SETS = [
    "model.preset=tiny",
    "model.num_layers=2",
    "model.vocab_size=512",
    "model.max_sequence_length=64",
    "train.precision=fp32",
    "train.seq_length=64",
    "train.micro_batch_size=1",
    "train.global_batch_size=2",
    "train.train_steps=4",
    "train.warmup_steps=1",
]
# the GPU tests, cheapest first: a test run cut at its deadline has run the most tests
GPU_TEST_FILES = (
    "tests/gpu/test_sdpa_cuda.py",
    "tests/gpu/test_grouped_experts_cuda.py",
    "tests/gpu/test_gpu_bf16.py",
    "tests/gpu/test_te_equivalence.py",
    "tests/gpu/test_gpu_trainer.py",
)


@dataclass(frozen=True)
class Part:
    name: str
    cap_s: float  # on the GPU
    smoke_cap_s: float
    min_s: float  # a share smaller than this is not worth starting
    needs: tuple[str, ...] = ()  # parts that must have ended ok (when they ran)
    grace_s: float = 10.0  # between SIGTERM and SIGKILL at the deadline


PARTS = (
    Part("install", 90, 120, 5),
    Part("preflight", 60, 120, 10, needs=("install",)),
    Part("benchmark", 150, 150, 40, needs=("install", "preflight")),
    Part("training", 150, 180, 40, needs=("install", "preflight"), grace_s=15),
    Part("plan", 45, 120, 10, needs=("install",)),
    Part("gpu_tests", 150, 150, 20, needs=("install", "preflight")),
    Part("calibrate", 120, 120, 30, needs=("install", "preflight")),
)
NAMES = tuple(p.name for p in PARTS)
# the preflight runs without megatron-core too: it reports the machine whatever the install did
SOFT_NEEDS = {("preflight", "install")}


@dataclass
class Context:
    """What the parts share: options, folders, the environment of the part processes, earlier figures."""

    smoke: bool
    out: Path
    work: Path
    wheels: Path
    rounds: int
    sets: list[str]  # overrides of the acceptance config (smoke sizes, --set)
    train_sets: list[str]  # further overrides for the training only (--train-set)
    env: dict[str, str]
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)

    def result(self, part: str) -> Path:
        return self.work / f"{part}.json"

    def module(self, name: str, part: str, *extra: str) -> list[str]:
        cmd = [sys.executable, "-m", f"tools.acceptance.{name}", "--result", str(self.result(part))]
        return cmd + (["--smoke"] if self.smoke else []) + list(extra)

    def config_args(self, training: bool = False) -> list[str]:
        """--config and --set arguments: the acceptance config at this run's sizes (and the training's own
        overrides where `training`: the plan predicts that run)."""
        sets = self.sets + (self.train_sets if training else [])
        return ["--config", str(CONFIG), *(x for s in sets for x in ("--set", s))]

    @property
    def gpu(self) -> str:
        """The planner's name for this GPU (the preflight's), else the H200 the acceptance is made for."""
        return self.figures.get("preflight", {}).get("device_table") or "h200"

    @property
    def ceiling(self) -> float | None:
        """The measured bf16 matrix-product TFLOP/s (GPU runs only)."""
        if self.smoke:
            return None
        return (self.figures.get("preflight", {}).get("matmul") or {}).get("tflops_median")


def command(part: Part, ctx: Context, seconds: float) -> tuple[list[str], dict[str, str]]:
    """The part's command line and the variables it needs beyond the shared environment."""
    if part.name == "gpu_tests":
        return [
            *(sys.executable, "-m", "pytest", "-c", str(pytest_ini(ctx)), "--rootdir", str(ROOT), "-q", "-m", "gpu"),
            *("-p", "no:cacheprovider", "-p", "tools.acceptance.pytest_progress", *GPU_TEST_FILES),
        ], {"MEGAGATE_ACCEPTANCE_TEST_LOG": str(ctx.work / "gpu_tests.jsonl")}
    return _command(part, ctx, seconds), {}


def _command(part: Part, ctx: Context, seconds: float) -> list[str]:
    if part.name == "install":
        return ctx.module("install", "install", "--wheels", str(ctx.wheels), "--site", str(ctx.work / "site"))
    if part.name == "preflight":
        return ctx.module("preflight", "preflight", *ctx.config_args())
    if part.name == "benchmark":
        return ctx.module(
            "bench", "benchmark", *ctx.config_args(), "--rounds", str(ctx.rounds), "--seconds", f"{seconds:.0f}"
        )
    if part.name == "training":
        # the trainer stops itself before the share ends (the time its start-up takes is left for it)
        limit = max(5.0, seconds - (25 if ctx.smoke else 60))
        return [
            *(sys.executable, "-m", "megagate", "train", "--config", str(CONFIG)),
            *ctx.sets,
            *ctx.train_sets,
            f"output.dir={ctx.work / 'train_run'}",
            f"train.wall_time_limit={limit:.0f}",
        ]
    if part.name == "plan":
        return ctx.module("plan_part", "plan", *ctx.config_args(training=True), "--gpu", ctx.gpu)
    if part.name == "calibrate":
        profile = ctx.work / "device_profile.json"
        extra = ("--gpu", ctx.gpu, "--profile", str(profile), "--seconds", f"{seconds:.0f}")
        return ctx.module("calibrate", "calibrate", *ctx.config_args(training=True), *extra)
    raise ValueError(part.name)


def pytest_ini(ctx: Context) -> Path:
    """An ini for the GPU tests that needs no pytest plugin the machine may lack (the project's addopts ask for
    pytest-timeout): the project's markers and warning filters, its per-test timeout only where the plugin is."""
    import importlib.util

    lines = ["[pytest]", "addopts = -ra" + (" --timeout=300" if importlib.util.find_spec("pytest_timeout") else "")]
    lines += ["markers =", "    slow", "    distributed", "    gpu", "    slurm"]
    lines += [
        "filterwarnings =",
        "    ignore::UserWarning",
        "    ignore::DeprecationWarning",
        "    ignore::FutureWarning",
    ]
    path = ctx.work / "pytest.ini"
    path.write_text("\n".join(lines) + "\n")
    return path


# --- figures --------------------------------------------------------------------------------------------------------
def _number(value: Any) -> float | None:
    """A logged number (the trainer writes non-finite ones as "nan", "inf", "-inf"); None if not a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def _figures_of(outcome: Outcome) -> dict[str, Any]:
    return {k: v for k, v in outcome.written.items() if k not in ("status", "error", "reason", "traceback")}


def digest(part: Part, ctx: Context, outcome: Outcome) -> tuple[str, dict[str, Any], str | None]:
    """(status, figures, reason) of a part that ran: the runner's status, refined by what the part's output says."""
    figures = _figures_of(outcome)
    reason = outcome.written.get("error") or outcome.written.get("reason")
    status = outcome.status
    if part.name == "install" and outcome.written.get("site"):
        site = outcome.written["site"]
        ctx.env["PYTHONPATH"] = ":".join([site, *filter(None, [ctx.env.get("PYTHONPATH")])])
    elif part.name == "benchmark" and ctx.ceiling:
        for case in (figures.get("cases") or {}).values():
            if case.get("tflops"):
                case["mfu_measured_ceiling"] = round(case["tflops"] / ctx.ceiling, 4)
    elif part.name == "training":
        figures, problem = training_figures(ctx)
        if problem and status == "ok":
            status = "failed"
        reason = problem or reason
    elif part.name == "plan":
        figures["vs_training"] = plan_vs_training(figures, ctx.figures.get("training", {}))
    elif part.name == "gpu_tests":
        figures = test_figures(ctx)
        if status == "ok" and figures["failed"]:
            status = "failed"
        if figures["failed"]:
            reason = f"{figures['failed']} failed: " + ", ".join(figures["failures"])[:400]
    elif part.name == "calibrate":
        if report.copy_capped(ctx.work / "device_profile.json", ctx.out / "device_profile.json"):
            figures["profile_file"] = "device_profile.json"
    if outcome.status == "timed_out":
        reason = f"timed out after {outcome.seconds:.0f} s (its share); " + (reason or "killed with its process group")
    ctx.figures[part.name] = figures
    return status, figures, reason


def training_figures(ctx: Context) -> tuple[dict[str, Any], str | None]:
    """The trainer's own logged figures (metrics.jsonl of the run folder under /tmp, copied to the result folder):
    losses, the median over the second half of the steps (the first ones compile and warm up) of step time,
    tokens/s, TFLOP/s and MFU, the peak memory; a non-finite loss is the part's failure, named."""
    run = ctx.work / "train_run"
    metrics = run / "metrics.jsonl"
    report.copy_capped(metrics, ctx.out / "training_metrics.jsonl")
    rows = []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line torn by a kill
    train = [r for r in rows if r.get("split") == "train"]
    valid = [r for r in rows if r.get("split") == "valid"]
    figures: dict[str, Any] = {"run_dir": str(run), "steps": len(train)}
    try:
        summary = json.loads((run / "summary.json").read_text())
        figures["stopped"] = summary.get("stopped")
    except (OSError, ValueError):
        pass
    if not train:
        return figures, "the trainer logged no step"
    losses = [_number(r.get("loss")) for r in train]
    bad = next((r for r, loss in zip(train, losses) if loss is None or not math.isfinite(loss)), None)
    figures.update(first_loss=losses[0], last_loss=losses[-1], loss_fell=bool(losses[-1] < losses[0]))
    grad_bad = next((r["step"] for r in train if not math.isfinite(_number(r.get("grad_norm")) or 0.0)), None)
    if grad_bad is not None:
        figures["first_nonfinite_grad_norm_step"] = grad_bad
    steady = train[len(train) // 2 :]
    for key in ("step_time", "tokens_per_s", "tflops_per_gpu", "mfu_bf16"):
        values = [v for r in steady if (v := _number(r.get(key))) is not None and math.isfinite(v)]
        if values:
            figures[f"median_{key}"] = round(statistics.median(values), 5)
    memory = [v for r in train if (v := _number(r.get("memory_gib"))) is not None]
    if memory:
        figures["max_memory_gib"] = round(max(memory), 3)
    if valid:
        figures["final_valid_loss"] = _number(valid[-1].get("loss"))
    if ctx.ceiling and figures.get("median_tflops_per_gpu"):
        figures["mfu_measured_ceiling"] = round(figures["median_tflops_per_gpu"] / ctx.ceiling, 4)
    # the host-sync counter's figure: the trainer's per-step `host_syncs` metric where it logs one, else null
    syncs = [v for r in steady if (v := _number(r.get("host_syncs"))) is not None]
    figures["host_syncs_per_step"] = statistics.median(syncs) if syncs else None
    if bad is not None:
        return figures, f"the loss is not finite from step {bad['step']} (logged {bad.get('loss')!r})"
    return figures, None


def plan_vs_training(plan: dict[str, Any], train: dict[str, Any]) -> dict[str, Any]:
    """The planner's step time and peak memory beside the training's measured ones (ratios predicted / measured)."""
    out: dict[str, Any] = {}
    step, measured = plan.get("step_s"), train.get("median_step_time")
    if step and measured:
        out.update(step_s_predicted=step, step_s_measured=measured, step_ratio=round(step / measured, 3))
    peak, memory = plan.get("peak_gib"), train.get("max_memory_gib")
    if peak and memory:
        out.update(peak_gib_predicted=peak, max_memory_allocated_gib=memory, memory_ratio=round(peak / memory, 3))
        if plan.get("peak_gib_without_margin"):
            out["memory_ratio_without_margin"] = round(plan["peak_gib_without_margin"] / memory, 3)
    return out


def test_figures(ctx: Context) -> dict[str, Any]:
    """Counts and failures from the per-test lines (pytest_progress); one line per test in gpu_tests.txt."""
    path = ctx.work / "gpu_tests.jsonl"
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    count = {outcome: sum(r["outcome"] == outcome for r in records) for outcome in ("passed", "failed", "skipped")}
    failures = [r["test"] for r in records if r["outcome"] == "failed"]
    lines = [
        f"{r['outcome']:8s} {r['s']:8.2f}s  {r['test']}" + (f"  -- {r['message']}" if r.get("message") else "")
        for r in records
    ]
    (ctx.out / "gpu_tests.txt").write_text("\n".join(lines)[: report.FILE_CAP - 1000] + "\n")
    return {**count, "failures": failures, "report_file": "gpu_tests.txt"}
