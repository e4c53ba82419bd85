"""The frontier search's settings (`FrontierSpec`), validated before anything runs, and what a trial runs with.

A trial is one `megagate train` of the base config with overrides: the variant's gate preset, the LR, the seed, its
run directory `OUT/<variant>_lr<lr>_s<seed>`, and its early-stop rules (`monitor.early_stop`): non-finite loss,
loss above its start after warm-up, more loss spikes than the health rule allows, and successive-halving rungs.

Rungs: at steps T/eta^k (k = 1, 2, ...; T = train.train_steps) that leave `window` steps after warm-up, a trial
whose mean loss over the last `window` steps is above the best trial of its variant at that step (the lowest such
mean among the variant's trials that ran every step, in earlier rounds) by more than `margin` nats is stopped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megagate.errors import ConfigError
from megagate.frontier.rule import HealthRule, TrialOutcome
from megagate.frontier.search import SCHEDULES, Plan, plan_variant

OWNED_KEYS = ("train.lr", "model.gate.preset", "seed", "output.dir")  # set per trial by the search
OWNED_PREFIX = "monitor.early_stop."


@dataclass(frozen=True)
class EarlyStopSpec:
    """How trials are stopped once decided (the trial-side rules; `margin` and `eta` make the rungs)."""

    margin: float = 0.5  # nats above the best trial at a rung
    eta: float = 2.0  # rungs at T/eta, T/eta^2, ...
    window: int = 10  # losses averaged at a rung and for above_start
    enabled: bool = True  # False: every trial runs to its last step (the search still works, at grid cost)


@dataclass(frozen=True)
class FrontierSpec:
    config: str
    variants: tuple[str, ...]
    lo: float
    hi: float
    seeds: tuple[int, ...] = (0,)
    coarse: int = 2
    resolution: float = 0.25  # decades
    schedule: str = "wide"  # megagate.frontier.search.SCHEDULES: wide (fewer rounds) or thrifty (fewer trial-steps)
    rule: HealthRule = field(default_factory=HealthRule)
    early: EarlyStopSpec = field(default_factory=EarlyStopSpec)
    overrides: tuple[str, ...] = ()
    budget: int | None = None  # trial-steps; None: unlimited
    max_attempts: int = 3  # launches of a trial killed for a non-stability reason before it is given up
    train_steps: int = 0  # from the config (filled by `resolve`)
    warmup_steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FrontierSpec:
        d = dict(d)
        d["rule"] = HealthRule(**d["rule"])
        d["early"] = EarlyStopSpec(**d["early"])
        for key in ("variants", "seeds", "overrides"):
            d[key] = tuple(d[key])
        return cls(**d)

    def plan(self, outcomes: Mapping[tuple[float, int], TrialOutcome]) -> Plan:
        """The search's next step for one variant from its decided trials, keyed (lr, seed): what the driver runs
        and what the report shows."""
        return plan_variant(
            self.lo, self.hi, self.coarse, self.resolution, self.seeds, self.rule, outcomes, self.schedule
        )

    def rungs(self) -> list[int]:
        """Rung steps, ascending."""
        if not self.early.enabled:
            return []
        out, k = [], 1
        while True:
            step = int(self.train_steps / self.early.eta**k)
            if step < self.warmup_steps + self.early.window:
                return sorted(out)
            out.append(step)
            k += 1

    def trial_name(self, variant: str, lr: float, seed: int) -> str:
        return f"{variant}_lr{lr:g}_s{seed}".replace("+", "")

    def trial_overrides(
        self, variant: str, lr: float, seed: int, run_dir: str | Path, rungs: Sequence[tuple[int, float]] = ()
    ) -> list[str]:
        """The `megagate train` overrides of one trial (rungs: (step, best mean loss) from earlier rounds)."""
        out = [*self.overrides, f"train.lr={lr!r}", f"model.gate.preset={variant}", f"seed={int(seed)}"]
        if self.early.enabled:
            es = "monitor.early_stop"
            out += [f"{es}.nonfinite=true", f"{es}.above_start=true", f"{es}.window={self.early.window}"]
            out += [f"{es}.max_loss_spikes={self.rule.max_loss_spikes}", f"{es}.margin={self.early.margin!r}"]
            if rungs:
                out.append(f"{es}.rungs=[{','.join(f'[{s},{v!r}]' for s, v in rungs)}]")
        return [*out, f"output.dir={run_dir}"]

    def reached_width(self) -> float:
        """The bracket width the bisection ends at: the coarse spacing halved until <= resolution (decades)."""
        step = math.log10(self.hi / self.lo) / (self.coarse - 1)
        while step > self.resolution * (1 + 1e-9):
            step /= 2
        return step

    def grid_compute(self, width: float | None) -> tuple[int, int]:
        """(points, trial-steps) of the full grid over [lo, hi] at log spacing `width` decades (every variant and
        seed run to the last step): what the search is compared with."""
        span = math.log10(self.hi / self.lo)
        step = width if width else span / (self.coarse - 1)
        points = int(math.floor(span / step + 1e-6)) + 1
        return points, points * len(self.variants) * len(self.seeds) * self.train_steps


def validate(spec: FrontierSpec) -> None:
    """One-line ConfigError for the first bad setting (before the config is read: cheap checks first)."""
    from megagate.model import gate as gates

    for name, value in (("low", spec.lo), ("high", spec.hi)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"--lr-range {name} end {value!r} must be a positive finite learning rate")
    if spec.lo > spec.hi:
        raise ConfigError(f"--lr-range {spec.lo:g}:{spec.hi:g} is inverted: give LOW:HIGH with LOW < HIGH")
    if spec.lo == spec.hi:
        raise ConfigError(f"--lr-range {spec.lo:g}:{spec.hi:g} is empty: give LOW:HIGH with LOW < HIGH")
    if not spec.variants:
        raise ConfigError("--variants is empty: give gate presets, e.g. baseline,g1-elementwise")
    for v in spec.variants:
        if v not in gates.PRESETS:
            raise ConfigError(f"--variants {v!r} is not a gate preset; presets: {', '.join(gates.PRESETS)}")
    if len(set(spec.variants)) != len(spec.variants):
        raise ConfigError(f"--variants {','.join(spec.variants)} names a variant twice")
    if not spec.seeds or len(set(spec.seeds)) != len(spec.seeds) or any(s < 0 for s in spec.seeds):
        raise ConfigError(f"--seeds {','.join(map(str, spec.seeds))} must be distinct non-negative integers")
    if spec.coarse < 2:
        raise ConfigError(f"--coarse {spec.coarse} must be >= 2 (the bracket's two ends)")
    if spec.schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {spec.schedule!r} is not a schedule; give one of {', '.join(SCHEDULES)}")
    if not math.isfinite(spec.resolution) or spec.resolution <= 0:
        raise ConfigError(f"--resolution {spec.resolution:g} must be a positive number of decades")
    if spec.resolution < 1e-3:
        raise ConfigError(f"--resolution {spec.resolution:g} is finer than LRs are named (>= 0.001 decades)")
    if spec.budget is not None and spec.budget <= 0:
        raise ConfigError(f"--budget {spec.budget} must be a positive number of trial-steps (omit it: no limit)")
    if spec.max_attempts < 1:
        raise ConfigError(f"--max-attempts {spec.max_attempts} must be >= 1")
    spec.rule.validate(len(spec.seeds))
    e = spec.early
    if not math.isfinite(e.margin) or e.margin < 0:
        raise ConfigError(f"--margin {e.margin:g} must be a non-negative number of nats")
    if e.margin < spec.rule.delta:
        raise ConfigError(
            f"--margin {e.margin:g} is below --delta {spec.rule.delta:g}: a rung would stop trials the health "
            "rule still calls healthy; give margin >= delta"
        )
    if not math.isfinite(e.eta) or e.eta <= 1:
        raise ConfigError(f"--eta {e.eta:g} must be > 1 (rungs at T/eta, T/eta^2, ...)")
    if e.window < 1:
        raise ConfigError(f"--window {e.window} must be >= 1 step")
    for o in spec.overrides:
        key = o.split("=", 1)[0]
        if "=" not in o:
            raise ConfigError(f"override {o!r} is not key=value")
        if key in OWNED_KEYS or key.startswith(OWNED_PREFIX):
            raise ConfigError(f"override {o!r}: {key} is set per trial by the frontier search")


def resolve(spec: FrontierSpec, out_dir: str | Path, world_size: int = 1) -> FrontierSpec:
    """Read the config as every trial will (the trainer's loader and layout check on `world_size` ranks) and fill in
    train_steps and warmup_steps; refuse a config under which no trial could ever be healthy."""
    from megagate import config_reader, run_config
    from megagate.yamlfile import load_mapping

    load_mapping(spec.config)  # a missing or broken file: one error
    cfg = None
    for variant in spec.variants:
        for lr in (spec.lo, spec.hi):
            name = spec.trial_name(variant, lr, spec.seeds[0])
            overrides = spec.trial_overrides(variant, lr, spec.seeds[0], Path(out_dir) / name)
            try:
                cfg = config_reader.load(spec.config, overrides)
                run_config.layout(cfg, world_size)
            except ConfigError as exc:
                raise ConfigError(f"frontier trial {name}: {exc}") from None
    t = cfg.train
    if t.exit_after_steps is not None and t.exit_after_steps < t.train_steps:
        raise ConfigError(
            f"train.exit_after_steps={t.exit_after_steps} < train.train_steps={t.train_steps}: no trial could run "
            "every step, so none could ever be healthy"
        )
    spec = dataclasses.replace(spec, train_steps=t.train_steps, warmup_steps=t.warmup_steps)
    if spec.rule.max_loss_spikes and not cfg.monitor.spike.enabled:
        raise ConfigError(
            f"--max-loss-spikes {spec.rule.max_loss_spikes} needs the spike monitor (monitor.spike.enabled is false)"
        )
    return spec


__all__ = ["OWNED_KEYS", "EarlyStopSpec", "FrontierSpec", "resolve", "validate"]
