"""The Trainer's callback contract, on a real run: hook order, a restore that drops the current step, callback state
in checkpoints; and the layering of the trainer's modules (who may import the loop)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from helpers import trainer_jobs
from megagate.train.callbacks.base import TrainerView

PACKAGE = Path(__file__).resolve().parents[2] / "megagate"
STEP_HOOKS = ("on_step_start", "pre_step", "post_backward", "pre_optim_step", "post_step")
K = 5  # a x10 loss at step 5 makes the spike monitor roll back to the step-4 checkpoint


@pytest.fixture(scope="module")
def hook_run(tmp_path_factory: pytest.TempPathFactory, session_demo_dir: Path) -> trainer_jobs.Run:
    section = {"spike": {"action": "rollback", "min_history": 3}, "faults": [{"step": K, "kind": "scale_loss"}]}
    job = [
        *trainer_jobs.TINY,
        "train.train_steps=6",
        "checkpoint.interval=2",
        "logging.tensorboard=false",
        "monitor=" + json.dumps(section),
    ]
    run = trainer_jobs.run_jobs(tmp_path_factory, session_demo_dir, {"hooks": job}, hook_logs={"hooks"})["hooks"]
    assert run.rc == 0, run.log[-3000:]
    return run


@pytest.mark.slow
def test_hook_order_and_a_restore_that_drops_the_step(hook_run: trainer_jobs.Run) -> None:
    def step(s: int, hooks: tuple[str, ...] = STEP_HOOKS) -> list[tuple]:
        return [(hook, s) for hook in hooks]

    def saved(s: int) -> list[tuple]:
        # checkpoint.interval=2: Checkpointing (priority 20) saves in its post_step, before the test callback's (0)
        return step(s)[:-1] + [("post_checkpoint_saved", s), ("post_step", s)] if s % 2 == 0 else step(s)

    expected = [("on_start", None)]
    for s in range(1, K):
        expected += saved(s)
    # the spike monitor (priority 70, before the test callback) restores during pre_optim_step: the later callbacks'
    # pre_optim_step and every post_step of that step are not called, and the loop goes on after step 4
    expected += step(K, STEP_HOOKS[:3])
    for s in range(K, 7):
        expected += step(s)
    # the final checkpoint is saved (Evaluation's on_end: before the final validation) before the test's on_end
    expected += [("post_checkpoint_saved", 6), ("on_end", None), ("on_close", None)]
    assert hook_run.hooks() == expected
    assert "rollback: spike at step 5; restored step 4" in hook_run.log
    assert [r["step"] for r in hook_run.train_records()] == [1, 2, 3, 4, 5, 6]  # the dropped step 5 is not logged


@pytest.mark.slow
def test_callback_state_is_in_every_checkpoint(hook_run: trainer_jobs.Run) -> None:
    from megagate import checkpoint

    final = checkpoint.read_meta(checkpoint.latest(hook_run.dir / "checkpoints"))
    # saved at the end before the test callback heard of it (post_checkpoint_saved), and before its on_end, on_close
    assert final["step"] == 6 and final["x_hook_log"] == {"calls": len(hook_run.hooks()) - 3}
    assert final["x_monitor"]["rollbacks"] == [{"event_step": K, "restore_step": 4, "skip_first": K, "skip_last": K}]
    assert final["x_faults"] == {"fired": [0]}  # the fault fired once: the replayed step 5 ran clean


# --- layering ------------------------------------------------------------------------------------------------------
def imports(module: str) -> set[str]:
    """megagate modules `module` imports anywhere (module level or in a function), except under TYPE_CHECKING."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megagate"):
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("megagate")}
    return {
        m
        for m in found
        if (PACKAGE.parent / (m.replace(".", "/") + ".py")).exists()
        or (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists()
    }


def closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += imports(m)
    return seen - {module}


@pytest.mark.parametrize(
    "module",
    [
        "megagate.model_factory",
        "megagate.commands.analyze",
        "megagate.analysis.analyze",
        "megagate.analysis.report",
        "megagate.train.components",
        "megagate.train.callbacks.base",
    ],
)
def test_analysis_and_setup_do_not_import_the_loop(module: str) -> None:
    assert "megagate.train.trainer" not in closure(module)


def test_monitor_imports_neither_the_config_reader_nor_the_trainer() -> None:
    for path in sorted((PACKAGE / "monitor").glob("*.py")):
        deps = closure(f"megagate.monitor.{path.stem}")
        assert not {d for d in deps if d.startswith(("megagate.run_config", "megagate.config_", "megagate.train"))}, (
            path.name
        )


def test_callbacks_reach_the_trainer_only_through_the_hooks() -> None:
    for path in sorted((PACKAGE / "train" / "callbacks").glob("*.py")):
        name = "megagate.train.callbacks" + ("" if path.stem == "__init__" else f".{path.stem}")
        assert "megagate.train.trainer" not in closure(name), path.name


def test_callback_order_is_declared_by_priority() -> None:
    from megagate import config_reader
    from megagate.run_setup import resolve
    from megagate.train.callbacks import Callback, default_callbacks
    from megagate.train.callbacks.base import in_priority_order

    raw = {"model": {"preset": "tiny"}, "data": {"mock": True}, "train": {"train_steps": 10, "warmup_steps": 2}}
    raw["monitor"] = {"spike": {"action": "skip"}, "faults": [{"step": 2, "kind": "scale_loss"}]}
    raw["monitor"]["diagnostics"] = {"interval": 5}
    raw["perf"] = {"manual_gc_interval": 3, "profile": {"steps": [2, 3]}}
    cfg = config_reader.from_dict(raw, environment=False)

    class Mine(Callback):
        pass

    given = [Mine(), *reversed(default_callbacks(resolve(cfg, 1)))]  # list position no longer matters
    order = [type(cb).__name__ for cb in in_priority_order(given)]
    assert order == [
        "StopChecks",
        "MetricsLogger",
        "FaultInjection",
        "SpikeMonitoring",
        "LiveDiagnostics",
        "StragglerReport",
        "ManualGC",
        "Profiling",
        "Evaluation",
        "Checkpointing",
        "RunSummary",
        "Mine",  # priority 0: after every built-in
    ]
    a, b = Mine(), Mine()
    assert in_priority_order([a, b]) == [a, b] and in_priority_order([b, a]) == [b, a]  # stable among equals


def test_no_callback_reaches_into_another() -> None:
    """Callbacks talk through hooks (post_checkpoint_saved, log_metrics) and generic trainer operations
    (record_metric, record_summary): no callback looks another up (the spike events' and the diagnostics' series,
    histograms included, reach TensorBoard through record_metric), and TrainerView offers no lookup."""
    for path in sorted((PACKAGE / "train" / "callbacks").glob("*.py")):
        text = path.read_text()
        assert "callback(" not in text.replace("def callback(", ""), f"{path.name} looks up a callback"
        assert "summary[" not in text, f"{path.name} writes trainer.summary"
        assert ".writer" not in text or path.name == "metrics.py", f"{path.name} reaches for a TensorBoard writer"
    assert not hasattr(TrainerView, "callback")
