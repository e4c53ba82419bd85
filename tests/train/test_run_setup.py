"""RunSetup: a run's config resolved once for its machine, and everything downstream reading that one resolution.

The count is taken on a real `megagate train` (a child process, mock data, two steps) with `sys.monitoring` watching
the code objects of `run_setup.resolve`, `perf.resolve_perf` and `kernels.resolve_backend`: nothing is patched or
replaced, the trainer runs as a user runs it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megagate import config_reader
from megagate.errors import ConfigError
from megagate.machine import Machine
from megagate.run_config import TrainConfig
from megagate.run_setup import resolve

ROOT = Path(__file__).resolve().parents[2]
CPU = Machine(gpu=False, te=False, apex=False)
HOPPER = Machine(gpu=True, te=True, capability=(9, 0), deep_ep=False, apex=True)

COUNTING_RUN = r"""
import json, sys
from megagate import cli, run_setup, perf
from megagate.machine import Machine
from megagate.model import kernels

mon = sys.monitoring
calls = {"resolve": [], "resolve_perf": [], "resolve_backend": []}

def on_start(code, offset):
    args = sys._getframe(1).f_locals
    if code is run_setup.resolve.__code__:
        calls["resolve"].append(args["world_size"])
    elif code is perf.resolve_perf.__code__:
        calls["resolve_perf"].append(args["machine"].gpu)
    else:
        calls["resolve_backend"].append([args["choice"], args["gpu"]])

mon.use_tool_id(3, "megagate-count")
mon.register_callback(3, mon.events.PY_START, on_start)
for fn in (run_setup.resolve, perf.resolve_perf, kernels.resolve_backend):
    mon.set_local_events(3, fn.__code__, mon.events.PY_START)
rc = cli.main(["train", *sys.argv[1:]])
print("COUNTS " + json.dumps({"rc": rc, "gpu": Machine.detect().gpu, **calls}))
"""


def tiny(**sections: dict) -> TrainConfig:
    raw = {"model": {"preset": "tiny", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64}}
    raw.update({"data": {"mock": True}, "train": {"train_steps": 10, "warmup_steps": 2}}, **sections)
    return config_reader.from_dict(raw, environment=False)


@pytest.mark.slow
def test_a_real_run_resolves_perf_and_backend_once(tmp_path: Path) -> None:
    """One `resolve` per run, and one perf resolution and backend decision for the run's machine; the only other
    resolution is the config rules' judgement of the GPU node the config is written for (Machine.target)."""
    overrides = [
        "data.demo=false",
        "data.mock=true",
        "train.seq_length=32",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.train_steps=2",
        "train.warmup_steps=1",
        "train.eval_iters=1",
        "logging.tensorboard=false",
        f"output.dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", COUNTING_RUN, "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    counts_line = [line for line in proc.stdout.splitlines() if line.startswith("COUNTS ")]
    assert proc.returncode == 0 and counts_line, proc.stdout[-2000:] + proc.stderr[-3000:]
    counts = json.loads(counts_line[-1].removeprefix("COUNTS "))
    here = counts["gpu"]
    assert counts["rc"] == 0
    assert counts["resolve"] == [1]  # one RunSetup, for the launched world
    # the config rules judge the target GPU node (gpu=True) while loading; then the run's machine, once
    assert counts["resolve_perf"] == [True, here]
    assert counts["resolve_backend"] == [["auto", True], ["auto", here]]  # the target's, then the run's: once each
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # it trained


def test_resolve_decides_everything_for_the_machine() -> None:
    setup = resolve(tiny(), 4, CPU)
    assert (setup.layout.dp, setup.layout.num_microbatches) == (4, 1)
    assert (setup.backend, setup.core_attention, setup.precision) == ("local", "sdpa", "fp32")
    assert setup.experts == "SequentialMLP (megatron's loop over the local experts)"  # grouped GEMM off on CPU
    kwargs = setup.transformer_kwargs
    assert kwargs["use_cpu"] is True and kwargs["params_dtype"] == torch.float32
    assert kwargs["moe_token_dispatcher_type"] == "allgather" and kwargs["moe_grouped_gemm"] is False
    assert not any(v for k, v in kwargs.items() if k.endswith("_fusion"))  # the CPU's switch-offs, from perf
    tc = setup.transformer_config()
    assert tc.use_cpu_initialization and not tc.batch_p2p_comm and tc.num_moe_experts == 4
    gpu = resolve(tiny(train={"train_steps": 10, "warmup_steps": 2, "precision": "bf16"}), 1, HOPPER)
    assert (gpu.backend, gpu.core_attention, gpu.precision) == ("te", "te", "bf16")
    assert gpu.experts == "TEGroupedMLP (Transformer Engine's grouped GEMM)"
    assert gpu.transformer_kwargs["params_dtype"] == torch.bfloat16 and gpu.transformer_kwargs["moe_permute_fusion"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.backend = "te"  # type: ignore[misc]
    with pytest.raises(TypeError):
        setup.transformer_kwargs["use_cpu"] = False  # type: ignore[index]


def test_a_set_up_for_loading_runs_the_storage_dtype_and_default_kernels() -> None:
    cfg = tiny(train={"train_steps": 10, "warmup_steps": 2, "precision": "bf16"}, perf={"core_attention": "local"})
    setup = resolve(cfg, None, CPU, training=False)
    assert setup.layout is None and setup.precision == "bf16" and setup.fp8 == {}
    assert setup.core_attention == "sdpa"  # auto: what analysis and evaluation always ran
    assert setup.experts.startswith("SequentialMLP")
    assert dict(setup.transformer_kwargs) == {
        "params_dtype": torch.bfloat16,
        "use_cpu": True,
        "perform_initialization": False,
    }


def test_resolve_judges_the_real_gpu_once() -> None:
    """The perf rules of the machine where the run starts are judged where its settings are resolved."""
    cfg = tiny(train={"train_steps": 10, "warmup_steps": 2, "precision": "fp8", "fp8_recipe": "mxfp8"})
    with pytest.raises(ConfigError, match=r"fp8_recipe='mxfp8' needs compute capability >= 10.0 .*this GPU is 9.0"):
        resolve(cfg, 1, HOPPER)
    resolve(cfg, 1, Machine(gpu=True, te=True, capability=(10, 0), apex=True))  # Blackwell: accepted
    with pytest.raises(ConfigError, match="world_size|data-parallel|divisible"):
        resolve(tiny(), 3, CPU)  # the layout is checked for the world as well
