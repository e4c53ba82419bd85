"""GPU acceptance in one command, made to return its results on the first try.

    bash tools/gpu_acceptance.sh [OUT_DIR] [options]      # on the GPU machine (OUT_DIR defaults to $OUT)
    python tools/gpu_acceptance.py --out OUT --smoke     # every part at toy size on CPU: the script's own check

The machine it needs: one GPU (made for an H200, 141 GB) with python3, torch and CUDA, and nothing else of ours:
megatron-core comes as a wheel carried in .whl/ (`make gpu-wheels`), Transformer Engine, apex and DALI are absent,
there is no network, one command may run about 9 minutes, and only a few small files, two folders deep at most,
come back from the result folder.

One deadline (--budget, 450 s) is shared by the parts, in this order: install -> preflight (CUDA, versions,
device, a measured matmul ceiling, SDPA kernels) -> benchmark (baseline vs G1, SDPA vs megatron's local attention)
-> training (`megagate train`, 30 steps) -> plan (`megagate plan`'s prediction of that run) -> GPU tests ->
calibrate (`megagate calibrate`, where it exists). Each part gets min(its cap, time left - margin) and runs in its
own process group, killed whole when its share is spent. After every part the JSON is rewritten (atomically) with
each part's status (ok / failed / timed_out / skipped), figures and the last lines of its error. Run folders, data
caches and the installed wheel live under /tmp; the result folder gets at most five small files
(tools/acceptance/report.py), and the last line on stdout is a one-line JSON summary. Exit code: 0 when every part
that ran passed, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.acceptance import parts as P  # noqa: E402
from tools.acceptance import report  # noqa: E402
from tools.acceptance.runner import Interrupted, Outcome, raise_interrupted, read_json, run_part, tail_lines  # noqa: E402

SCHEMA = "megagate-gpu-acceptance/1"
_PAST = {"failed": "failed", "timed_out": "timed out", "skipped": "was skipped"}
BUDGET_S, SMOKE_BUDGET_S = 450.0, 180.0
MARGIN_S, SMOKE_MARGIN_S = 10.0, 5.0  # kept back from every share for the kill, the JSON and the summary


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage text
        raise UsageError(message)


class _Stop:
    """SIGTERM/SIGINT: noted; raised as Interrupted only while a part runs (it is then stopped with its group)."""

    requested: str | None = None
    armed = False

    @classmethod
    def handler(cls, signum: int, frame: Any) -> None:
        cls.requested = signal.Signals(signum).name
        if cls.armed:
            raise_interrupted(signum, frame)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="result folder (at most five small files)")
    p.add_argument("--smoke", action="store_true", help="toy sizes on CPU: the plumbing, no meaningful figures")
    p.add_argument(
        "--budget", type=float, help=f"seconds for everything (default {BUDGET_S:.0f}, smoke {SMOKE_BUDGET_S:.0f})"
    )
    p.add_argument("--cap", action="append", default=[], metavar="PART=S", help="a part's cap in seconds")
    p.add_argument("--only", help=f"comma-separated parts to run (of {','.join(P.NAMES)}); the others are skipped")
    p.add_argument("--rounds", type=int, help="benchmark rounds (default 8, smoke 2)")
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="override of the acceptance config")
    p.add_argument("--train-set", action="append", default=[], metavar="K=V", help="override for the training only")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="folder of carried wheels (default .whl)")
    p.add_argument("--work", type=Path, help="folder for run folders and caches (default: a new one under /tmp)")
    p.add_argument("--keep-work", action="store_true", help="keep the work folder (kept anyway when --work is given)")
    p.add_argument("--inject-hang", metavar="PART", help="testing: PART hangs (with a child) to exercise the deadline")
    args = p.parse_args(argv)
    args.budget = args.budget if args.budget is not None else (SMOKE_BUDGET_S if args.smoke else BUDGET_S)
    if not 0 < args.budget < 86_400:
        raise UsageError(f"--budget {args.budget:g}: must be a number of seconds in (0, 86400)")
    args.rounds = args.rounds if args.rounds is not None else (2 if args.smoke else 8)
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}: must be >= 1")
    args.caps = {}
    for item in args.cap:
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if name not in P.NAMES or not seconds > 0:
            raise UsageError(f"--cap {item!r}: must be PART=SECONDS with PART one of {', '.join(P.NAMES)}")
        args.caps[name] = seconds
    args.selected = set(P.NAMES) if not args.only else set(args.only.split(","))
    unknown = sorted(args.selected - set(P.NAMES)) + (
        [args.inject_hang] if args.inject_hang not in (None, *P.NAMES) else []
    )
    if unknown:
        raise UsageError(f"unknown part {unknown[0]!r}: the parts are {', '.join(P.NAMES)}")
    for item in args.set + args.train_set:
        if "=" not in item or item.startswith("="):
            raise UsageError(f"--set/--train-set {item!r}: must be key.path=value")
    return args


def part_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of every part: this checkout importable, unbuffered output, torch's expandable segments;
    in smoke mode no GPU at all (the toy sizes run on the CPU on any machine)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    if not env.get("PYTORCH_ALLOC_CONF") and not env.get("PYTORCH_CUDA_ALLOC_CONF"):
        env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    if args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def headline(name: str, figures: dict[str, Any]) -> str:
    """A few words of a part's figures for its progress line."""
    f = figures
    if name == "preflight":
        return f"{f.get('device') or 'no GPU'}, torch {f.get('torch')}, matmul {(f.get('matmul') or {}).get('tflops_median')} TFLOP/s"
    if name == "benchmark" and f.get("cases"):
        return "; ".join(f"{k} {c.get('tokens_per_s')} tok/s" for k, c in f["cases"].items())
    if name == "training" and "steps" in f:
        return f"{f['steps']} steps, loss {f.get('first_loss')} -> {f.get('last_loss')}, {f.get('median_tokens_per_s')} tok/s"
    if name == "gpu_tests" and "passed" in f:
        return f"{f['passed']} passed, {f['failed']} failed, {f['skipped']} skipped"
    if name == "plan" and f.get("vs_training"):
        return str(f["vs_training"])
    if name == "plan":
        return f"predicts {f.get('step_s')} s per step, {f.get('peak_gb')} GB peak"
    return ""


def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    work = args.work or Path(tempfile.mkdtemp(prefix="megagate-acceptance-"))
    work.mkdir(parents=True, exist_ok=True)
    json_path, log = out / report.JSON_NAME, out / report.LOG_NAME
    for name in report.RESULT_FILES:  # a reused folder: no file of an earlier run passes for this one's
        (out / name).unlink(missing_ok=True)
    log.write_text("")
    ctx = P.Context(
        args.smoke,
        out,
        work,
        args.wheels,
        args.rounds,
        (P.SMOKE_SETS if args.smoke else []) + args.set,
        args.train_set,
        part_env(args),
    )
    margin = SMOKE_MARGIN_S if args.smoke else MARGIN_S
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": "smoke" if args.smoke else "gpu",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "finished": None,
        "budget_s": args.budget,
        "margin_s": margin,
        "config": str(P.CONFIG.relative_to(ROOT)),
        "config_overrides": ctx.sets,
        "training_overrides": ctx.train_sets,
        "work_dir": str(work),
        "json_path": str(json_path),
        "parts": {},
    }
    for part in P.PARTS:
        cap = args.caps.get(part.name, part.smoke_cap_s if args.smoke else part.cap_s)
        doc["parts"][part.name] = {"status": "pending", "cap_s": cap}
    report.write_json(json_path, doc)
    run_id = uuid.uuid4().hex[:12]
    start = time.monotonic()
    deadline = start + args.budget
    stopped: str | None = None
    for part in P.PARTS:
        entry = doc["parts"][part.name]
        left = deadline - time.monotonic() - margin
        given = min(entry["cap_s"], left)
        blocker = next(
            (
                n
                for n in part.needs
                if doc["parts"][n]["status"] not in ("ok", "skipped") and (part.name, n) not in P.SOFT_NEEDS
            ),
            None,
        ) or next((n for n in part.needs if doc["parts"][n].get("blocked")), None)
        stopped = stopped or (f"{_Stop.requested} received" if _Stop.requested else None)
        if stopped:
            entry.update(status="skipped", reason=f"the acceptance was stopped ({stopped})", blocked=True)
        elif part.name not in args.selected:
            entry.update(status="skipped", reason="not selected (--only)")
        elif blocker:
            entry.update(
                status="skipped",
                reason=f"needs {blocker}, which {_PAST[doc['parts'][blocker]['status']]}",
                blocked=True,
            )
        elif given < min(part.min_s, entry["cap_s"]):  # cut by the deadline, not by a cap chosen that small
            entry.update(
                status="skipped",
                reason=f"no time left: {max(left, 0):.0f} s of the {args.budget:.0f} s budget, it needs {part.min_s:.0f} s",
                blocked=True,
            )
        if entry["status"] == "skipped":
            report.log_line(log, f"[{time.monotonic() - start:5.0f}s] {part.name}: skipped ({entry['reason']})")
            report.write_json(json_path, doc)
            continue
        entry.update(status="running", given_s=round(given, 1))
        report.write_json(json_path, doc)
        report.log_line(log, f"[{time.monotonic() - start:5.0f}s] {part.name}: running (share {given:.0f} s)")
        cmd, extra_env = P.command(part, ctx, given)
        if args.inject_hang == part.name:
            cmd = [sys.executable, "-m", "tools.acceptance.hang"]
        part_log, result = work / f"{part.name}.log", ctx.result(part.name)
        try:
            try:
                _Stop.armed = True
                outcome = run_part(
                    cmd,
                    seconds=given,
                    log=part_log,
                    result=result,
                    marker=f"{run_id}:{part.name}",
                    env={**ctx.env, **extra_env},
                    cwd=ROOT,
                    grace=part.grace_s,
                )
            finally:
                _Stop.armed = False
        except Interrupted as exc:
            stopped = f"{exc} received"
            outcome = Outcome(
                "failed", round(time.monotonic() - start, 1), None, read_json(result), tail_lines(part_log)
            )
            outcome.written["error"] = f"stopped by {exc} during this part"
        status, figures, reason = P.digest(part, ctx, outcome)
        entry.update(status=status, seconds=outcome.seconds, rc=outcome.rc, figures=figures)
        if reason:
            entry["reason"] = reason
        # the part's own traceback where it crashed, else its output's last lines where it did not say why
        tail = outcome.written.get("traceback") or ([] if reason and outcome.status != "timed_out" else outcome.tail)
        if tail and status != "ok":
            entry["error_tail"] = tail
        if outcome.killed_leftovers:
            entry["killed_leftovers"] = outcome.killed_leftovers
        report.append_part_log(log, f"{part.name} ({' '.join(cmd[1:4])} ...): {status}", part_log)
        words = headline(part.name, figures) if status == "ok" else (reason or (outcome.tail or ["?"])[-1])
        report.log_line(
            log, f"[{time.monotonic() - start:5.0f}s] {part.name}: {status} in {outcome.seconds:.0f} s; {words}"
        )
        if part.name == "preflight" and figures.get("shape"):
            # one model for the benchmark, the training and the plan: stated once, as the config resolved it
            doc["model"] = {**figures["shape"], "used_by": ["benchmark", "training", "plan"]}
        report.write_json(json_path, doc)
    ok = all(p["status"] == "ok" or (p["status"] == "skipped" and not p.get("blocked")) for p in doc["parts"].values())
    doc.update(
        result="ok" if ok else "failed",
        finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        elapsed_s=round(time.monotonic() - start, 1),
        files=sorted(p.name for p in out.iterdir() if p.name in report.RESULT_FILES),
    )
    report.write_json(json_path, doc)
    if args.work is None and not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    print(report.summary_line(doc), flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        args.out.mkdir(parents=True, exist_ok=True)
    except UsageError as exc:
        print(f"gpu_acceptance: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"gpu_acceptance: error: --out {str(exc.filename)!r}: {exc.strerror}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _Stop.handler)
    signal.signal(signal.SIGINT, _Stop.handler)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
