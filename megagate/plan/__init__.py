"""Planning a run before it starts: per-GPU memory of every rank role and a step time from the work (docs/planning.md).

`plan(cfg, world_size, gpu)` returns a `Plan` with `.fits`, `.table()`, `.to_dict()` and `.refusal()`; `search`
ranks the layouts that fit. The time side models each layer's GEMMs, attention, memory-bound work, communication
and host overhead on a device profile (`megagate calibrate` measures one; a GPU without one gets its datasheet and
constants fitted on published Megatron runs). Pure arithmetic on the config: no torch, no process group.
"""

from megagate.plan.core import Plan, Role, plan
from megagate.plan.devices import GPUS, GpuSpec, gpu_spec

__all__ = ["GPUS", "GpuSpec", "Plan", "Role", "gpu_spec", "plan"]
