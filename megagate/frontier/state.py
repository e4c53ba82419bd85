"""frontier.json: the search's durable state, rewritten atomically (temp file + rename) after every change.

    {"version": 1, "spec": {...FrontierSpec}, "backend": {"kind": "local"|"slurm", ...},
     "trials": {name: {"variant", "lr", "seed", "status", "attempts", "failures", "round", "outcome", "rung_means",
                       "lost_steps", "history"}},
     "rounds": [{"index", "trials", "started", "finished", "jobs"}],
     "done": false, "stop_reason": null}

A trial's status: `pending` (launched in the open round, or waiting to be launched again), `done` (its outcome is
known: it ran every step, or stopped early, or the monitor aborted it) or `lost` (it failed for a non-stability
reason `max_attempts` times: never counted as unstable, the search cannot decide its point). Whatever was
written before an interruption is what a rerun starts from: finished trials are never run again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megagate.errors import ConfigError, MegagateError
from megagate.frontier.rule import TrialOutcome
from megagate.frontier.spec import FrontierSpec
from megagate.monitor import runfiles
from megagate.sections import read_fields

STATE_FILE = "frontier.json"
VERSION = 1


@dataclass
class Trial:
    variant: str
    lr: float
    seed: int
    status: str = "pending"  # pending | done | lost
    attempts: int = 0  # launches
    failures: int = 0  # launches that ended without a decision (killed, preempted, timed out, crashed)
    round: int = 0  # the round it was (last) launched in
    outcome: TrialOutcome | None = None
    rung_means: dict[int, float] = field(default_factory=dict)  # its mean loss at the rung steps (ran every step)
    lost_steps: int = 0  # steps of discarded attempts (restarted from scratch)
    history: list[str] = field(default_factory=list)  # what happened to each attempt that did not decide

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rung_means"] = {str(k): v for k, v in self.rung_means.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: str = "trial") -> Trial:
        # as to_dict wrote it: the numbers unchecked (a diverged trial's loss is NaN), rung_means' JSON text keys
        # numbers again
        return cls(**read_fields(cls, d, path, scalars=False))

    @property
    def steps_run(self) -> int:
        """Compute spent on this trial: the steps of its decisive run plus those of discarded attempts."""
        return (self.outcome.steps if self.outcome else 0) + self.lost_steps


@dataclass
class FrontierState:
    spec: FrontierSpec
    backend: dict[str, Any]
    trials: dict[str, Trial] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    stop_reason: str | None = None  # why the search ended before every bracket was at resolution (budget, lost)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "spec": self.spec.to_dict(),
            "backend": self.backend,
            "trials": {name: t.to_dict() for name, t in self.trials.items()},
            "rounds": self.rounds,
            "done": self.done,
            "stop_reason": self.stop_reason,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: Path) -> FrontierState:
        if d.get("version") != VERSION:
            raise MegagateError(f"{path}: frontier state version {d.get('version')!r} is not {VERSION}")
        for key, kind in (("trials", dict), ("rounds", list)):
            if key in d and not isinstance(d[key], kind):
                raise MegagateError(
                    f"{path}: {key} is a {type(d[key]).__name__}, not a {kind.__name__} (not a frontier state file)"
                )
        try:
            return cls(
                spec=FrontierSpec.from_dict(d["spec"]),
                backend=dict(d["backend"]),
                trials={name: Trial.from_dict(t, f"trials.{name}") for name, t in d["trials"].items()},
                rounds=list(d["rounds"]),
                done=bool(d["done"]),
                stop_reason=d.get("stop_reason"),
            )
        except (ConfigError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MegagateError(f"{path}: not a frontier state file ({type(exc).__name__}: {exc})") from None

    def of_variant(self, variant: str) -> Iterator[tuple[str, Trial]]:
        return ((n, t) for n, t in self.trials.items() if t.variant == variant)

    @property
    def spent(self) -> int:
        return sum(t.steps_run for t in self.trials.values())

    @property
    def open_round(self) -> dict[str, Any] | None:
        return self.rounds[-1] if self.rounds and self.rounds[-1].get("finished") is None else None


def load(out_dir: str | Path) -> FrontierState | None:
    path = Path(out_dir) / STATE_FILE
    data = runfiles.read_json(path)
    return None if data is None else FrontierState.from_dict(data, path)


def save(out_dir: str | Path, state: FrontierState) -> None:
    runfiles.write_json(Path(out_dir) / STATE_FILE, state.to_dict())


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


__all__ = ["STATE_FILE", "FrontierState", "Trial", "load", "now", "save"]
