"""Real trainer runs for tests: runs of examples/tiny_cpu.yaml in children forked from the preloaded server
(helpers.forked: megatron's import time is paid once), two at a time (each is one single-threaded process, so two
fill the two cores), cached for the whole pytest session so test modules share identical runs.

    runs = trainer_jobs.run_jobs(tmp_path_factory, demo_dir, {"clean": [...overrides], "skip": [...]},
                                 snapshots={"skip": [11, 12, 13]}, hook_logs={"skip"})
    runs["clean"].dir / "metrics.jsonl" ...

A plain job runs `megagate train` itself (`megagate.cli.main(["train", ...])`). A job with snapshots or a hook log
runs the Trainer API in process (`megagate.train.trainer.train`) with extra callbacks after the default ones:
`WeightSnapshots` saves every parameter after the listed steps, `HookLog` records every hook call in hooks.jsonl.
A job's folder is named by a hash of its overrides and extras: a second request for the same job (from any module)
reuses the finished run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from helpers import forked

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RESULT = "job.json"  # written last: its presence means the job finished (whatever its exit code)
PARALLEL = 2  # jobs at a time
DEMO_VOCAB, DEMO_BYTES = 2048, 1_500_000  # examples/tiny_cpu.yaml's demo data (DataSection defaults)

# The short runs of the monitor tests: seq 64, one micro-batch of 8, warm-up 3, no evaluation but the final one.
TINY = [
    "train.train_steps=30",
    "train.seq_length=64",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
    "train.warmup_steps=3",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.interval=1",
]
# A clean 200-step run at the default monitor settings (tests/train/test_monitor_actions.py and the curves of
# tests/monitor/test_spike.py: the same overrides, so one session trains it once).
CLEAN_200 = [*TINY, "train.train_steps=200", "logging.tensorboard=false"]


def demo_data(tmp_path_factory: Any) -> Path:
    """The demo corpus + tokenizer, built once per session in the folder tests/train's fixture uses too."""
    from megagate.data.demo import prepare_demo_data

    root = tmp_path_factory.getbasetemp() / "megagate-demo-data"
    prepare_demo_data(root, DEMO_VOCAB, DEMO_BYTES)
    return root


@dataclass(frozen=True)
class Run:
    """A finished job: its run directory, exit code (2: a MegagateError, e.g. an abort), error line and console log."""

    dir: Path
    rc: int
    error: str
    log: str
    seconds: float

    def train_records(self) -> list[dict]:
        """metrics.jsonl's train lines in the order written (a rollback replays steps)."""
        return [r for r in read_jsonl(self.dir / "metrics.jsonl") if r["split"] == "train"]

    def by_step(self) -> dict[int, dict]:
        """step -> the last train line of that step."""
        return {r["step"]: r for r in self.train_records()}

    def events(self) -> list[dict]:
        return read_jsonl(self.dir / "events.jsonl")

    def summary(self) -> dict:
        return json.loads((self.dir / "summary.json").read_text())

    def snapshot(self, step: int) -> dict[str, torch.Tensor]:
        return torch.load(self.dir / f"weights_{step:05d}.pt")

    def hooks(self) -> list[tuple]:
        """(hook, step or None) of every hook call HookLog saw, in order."""
        return [(r["hook"], r["step"]) for r in read_jsonl(self.dir / "hooks.jsonl")]


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file ([] if absent); "nan"/"inf" strings become floats, as megagate.monitor.runfiles reads."""
    from megagate.monitor import runfiles

    return runfiles.read_jsonl(path)


def _key(*parts: Any) -> str:
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:12]


def run_jobs(
    tmp_path_factory: Any,
    demo_dir: Path,
    jobs: dict[str, list[str]],
    snapshots: dict[str, list[int]] | None = None,
    hook_logs: set[str] | frozenset = frozenset(),
    timeout: float = 1800,
) -> dict[str, Run]:
    """Run (or reuse) each job: overrides of examples/tiny_cpu.yaml (output.dir and data.demo_dir are added)."""
    snapshots = snapshots or {}
    root = tmp_path_factory.getbasetemp() / "trainer-runs"
    root.mkdir(exist_ok=True)
    extras = {name: {"snapshots": snapshots.get(name, []), "hooks": name in hook_logs} for name in jobs}
    dirs = {
        name: root
        / (
            _key(over, extras[name]["snapshots"])
            if not extras[name]["hooks"]
            else _key(over, extras[name]["snapshots"], "hooks")
        )
        for name, over in jobs.items()
    }
    todo = [
        {
            "dir": str(d),
            "argv": ["--config", str(CONFIG), *jobs[name], f"data.demo_dir={demo_dir}", f"output.dir={d}"],
            **extras[name],
        }
        for name, d in dirs.items()
        if not (d / RESULT).exists()
    ]
    if todo:
        env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        running: list[Any] = []
        failed: list[str] = []
        deadline = time.monotonic() + timeout
        while (todo or running) and time.monotonic() < deadline:
            while todo and len(running) < PARALLEL:
                running += forked.start(_run_job, [(todo.pop(0),)], env=env, cwd=ROOT)
            running[0].join(timeout=0.2)
            failed += [f"{p.name}: exit code {p.exitcode}" for p in running if p.exitcode not in (None, 0)]
            running = [p for p in running if p.exitcode is None]
        forked.join_all(running, timeout=0)  # still running past the timeout: killed
        missing = [name for name, d in dirs.items() if not (d / RESULT).exists()]
        assert not missing, f"jobs {missing} did not finish in {timeout} s ({failed or 'no child failed'})"
    runs = {}
    for name, d in dirs.items():
        result = json.loads((d / RESULT).read_text())
        runs[name] = Run(d, result["rc"], result["error"], (d / "console.log").read_text(), result["seconds"])
    return runs


# --- the child process -------------------------------------------------------------------------------------------
def _test_callbacks(job: dict, out: Path) -> list[Any]:
    from megagate.monitor import runfiles
    from megagate.train.callbacks import Callback

    class WeightSnapshots(Callback):
        """Saves every parameter (full tensors of this single-process run) after the listed steps."""

        def post_step(self, trainer: Any, output: Any) -> None:
            if output.step in job["snapshots"]:
                weights = {name: p.detach().clone() for chunk in trainer.model for name, p in chunk.named_parameters()}
                torch.save(weights, out / f"weights_{output.step:05d}.pt")

    class HookLog(Callback):
        """Appends {hook, step} to hooks.jsonl for every hook call; its state (the call count) is checkpointed."""

        state_key = "hook_log"

        def __init__(self) -> None:
            self.calls = 0

        def _record(self, hook: str, step: int | None = None) -> None:
            self.calls += 1
            runfiles.append_jsonl(out / "hooks.jsonl", {"hook": hook, "step": step})

        def on_start(self, trainer: Any) -> None:
            self._record("on_start")

        def on_step_start(self, trainer: Any, step: int) -> None:
            self._record("on_step_start", step)

        def pre_step(self, trainer: Any, step: int, microbatches: list[dict]) -> list[dict]:
            self._record("pre_step", step)
            return microbatches

        def post_backward(self, trainer: Any, step: int) -> None:
            self._record("post_backward", step)

        def pre_optim_step(self, trainer: Any, update: Any) -> None:
            self._record("pre_optim_step", update.step)

        def post_step(self, trainer: Any, output: Any) -> None:
            self._record("post_step", output.step)

        def post_checkpoint_saved(self, trainer: Any, path: Any, step: int) -> None:
            assert Path(path).name == f"iter_{step:07d}" and (Path(path) / "manifest.json").is_file()
            self._record("post_checkpoint_saved", step)

        def on_end(self, trainer: Any) -> None:
            self._record("on_end")

        def on_close(self, trainer: Any) -> None:
            self._record("on_close")

        def state_dict(self) -> dict[str, Any]:
            return {"calls": self.calls}

    callbacks: list[Any] = [WeightSnapshots()] if job["snapshots"] else []
    return callbacks + ([HookLog()] if job["hooks"] else [])


def _run_one(job: dict) -> tuple[int, str]:
    from megagate import cli
    from megagate.errors import MegagateError

    if not job["snapshots"] and not job["hooks"]:
        return cli.main(["train", *job["argv"]]), ""
    from megagate import config_reader
    from megagate.distributed import parallel
    from megagate.run_setup import resolve
    from megagate.train.trainer import train

    cfg = config_reader.load(job["argv"][1], job["argv"][2:])
    out = Path(job["dir"])
    parallel.init_distributed(0, 1, str(out / "rendezvous"), backend="gloo")
    try:
        train(resolve(cfg, 1), extra_callbacks=_test_callbacks(job, out))
        return 0, ""
    except MegagateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2, str(exc)
    finally:
        parallel.destroy()


def _run_job(job: dict) -> None:
    """The child: one job, its console output in console.log, then job.json (written last)."""
    out = Path(job["dir"])
    shutil.rmtree(out, ignore_errors=True)  # an unfinished earlier attempt must not be resumed
    out.mkdir(parents=True)
    sys.stdout.flush(), sys.stderr.flush()
    start = time.perf_counter()
    with open(out / "console.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            rc, error = _run_one(job)
        except BaseException:  # noqa: BLE001 - recorded for the test to report
            traceback.print_exc()
            rc, error = 99, "exception (see console.log)"
        finally:
            sys.stdout.flush(), sys.stderr.flush()
    if rc == 2 and not error:  # the CLI printed the one-line error: keep it
        lines = [x for x in (out / "console.log").read_text().splitlines() if x.startswith("megagate train: error:")]
        error = lines[-1] if lines else ""
    seconds = time.perf_counter() - start
    (out / RESULT).write_text(json.dumps({"rc": rc, "error": error, "seconds": seconds}))
