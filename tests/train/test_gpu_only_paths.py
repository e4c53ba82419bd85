"""Logic that only a GPU machine reaches, checked on CPU through the machine the pure functions are given.

The acceptance machine is an H200 with torch but without Transformer Engine or apex. These tests build what that
machine would build — megatron's real modules, from the configs the trainer resolves for that device — and run the
parts that need no CUDA kernel.
"""

from __future__ import annotations

import pytest
import torch

from megagate import config_reader as C
from megagate import perf as P
from megagate import perf_rules as R
from megagate.errors import ConfigError
from megagate.machine import Machine
from megagate.run_config import TrainConfig
from megagate.run_setup import resolve

# the acceptance machine: Hopper, no TE, no apex (so neither its softmax nor its gradient-accumulation kernels)
H200_NO_APEX = Machine(gpu=True, te=False, capability=(9, 0), deep_ep=False, apex=False, softmax_kernels=False)
SOFTMAX_OFF = (
    "masked_softmax_fusion off (scaled_masked_softmax_cuda, scaled_upper_triang_masked_softmax_cuda, "
    "scaled_softmax_cuda not installed: torch's softmax instead)"
)
GRAD_ACC_OFF = (
    "gradient_accumulation_fusion off (fused_weight_gradient_mlp_cuda not installed: unfused weight gradients)"
)


def _local_bf16(**perf) -> TrainConfig:
    """A bf16 run at sequence 4096 with megatron's local core attention: the fused-softmax kernel's range
    (16 < sk <= 4096, multiples of 4)."""
    return C.from_dict(
        {
            "model": {"preset": "tiny", "max_sequence_length": 4096},
            "train": {"precision": "bf16", "seq_length": 4096, "micro_batch_size": 2, "global_batch_size": 2},
            "data": {"mock": True},
            "perf": {"core_attention": "local", **perf},
        },
        environment=False,
    )


def _check(cfg: TrainConfig, machine: Machine) -> None:
    """The real GPU's perf rules, as the run set-up applies them there."""
    R.check_perf(cfg, P.resolve_perf(cfg, machine))


def _attention_softmax(tconfig):
    """megatron's DotProductAttention (the local core attention) built from `tconfig`: its FusedScaleMaskSoftmax."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    return DotProductAttention(tconfig, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def test_no_apex_gpu_resolves_masked_softmax_off_and_prints_why(megatron_world):
    cfg = _local_bf16()
    perf = P.resolve_perf(cfg, H200_NO_APEX)
    assert perf.masked_softmax_fusion is False and perf.gradient_accumulation_fusion is False
    # the line the trainer prints at start (build_components) and --dry-run lists
    assert perf.gpu_line() == f"perf: on this GPU: {SOFTMAX_OFF}; {GRAD_ACC_OFF}"
    assert perf.gpu_line() in perf.describe() and perf.cpu_line() is None
    # the other GPU fusions stay on: only what has no kernel there is off
    assert perf.bias_activation_fusion and perf.bias_dropout_fusion and perf.cross_entropy_loss_fusion

    # megatron's own module, built from the TransformerConfig the trainer would build there (CPU weights here)
    tconfig = resolve(cfg, 1, H200_NO_APEX).transformer_config(use_cpu_initialization=True)
    assert tconfig.bf16 and tconfig.masked_softmax_fusion is False
    attention = _attention_softmax(tconfig)
    b, np_, s = 2, tconfig.num_attention_heads, 4096
    assert attention.scale_mask_softmax.is_kernel_available(None, b, np_, s, s) is False
    # and its forward runs (torch's softmax, bf16 in, bf16 out): [sq, b, np, hn]
    sq, hn = 64, tconfig.kv_channels
    q, k, v = (torch.randn(sq, b, np_, hn, dtype=torch.bfloat16) for _ in range(3))
    k, v = k[:, :, : tconfig.num_query_groups], v[:, :, : tconfig.num_query_groups]
    out = attention(q, k, v, attention_mask=None)
    assert out.shape == (sq, b, np_ * hn) and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()

    # the defect the old resolution (on) had: the kernel check itself imports apex's module
    unknown = Machine(gpu=True, te=False)  # a GPU node judged away from it (extensions unknown): the default stays
    fused = _attention_softmax(resolve(cfg, 1, unknown).transformer_config(use_cpu_initialization=True))
    assert fused.scale_mask_softmax.scaled_masked_softmax_fusion is True
    with pytest.raises(ModuleNotFoundError, match="scaled_masked_softmax_cuda"):
        fused.scale_mask_softmax.is_kernel_available(None, b, np_, s, s)


def test_explicit_masked_softmax_fusion_on_a_gpu_without_the_kernels():
    """An explicit true that megatron's local attention would reach is refused there in one line; with SDPA (which
    never calls megatron's softmax) it is harmless and kept; a GPU with the kernels keeps it."""
    with pytest.raises(ConfigError, match=r"perf.masked_softmax_fusion=true with perf.core_attention=local needs"):
        _check(_local_bf16(masked_softmax_fusion=True), H200_NO_APEX)
    sdpa = _local_bf16(masked_softmax_fusion=True, core_attention="sdpa")
    _check(sdpa, H200_NO_APEX)
    assert P.resolve_perf(sdpa, H200_NO_APEX).masked_softmax_fusion is True
    with_apex = Machine(gpu=True, te=False, capability=(9, 0), apex=True, softmax_kernels=True)
    _check(_local_bf16(masked_softmax_fusion=True), with_apex)
    resolved = P.resolve_perf(_local_bf16(), with_apex)
    assert resolved.masked_softmax_fusion is True and resolved.gpu_line() is None
