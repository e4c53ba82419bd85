"""Process groups: torch.distributed + megatron's parallel state, on CPU (gloo) or GPU (nccl): a command's
launched world (`process_group`), a file-rendezvous world (`init_distributed`), the one-process world of tools."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import torch

from megagate import console
from megagate.distributed import launch, megatron_cpu
from megagate.distributed.utils import single_process_port
from megagate.model.model_config import ParallelConfig


def initialize_model_parallel(parallel: ParallelConfig, seed: int = 1234) -> None:
    """megatron's parallel state and model-parallel RNG for an initialised torch.distributed world."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    megatron_cpu.install()
    with console.native_stdout_filtered():  # gloo prints a line per process group it creates
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
            # megatron's groups time out with the world group (launch.distributed_timeout_minutes: save-safe)
            distributed_timeout_minutes=launch.distributed_timeout_minutes(),
        )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def init_distributed(rank: int, world_size: int, init_file: str, backend: str | None = None) -> None:
    """torch.distributed over a shared file (tests, single-host runs); gloo without CUDA."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "gloo":
        console.install_cpu()
    with console.native_stdout_filtered():
        torch.distributed.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )


def destroy() -> None:
    """Tear down megatron's parallel state and the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def process_group() -> Iterator[launch.DistEnv]:
    """The launcher's world for one command (`train`, `eval`): started (outside a launcher, one process on a free
    rendezvous port), yielded, then megatron's parallel state and the process group torn down however it ends."""
    single_process_port()
    env = launch.init_process_group()
    try:
        yield env
    finally:
        destroy()


@contextlib.contextmanager
def single_process(parallel: ParallelConfig = ParallelConfig(), seed: int = 1234) -> Iterator[None]:
    """A world of one process with megatron's parallel state (to build models outside a launcher)."""
    owns_world = not torch.distributed.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        if owns_world:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            init_distributed(0, 1, os.path.join(tmp, "rendezvous"), backend="gloo")
        try:
            initialize_model_parallel(parallel, seed)
            yield
        finally:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            if owns_world:
                torch.distributed.destroy_process_group()


_KEPT: list[contextlib.ExitStack] = []  # the one-process world ensure_single_process opened (kept until exit)


def ensure_single_process() -> None:
    """A one-process megatron world with TP = PP = 1 for a tool that builds a whole model (analysis, export,
    import): the caller's if one is active (refused unless TP = PP = 1), else one opened here and kept until the
    process exits."""
    from megatron.core import parallel_state

    from megagate.errors import MegagateError

    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if tp != 1 or pp != 1:
            raise MegagateError(
                f"analysis builds the whole model in one process; the active parallel state has TP={tp}, PP={pp}"
            )
        return
    import atexit

    stack = contextlib.ExitStack()
    stack.enter_context(single_process())
    _KEPT.append(stack)
    atexit.register(stack.close)
