"""Running megatron-core on a machine without CUDA (tests, the CPU demo, gloo process groups).

megatron-core hard-codes CUDA in a few places that the CPU path still reaches: `torch.cuda.current_device()` used as
a device, literal `device="cuda"` tensors (pipeline schedules, gradient clipping, the MoE router), and the CUDA RNG
state used by the model-parallel RNG tracker. This module redirects exactly those look-ups to the CPU, and nothing
else:

* each listed megatron module sees a proxy in place of its global `torch`, whose factory functions map a CUDA device
  to the CPU and whose `torch.cuda` answers `current_device()` with the CPU device and keeps RNG state on the CPU
  generator. Other modules, and the real `torch` module, are untouched;
* `tensor_parallel.random`'s two RNG-state helpers are replaced by CPU equivalents;
* megatron's mixed-precision optimizers classify parameters by CUDA type names in their constructors, and the
  tied-embedding set-up of pipeline stages calls `.cuda()`; inside those methods only, CPU tensors report the CUDA
  name of their dtype and `.cuda()` leaves them on the CPU;
* torch.compile (megatron's `jit_fuser`) is disabled: fusions only, compiling them on the CPU costs seconds;
* `moe_utils.te_general_gemm`, only defined when Transformer Engine imports, is set to None so megatron takes its
  non-TE branch.

`install()` is a no-op when CUDA is available, and refuses megatron-core versions it was not checked against
(the list of patched modules is version-specific).
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Callable
from typing import Any

import torch
from packaging.version import Version

from megagate.errors import MegagateError

# Checked against these releases: the hard-coded CUDA calls below were read from their sources.
SUPPORTED_MEGATRON = ("0.19.0", "0.20.0")  # [min, max)

# megatron modules whose global `torch` is replaced by the CPU proxy: those on the training path that create
# tensors on, or query, the CUDA device (found by reading megatron-core 0.19.2's sources).
PATCHED_MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.transformer.module",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.moe_logging",
    "megatron.core.ssm.gated_delta_net.common",
    "megatron.core.ssm.gated_delta_net.gdn",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)

_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "as_tensor",
)

_installed = False


def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spec (str, int, torch.device) to the CPU; leave others as they are."""
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _on_cpu(factory: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    wrapper.__name__ = getattr(factory, "__name__", "factory")
    return wrapper


class _CpuCuda:
    """Stands in for `torch.cuda` inside the patched modules."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 0

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def current_stream(device: Any = None) -> Any:
        return _NullStream()

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    random = types.SimpleNamespace(
        get_rng_state=lambda device="cuda": torch.get_rng_state(),
        set_rng_state=lambda state, device="cuda": torch.set_rng_state(state),
    )


class _NullStream:
    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _CpuTorch:
    """Stands in for the `torch` module inside the patched megatron modules."""

    def __init__(self) -> None:
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        # kept on the instance: megatron looks `torch.<name>` up hundreds of times per training step, and a
        # Python __getattr__ per lookup was a measurable share of a small CPU step
        value = getattr(torch, name)
        self.__dict__[name] = value
        return value


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


@contextlib.contextmanager
def _cpu_tensors_report_cuda_types() -> Any:
    """While active, CPU tensors pass for CUDA tensors: `tensor.type()` gives the CUDA type name of their dtype
    ('torch.cuda.FloatTensor', ...) and `tensor.cuda()` leaves them where they are."""
    original_type, original_cuda = torch.Tensor.type, torch.Tensor.cuda

    def cuda_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original_type(self).replace("torch.", "torch.cuda.", 1)
        return original_type(self, dtype, non_blocking, **kwargs)

    def stay_on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.type, torch.Tensor.cuda = cuda_type, stay_on_cpu
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = original_type, original_cuda


def _with_cuda_type_names(cls: type, method: str = "__init__") -> None:
    # megatron's mixed-precision optimizers sort parameters by `param.type() == 'torch.cuda.FloatTensor'` etc.
    # in their constructors, and the tied-embedding set-up moves a weight with `.cuda()`; the CPU tensors are the
    # same dtypes, so inside those methods only, they pass for CUDA tensors.
    original = getattr(cls, method)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _cpu_tensors_report_cuda_types():
            return original(self, *args, **kwargs)

    setattr(cls, method, wrapped)


def _call_with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cpu_tensors_report_cuda_types():
            return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "wrapped")
    return wrapper


def check_megatron_version(version: str) -> None:
    """Refuse megatron-core releases whose CUDA call sites were not checked."""
    low, high = (Version(v) for v in SUPPORTED_MEGATRON)
    if not low <= Version(version) < high:
        raise MegagateError(
            f"megatron-core {version} is not supported on CPU by megagate.distributed.megatron_cpu "
            f"(checked: >={SUPPORTED_MEGATRON[0]},<{SUPPORTED_MEGATRON[1]}); install megatron-core==0.19.2"
        )


def install(force: bool = False) -> bool:
    """Adapt megatron-core for CPU execution if CUDA is absent. Returns True if the adaptation is active."""
    global _installed
    if _installed:
        return True
    if torch.cuda.is_available() and not force:
        return False
    from megatron.core import package_info

    check_megatron_version(package_info.__version__)
    proxy = _CpuTorch()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = proxy
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = _cpu_get_rng_state
    random._set_cuda_rng_state = _cpu_set_rng_state
    # megatron's `jit_fuser` is torch.compile; on the CPU inductor spends seconds compiling C++ for each fused
    # element-wise op and gains nothing measurable on tiny models, so run those functions eagerly.
    torch._dynamo.config.disable = True
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    distrib_optimizer = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    _with_cuda_type_names(optimizer.Float16OptimizerWithFloat16Params)
    _with_cuda_type_names(distrib_optimizer.DistributedOptimizer)
    language_module = importlib.import_module("megatron.core.models.common.language_module.language_module")
    _with_cuda_type_names(language_module.LanguageModule, "setup_embeddings_and_output_layer")
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    clip = _call_with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)  # asserts fp32 grads by CUDA name
    for module in (clip_grads, optimizer):
        module.clip_grad_by_total_norm_fp32 = clip
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _installed = True
    return True


_torch_adam_fixed = False


def fix_torch_adam_checkpoint_load() -> None:
    """Let DistributedOptimizer load checkpoints when it runs torch's Adam (no Transformer Engine, no apex).

    torch's Adam keeps a per-parameter `step` tensor; megatron restores the step from the saved param groups but,
    in `_set_main_param_and_optimizer_states`, also expects every tensor of the live state (`step` included) in the
    saved per-parameter tensors, which hold only param / exp_avg / exp_avg_sq. Marking `step` as absent there lets
    megatron skip it. The dp_reshardable format does hand a `step` over: the state's own tensor from before the load
    (a non-persistent entry, not the saved step), whose copy would reset every restored step to the placeholder's;
    it is dropped too. Applies on GPU machines without TE/apex too; a no-op when they are installed.
    """
    global _torch_adam_fixed
    distrib_optimizer = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    if _torch_adam_fixed or getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return
    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: dict) -> None:
        # the step always comes from the saved param groups (megatron's load_state_dict); never from here
        tensors = {**tensors, "step": None}  # non-tensor entries are skipped by megatron
        original(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = set_states
    _torch_adam_fixed = True


def unshare_adam_steps(optimizer: Any) -> None:
    """After a checkpoint load: give each parameter its own Adam `step` tensor.

    megatron's DistributedOptimizer (torch-Adam path) assigns one step tensor object to every parameter's state;
    torch's Adam increments each parameter's step in place, so a shared tensor would advance once per parameter
    per update and corrupt the bias correction after a resume.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
