"""Planning a run before it starts: per-GPU memory of every rank role and a step-time estimate (docs/planning.md).

`plan(cfg, world_size, gpu)` returns a `Plan` with `.fits`, `.table()` and `.refusal()`; `search` ranks the layouts
that fit. Pure arithmetic on the config: no torch, no process group.
"""

from megagate.plan.core import Plan, Role, plan
from megagate.plan.devices import DEVICES, Device, device

__all__ = ["DEVICES", "Device", "Plan", "Role", "device", "plan"]
