"""A minimal real training loop for monitor tests: a tiny gated GPT (megagate's model API), AdamW, byte-level text.

Not the project's trainer: just enough to produce real loss / grad-norm curves and to exercise the monitor's
actions (skip, lr_backoff, rollback, abort) with real weights.
"""

from __future__ import annotations

import copy
import math
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from megagate.model import gate as gates
from megagate.model.build import build_gpt_model, transformer_config
from megagate.model.config import model_preset
from megagate.monitor.faults import FaultInjector
from megagate.monitor.spike import SpikeMonitor, worst_action

_TEXT_CACHE: dict[int, torch.Tensor] = {}


def corpus_tokens(max_bytes: int = 400_000) -> torch.Tensor:
    """Byte tokens of real English/Python text: the standard library's own sources (docstrings and code)."""
    if max_bytes not in _TEXT_CACHE:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        chunks, size = [], 0
        for name in ("argparse.py", "textwrap.py", "difflib.py", "pathlib.py", "json/decoder.py", "inspect.py",
                     "typing.py", "dataclasses.py", "functools.py"):  # fmt: skip
            path = stdlib / name
            if path.exists():
                data = path.read_bytes()
                chunks.append(data)
                size += len(data)
            if size >= max_bytes:
                break
        data = b"\n".join(chunks)[:max_bytes]
        _TEXT_CACHE[max_bytes] = torch.tensor(list(data), dtype=torch.long)
    return _TEXT_CACHE[max_bytes]


def batch_at(index: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Deterministic batch number `index` of [batch, seq + 1] tokens (input + next-token label)."""
    data = corpus_tokens()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])


def build(preset: str = "g1-elementwise", seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    mc = model_preset("tiny", gate=gates.preset(preset), **overrides)
    return build_gpt_model(mc, transformer_config(mc))


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # per step, as observed (after fault injection)
    grad_norms: list[float] = field(default_factory=list)
    events: list = field(default_factory=list)
    actions: dict[int, str] = field(default_factory=dict)
    aborted_at: Optional[int] = None
    snapshots: dict[int, dict] = field(default_factory=dict)  # step -> params after that step (when asked)
    model: Optional[torch.nn.Module] = None


def train(steps: int, lr: float = 3e-3, preset: str = "g1-elementwise", seed: int = 0, batch: int = 8, seq: int = 64,
          monitor: Optional[SpikeMonitor] = None, faults: Optional[FaultInjector] = None, checkpoint_every: int = 0,
          snapshot_steps: tuple[int, ...] = (), warmup: int = 20) -> TrainResult:  # fmt: skip
    """Train `steps` steps; with a monitor, observe every step before the update and carry out its action."""
    faults = faults or FaultInjector()
    model = build(preset, seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    res = TrainResult(model=model)
    checkpoint: Optional[dict] = None
    step = 1
    while step <= steps:
        index = monitor.data_index(step) if monitor else step
        tokens = faults.batch(step, batch_at(index, batch, seq, seed), vocab_size=256)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        position_ids = torch.arange(seq).unsqueeze(0).expand(batch, -1)
        loss = model(inputs, position_ids, None, labels=labels).mean()
        loss = faults.loss(step, loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        faults.grads(step, model.parameters())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        metrics = {"loss": float(loss), "grad_norm": grad_norm}
        action = None
        if monitor is not None:
            events = monitor.observe(step, metrics)
            res.events.extend(events)
            action = worst_action(events)
        if action is not None:
            res.actions[step] = action
        if action == "abort":
            res.aborted_at = step
            break
        if action == "rollback":
            if checkpoint is None:
                raise RuntimeError("rollback without a checkpoint")
            plan = monitor.rollback_plan(step, checkpoint["step"])
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["opt"])
            monitor.restore_after_rollback(checkpoint["monitor"], plan, step)
            del res.losses[plan.restore_step:], res.grad_norms[plan.restore_step:]
            step = plan.restore_step + 1
            continue
        res.losses.append(metrics["loss"])
        res.grad_norms.append(grad_norm)
        if action != "skip":  # skip: discard this update (the data still moves on)
            scale = (monitor.lr_scale(step) if monitor else 1.0) * faults.lr_scale(step)
            warm = min(1.0, step / warmup) if warmup else 1.0
            for group in opt.param_groups:
                group["lr"] = lr * warm * scale
            opt.step()
        if step in snapshot_steps:
            res.snapshots[step] = {k: v.detach().clone() for k, v in model.named_parameters()}
        if checkpoint_every and step % checkpoint_every == 0:
            checkpoint = {"step": step, "model": copy.deepcopy(model.state_dict()),
                          "opt": copy.deepcopy(opt.state_dict()), "monitor": monitor.state_dict() if monitor else None}  # fmt: skip
        step += 1
    return res


def finite(xs: list[float]) -> bool:
    return all(math.isfinite(x) for x in xs)
