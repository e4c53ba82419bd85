"""The `perf:` section and FP8 settings, asserted on the megatron configs the trainer builds from them.

Machines are simulated through the pure functions' `machine` argument (megagate.machine.Machine), never by mocking
torch.cuda: a GPU without Transformer Engine builds real TransformerConfig / DistributedDataParallelConfig /
OptimizerConfig objects here; what megatron cannot construct without TE (its fused-kernel checks import TE) is
asserted on the kwargs the builder passes. Refusals are one-line ConfigErrors from config validation (no process
group), and `megagate train --dry-run` exits 2 with them. One tiny trainer run records a profiler trace.
"""

from __future__ import annotations

import copy
import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megagate import config_reader as C
from megagate import perf as P
from megagate import perf_rules as R
from megagate.cli import main
from megagate.errors import ConfigError
from megagate.machine import Machine
from megagate.run_config import TrainConfig
from megagate.run_setup import RunSetup, resolve
from megagate.train import components as K
from megagate.train.callbacks.profiling import STEP_RANGE, ManualGC, trace_path
from tests.helpers import tiny_runs as T

ROOT = Path(__file__).resolve().parents[2]
MOE = {"preset": "tiny", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64}
GPU = Machine(gpu=True, te=False, apex=True)  # a GPU without Transformer Engine: every config constructs here
GPU_TE = Machine(gpu=True, te=True, apex=True)
CPU = Machine(gpu=False, te=False, apex=False)
CONFIG_15A2B = ROOT / "slurm" / "examples" / "configs" / "15a2b_moe.yaml"


def S(cfg: TrainConfig, machine: Machine) -> RunSetup:
    """The run set-up of `cfg` on `machine` (no layout: these tests judge settings, not batch arithmetic)."""
    return resolve(cfg, None, machine)


def make(model: dict | None = None, **sections: dict) -> TrainConfig:
    data = {"model": copy.deepcopy(model or MOE), "data": {"mock": True}, **copy.deepcopy(sections)}
    return C.from_dict(data, environment=False)


# --- GPU defaults on the built configs ---------------------------------------------------------------------------
def test_gpu_defaults_reach_transformer_config():
    tc = S(make(), GPU).transformer_config()
    assert tc.moe_grouped_gemm is True
    assert tc.moe_token_dispatcher_type == "alltoall"
    assert tc.moe_router_dtype == "fp32"
    # TE's kernels: off without TE on auto
    assert (tc.moe_permute_fusion, tc.moe_router_fusion, tc.apply_rope_fusion) == (False, False, False)
    assert tc.bias_activation_fusion and tc.bias_dropout_fusion and tc.masked_softmax_fusion
    assert tc.cross_entropy_loss_fusion and tc.cross_entropy_fusion_impl == "native"
    assert tc.gradient_accumulation_fusion is True
    assert tc.cuda_graph_impl == "none"
    assert tc.use_cpu_initialization is False


def test_gpu_with_te_turns_on_te_kernels():
    """With TE the fused permute, router and RoPE kernels are on (megatron's TransformerConfig would import TE to
    check them, so the kwargs it gets are asserted)."""
    cfg = make()
    setup = S(cfg, GPU_TE)
    perf, kwargs = setup.perf, setup.transformer_kwargs
    assert perf.backend_te and perf.cpu_off == () and setup.backend == "te"
    assert kwargs["moe_permute_fusion"] and kwargs["moe_router_fusion"] and kwargs["apply_rope_fusion"]
    assert kwargs["moe_grouped_gemm"] and kwargs["moe_token_dispatcher_type"] == "alltoall"
    # explicit off wins over the GPU default, and then the config constructs here
    off = make(perf={"moe_permute_fusion": False, "moe_router_fusion": False, "apply_rope_fusion": False})
    tc = S(off, GPU_TE).transformer_config()
    assert (tc.moe_permute_fusion, tc.moe_router_fusion, tc.apply_rope_fusion) == (False, False, False)


def test_dense_model_gets_no_moe_keys():
    cfg = make({"preset": "tiny"})
    kwargs = S(cfg, GPU_TE).transformer_kwargs
    assert not any(key.startswith("moe_") for key in kwargs)
    assert S(cfg, GPU).transformer_config().num_moe_experts is None


def test_gpu_ddp_and_optimizer_configs():
    cfg = make(perf={"bucket_size": 12_345_678})
    ddp = K.ddp_config(S(cfg, GPU))
    assert (ddp.overlap_grad_reduce, ddp.overlap_param_gather, ddp.bucket_size) == (True, True, 12_345_678)
    assert ddp.use_distributed_optimizer and ddp.grad_reduce_in_fp32 and not ddp.fp8_param_gather
    opt = K.optimizer_config(S(cfg, GPU))
    assert opt.overlap_param_gather is True and opt.use_precision_aware_optimizer is False
    # without the distributed optimizer there is no parameter all-gather to overlap
    plain = make(train={"use_distributed_optimizer": False})
    assert K.ddp_config(S(plain, GPU)).overlap_param_gather is False
    assert K.ddp_config(S(plain, GPU)).overlap_grad_reduce is True


def test_explicit_perf_values_reach_the_configs():
    cfg = make(
        {**MOE, "recompute_granularity": "selective"},
        perf={
            "moe_token_dispatcher_type": "allgather",
            "moe_router_dtype": "fp64",
            "overlap_grad_reduce": False,
            "overlap_param_gather": False,
            "recompute_modules": ["core_attn", "layernorm", "moe_act"],
            "bias_activation_fusion": False,
            "cross_entropy_loss_fusion": False,
            "gradient_accumulation_fusion": False,
            "cuda_graph_impl": "local",
            "cuda_graph_modules": ["attn"],
            "cuda_graph_warmup_steps": 2,
            "manual_gc_interval": 7,
        },
    )
    tc = S(cfg, GPU).transformer_config()
    assert tc.moe_token_dispatcher_type == "allgather" and tc.moe_router_dtype == "fp64"
    assert tc.recompute_granularity == "selective" and tc.recompute_modules == ["core_attn", "layernorm", "moe_act"]
    assert not tc.bias_activation_fusion and not tc.cross_entropy_loss_fusion and not tc.gradient_accumulation_fusion
    assert tc.cuda_graph_impl == "local" and [m.name for m in tc.cuda_graph_modules] == ["attn"]
    assert tc.cuda_graph_warmup_steps == 2
    ddp = K.ddp_config(S(cfg, GPU))
    assert (ddp.overlap_grad_reduce, ddp.overlap_param_gather) == (False, False)
    assert P.resolve_perf(cfg, GPU).manual_gc_interval == 7


def test_precision_aware_optimizer_reaches_megatron():
    """The flag and dtypes reach OptimizerConfig: megatron's __post_init__ then asks for TE's FusedAdam, which is
    not installed here (that refusal is the proof the flag arrived); the CPU switches it off."""
    cfg = make(perf={"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16", "exp_avg_dtype": "fp8"})
    with pytest.raises(RuntimeError, match="FusedAdam"):
        K.optimizer_config(S(cfg, GPU_TE))
    opt = K.optimizer_config(S(cfg, CPU))
    assert opt.use_precision_aware_optimizer is False and opt.exp_avg_dtype == torch.float32
    assert "use_precision_aware_optimizer" in P.resolve_perf(cfg, CPU).cpu_off


# --- CPU switch-offs and the one line ----------------------------------------------------------------------------
def test_cpu_switches_off_and_says_so_in_one_line():
    cfg = make(perf={"moe_permute_fusion": True}, train={"backend": "te"})
    setup = S(cfg, CPU)
    perf = setup.perf
    line = perf.cpu_line()
    assert line == (
        "perf: on CPU: moe_grouped_gemm, moe_permute_fusion, moe_router_fusion, overlap_grad_reduce, "
        "overlap_param_gather, bias_activation_fusion, bias_dropout_fusion, apply_rope_fusion, masked_softmax_fusion, "
        "cross_entropy_loss_fusion off; moe_token_dispatcher_type allgather"
    )  # gradient_accumulation_fusion is not listed: without apex it is off on that machine's GPU too
    kwargs = setup.transformer_kwargs
    assert kwargs["moe_token_dispatcher_type"] == "allgather"
    assert not any(v for k, v in kwargs.items() if k.endswith("fusion") or k == "moe_grouped_gemm")
    ddp = K.ddp_config(S(cfg, CPU))
    assert (ddp.overlap_grad_reduce, ddp.overlap_param_gather) == (False, False)
    assert perf.manual_gc_interval == 0  # auto: Python's collector on CPU
    graphs = make(perf={"cuda_graph_impl": "local", "overlap_param_gather": False})
    tc = S(graphs, CPU).transformer_config()
    assert tc.cuda_graph_impl == "none" and "cuda_graph_impl" in P.resolve_perf(graphs, CPU).cpu_off


def test_cpu_builds_the_cpu_config_and_drops_moe_act():
    cfg = make({**MOE, "recompute_granularity": "selective"}, perf={"recompute_modules": ["moe_act", "core_attn"]})
    tc = S(cfg, CPU).transformer_config()  # megatron refuses moe_act without grouped GEMM: it must be gone
    assert tc.recompute_modules == ["core_attn"] and tc.moe_grouped_gemm is False
    assert tc.use_cpu_initialization and not tc.bias_dropout_fusion and not tc.batch_p2p_comm
    assert "recompute_modules moe_act" in P.resolve_perf(cfg, CPU).cpu_off


# --- FP8 -----------------------------------------------------------------------------------------------------------
def test_fp8_settings_reach_transformer_and_ddp_configs():
    cfg = make(
        {"preset": "tiny"},
        train={
            "precision": "fp8",
            "fp8_param_gather": True,
            "first_last_layers_bf16": True,
            "num_layers_at_start_in_bf16": 1,
            "num_layers_at_end_in_bf16": 0,
        },
        perf={"apply_rope_fusion": False},
    )
    tc = S(cfg, GPU_TE).transformer_config()
    assert (tc.fp8, tc.fp8_recipe, tc.fp8_param) == ("e4m3", "blockwise", True)  # blockwise: e4m3 by default
    assert tc.first_last_layers_bf16 and (tc.num_layers_at_start_in_bf16, tc.num_layers_at_end_in_bf16) == (1, 0)
    assert tc.params_dtype == torch.bfloat16
    assert K.ddp_config(S(cfg, GPU_TE)).fp8_param_gather is True
    delayed = make({"preset": "tiny"}, train={"precision": "fp8", "fp8_recipe": "delayed"})
    assert S(delayed, GPU_TE).fp8["fp8"] == "hybrid"
    moe = make(train={"precision": "fp8"})
    assert S(moe, GPU_TE).fp8["moe_router_padding_for_quantization"] is True
    assert P.resolve_perf(moe, GPU_TE).moe_router_padding_for_fp8 is True


# --- refusals: one line each, before any process group -------------------------------------------------------------
REFUSED = [
    ("param-gather-no-distopt", {}, {"train": {"use_distributed_optimizer": False}, "perf": {"overlap_param_gather": True}},
     "perf.overlap_param_gather=true needs train.use_distributed_optimizer=true"),
    ("param-gather-no-grad-reduce", {}, {"perf": {"overlap_param_gather": True, "overlap_grad_reduce": False}},
     "perf.overlap_param_gather=true needs perf.overlap_grad_reduce=true"),
    ("flex-local", {}, {"train": {"backend": "local"}, "perf": {"moe_token_dispatcher_type": "flex"}},
     "perf.moe_token_dispatcher_type='flex' needs Transformer Engine"),
    ("permute-local", {}, {"train": {"backend": "local"}, "perf": {"moe_permute_fusion": True}},
     "perf.moe_permute_fusion=true needs Transformer Engine"),
    ("dispatcher-name", {}, {"perf": {"moe_token_dispatcher_type": "nccl"}},
     "perf.moe_token_dispatcher_type='nccl' is not one of auto, alltoall, allgather, flex"),
    ("modules-no-selective", {}, {"perf": {"recompute_modules": ["core_attn"]}},
     "perf.recompute_modules=['core_attn'] needs model.recompute_granularity=selective (it is None)"),
    ("moe-act-dense", {"preset": "tiny", "recompute_granularity": "selective"}, {"perf": {"recompute_modules": ["moe_act"]}},
     "perf.recompute_modules: 'moe_act' needs a MoE model"),
    ("moe-act-no-grouped", {**MOE, "recompute_granularity": "selective"},
     {"perf": {"recompute_modules": ["moe_act"], "moe_grouped_gemm": False}},
     "perf.recompute_modules: 'moe_act' needs perf.moe_grouped_gemm=true"),
    ("graphs-full-recompute", {**MOE, "recompute_granularity": "full", "recompute_method": "uniform",
                               "recompute_num_layers": 1},
     {"perf": {"cuda_graph_impl": "local", "overlap_param_gather": False}},
     "perf.cuda_graph_impl='local' cannot capture full recompute"),
    ("te-graphs", {}, {"perf": {"cuda_graph_impl": "transformer_engine"}},
     "perf.cuda_graph_impl='transformer_engine' needs Megatron-LM's training-loop capture"),
    ("graphs-param-gather", {}, {"perf": {"cuda_graph_impl": "local"}},
     "perf.cuda_graph_impl='local' with perf.overlap_param_gather: graph replay skips the forward hooks"),
    ("graph-modules-no-impl", {}, {"perf": {"cuda_graph_modules": ["attn"]}},
     "perf.cuda_graph_modules=['attn'] needs perf.cuda_graph_impl local or transformer_engine"),
    ("preprocess-no-router", {}, {"perf": {"cuda_graph_impl": "local", "cuda_graph_modules": ["moe_preprocess"],
                                          "overlap_param_gather": False}},
     "perf.cuda_graph_modules: 'moe_preprocess' needs 'moe_router' too"),
    ("precision-aware-no-distopt", {}, {"train": {"use_distributed_optimizer": False},
                                        "perf": {"use_precision_aware_optimizer": True, "overlap_param_gather": False}},
     "perf.use_precision_aware_optimizer=true needs train.use_distributed_optimizer=true"),
    ("dtype-no-precision-aware", {}, {"perf": {"exp_avg_dtype": "bf16"}},
     "perf.exp_avg_dtype='bf16' needs perf.use_precision_aware_optimizer=true"),
    ("fp8-local", {}, {"train": {"precision": "fp8", "backend": "local"}},
     "train.precision='fp8' needs Transformer Engine: set train.backend te or auto"),
    ("fp8-delayed-bf16-layers", {}, {"train": {"precision": "fp8", "fp8_recipe": "delayed",
                                               "first_last_layers_bf16": True}},
     "train.first_last_layers_bf16=true does not work with train.fp8_recipe=delayed"),
    ("fp8-bf16-layers-range", {}, {"train": {"precision": "fp8", "first_last_layers_bf16": True,
                                             "num_layers_at_start_in_bf16": 3}},
     "train.num_layers_at_start_in_bf16=3 must be in [0, layers per pipeline stage (2)]"),
    ("fp8-gather-bf16", {}, {"train": {"precision": "bf16", "fp8_param_gather": True}},
     "train.fp8_param_gather=true needs train.precision=fp8"),
    ("fp8-format", {}, {"train": {"precision": "fp8", "fp8_format": "e5m2"}},
     "train.fp8_format='e5m2' is not one of e4m3, hybrid"),
    ("profile-steps", {}, {"train": {"train_steps": 10, "warmup_steps": 1}, "perf": {"profile": {"steps": [5, 11]}}},
     "perf.profile.steps=[5, 11] must satisfy 1 <= start <= end <= train.train_steps (10)"),
    ("profile-key", {}, {"perf": {"profile": {"step": [1, 2]}}}, "perf.profile.step is not a known key"),
    ("perf-key", {}, {"perf": {"grouped_gemm": True}}, "perf.grouped_gemm is not a known key"),
]  # fmt: skip


@pytest.mark.parametrize("name,model,sections,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_in_one_line(name, model, sections, message):
    with pytest.raises(ConfigError) as info:
        make(model or MOE, **sections)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_fp8_alignment_refused_with_variant_and_tp():
    """g2-headwise on 15A2B: 32 heads x 128 + 2 x 4 x 128 + 32 gate rows = 5,124 fused rows, not a multiple of 16."""
    with pytest.raises(ConfigError) as info:
        C.load(str(CONFIG_15A2B), ["train.precision=fp8", "model.gate.preset=g2-headwise"], environment=False)
    assert str(info.value) == (
        "train.precision='fp8': gate g2-headwise gives the fused linear_qkv 5,124 rows, 5,124 per TP shard at "
        "tensor_model_parallel_size=1, not a multiple of 16 as TE's FP8 GEMM needs; use an elementwise gate or bf16"
    )
    C.load(str(CONFIG_15A2B), ["train.precision=fp8"], environment=False)  # g1-elementwise: 8,192 rows, accepted


def test_device_refusals():
    """What only the real device decides: mxfp8 on Hopper, FP8 on a CPU, flex without DeepEP."""
    cfg = make(train={"precision": "fp8", "fp8_recipe": "mxfp8"}, perf={"apply_rope_fusion": False})
    hopper = Machine(gpu=True, te=True, capability=(9, 0), deep_ep=False, apex=True)
    with pytest.raises(ConfigError, match=r"fp8_recipe='mxfp8' needs compute capability >= 10.0 .*this GPU is 9.0"):
        R.check_perf(cfg, P.resolve_perf(cfg, hopper))
    R.check_perf(cfg, P.resolve_perf(cfg, Machine(gpu=True, te=True, capability=(10, 0), apex=True)))  # Blackwell
    with pytest.raises(ConfigError, match="the CPU has no FP8"):
        R.check_perf(cfg, P.resolve_perf(cfg, CPU))
    flex = make(perf={"moe_token_dispatcher_type": "flex"})
    with pytest.raises(ConfigError, match="'flex' needs DeepEP, which is not installed"):
        R.check_perf(flex, P.resolve_perf(flex, hopper))


def test_cli_dry_run_exits_2_with_the_line():
    proc = subprocess.run(
        [sys.executable, "-m", "megagate", "train", "--config", str(T.CONFIG), "--dry-run",
         "perf.overlap_param_gather=true", "train.use_distributed_optimizer=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [
        "megagate train: error: perf.overlap_param_gather=true needs train.use_distributed_optimizer=true (it "
        "overlaps the distributed optimizer's parameter all-gather)"
    ]
    assert "Traceback" not in proc.stderr


def test_dry_run_15a2b_prints_the_perf_settings(capsys):
    assert main(["train", "--config", str(CONFIG_15A2B), "--dry-run", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "perf (on GPU, Transformer Engine): core attention te (auto); recompute none" in out
    assert (
        "perf moe: grouped GEMM on; dispatcher alltoall; permute fusion on; router fusion on; router dtype fp32" in out
    )
    assert "perf overlap: grad reduce on; param gather on" in out
    assert "manual GC every 5 steps" in out
    assert "kernels: attention te (Transformer Engine DotProductAttention); experts TEGroupedMLP" in out
    # the same config on GPU nodes without Transformer Engine: torch's kernels
    args = ["train", "--config", str(CONFIG_15A2B), "--dry-run", "--world-size", "64", "train.backend=local"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "kernels: attention sdpa (torch scaled_dot_product_attention; CUDA backends enabled:" in out
    assert "experts TorchGroupedMLP (torch grouped_mm)" in out


# --- the trainer's side: manual GC, profiler ---------------------------------------------------------------------
def test_manual_gc_collects_every_n_steps():
    from megagate.train.callbacks.base import StepOutput
    from megagate.train.step_values import StepValues

    collections: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            collections.append(1)

    cb = ManualGC(3)
    gc.callbacks.append(count)
    try:
        cb.on_start(None)
        assert not gc.isenabled()
        before = len(collections)
        for step in range(1, 8):
            cb.post_step(None, StepOutput(step, StepValues.of(1.0, 1.0), 1e-3, 0.1, True))
        assert len(collections) - before == 2  # steps 3 and 6
    finally:
        cb.on_close(None)
        gc.callbacks.remove(count)
    assert gc.isenabled()


def test_profiler_trace_covers_exactly_the_chosen_steps(tmp_path, session_demo_dir):
    """A tiny run profiling steps 2-3 of 4 writes one Chrome trace whose step ranges are 2 and 3 and whose model ops
    (matrix products of the forward and backward) fall inside them; the CPU line is printed once."""
    out = tmp_path / "run"
    proc = T.run_train(out, session_demo_dir, "train.train_steps=4", "train.warmup_steps=1", "perf.profile.steps=[2,3]")
    assert proc.stdout.count("perf: on CPU:") == 1
    path = trace_path(out / "profile", 0, [2, 3])
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary left behind
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = {e["name"]: e for e in events if e["name"].startswith("megagate.step#")}
    assert sorted(steps) == [STEP_RANGE.format(2), STEP_RANGE.format(3)]
    for step in steps.values():
        inside = [
            e["name"]
            for e in events
            if step["ts"] <= e["ts"] <= step["ts"] + step["dur"] and e["name"] in ("aten::mm", "aten::matmul")
        ]
        assert len(inside) > 10  # forward and backward GEMMs of the tiny model's layers
    first, last = min(e["ts"] for e in events), max(e["ts"] + e.get("dur", 0) for e in events)
    span = steps[STEP_RANGE.format(3)]
    assert first >= steps[STEP_RANGE.format(2)]["ts"] - 1e5 and last <= span["ts"] + span["dur"] + 1e5
