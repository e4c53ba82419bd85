"""NVIDIA's recipes twice: as Megatron-LM's command-line flags and as a megagate config, for the TransformerConfig
comparison (tests/train/test_megatron_lm_recipes.py; the table in docs/performance.md).

Each recipe's flags are copied from its source (named with it) for the published layout; the data, logging and
checkpoint flags are left out (they build no TransformerConfig field), `--mock-data --tokenizer-type NullTokenizer
--vocab-size V` stand for the tokenizer, and `--no-rope-fusion` plus the MoE permute/router fusions off stand for
Transformer Engine, which this CPU machine does not have (its fused kernels' checks import TE; both sides then).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any

COMMON = "--mock-data --tokenizer-type NullTokenizer --train-iters 10 --no-rope-fusion".split()

QWEN3_MODEL = (
    "--untie-embeddings-and-output-weights --position-embedding-type rope --rotary-percent 1.0 --rotary-base 1000000 "
    "--rotary-seq-len-interpolation-factor 1 --normalization RMSNorm --swiglu --norm-epsilon 1e-06 "
    "--group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm --max-position-embeddings 40960 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 "
    "--adam-beta2 0.95 --num-experts 128 --moe-router-load-balancing-type aux_loss --moe-router-topk 8 "
    "--moe-aux-loss-coeff 1e-3 --moe-router-dtype fp32 --moe-grouped-gemm --init-method-std 0.02 --bf16 "
    "--expert-tensor-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
    "--disable-bias-linear --manual-gc --manual-gc-interval 5 --vocab-size 151936"
).split()


def qwen3_model(**fields: Any) -> dict:
    return dict(
        num_query_groups=4,
        head_dim=128,
        vocab_size=151936,
        tie_embeddings=False,
        qk_layernorm=True,
        max_sequence_length=40960,
        rotary_base=1_000_000,
        norm_epsilon=1e-6,
        init_method_std=0.02,
        moe_load_balancing="aux_loss",
        moe_aux_loss_coeff=1e-3,
        moe_z_loss_coeff=0.0,
        num_experts=128,
        moe_router_topk=8,
        gate="baseline",
        **fields,
    )


RECIPES: dict[str, dict[str, Any]] = {
    # Megatron-MoE-ModelZoo model_configs/benchmarking/Qwen3-30B-A3B.yaml @ 17070963; layout of the ModelZoo's
    # best_practice/qwen3 table (H100, 16 GPUs: TP 1, PP 1, EP 8... as below), the dispatcher alltoall
    "qwen3-30b-a3b": dict(
        source="yanring/Megatron-MoE-ModelZoo model_configs/benchmarking/Qwen3-30B-A3B.yaml @ 17070963",
        world=16,
        left_out={"--moe-permute-fusion": "TE's kernel (not installed here): off on both sides"},
        flags=QWEN3_MODEL
        + "--num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32 --moe-ffn-hidden-size 768"
        " --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 8"
        " --context-parallel-size 1 --micro-batch-size 1 --global-batch-size 512 --seq-length 4096"
        " --moe-token-dispatcher-type alltoall --lr 1.2e-4 --min-lr 1.2e-5".split(),
        config=dict(
            model=qwen3_model(
                num_layers=48, hidden_size=2048, num_attention_heads=32, ffn_hidden_size=6144, moe_ffn_hidden_size=768
            ),
            parallel=dict(expert_model_parallel_size=8, expert_tensor_parallel_size=1),
            train=dict(
                micro_batch_size=1,
                global_batch_size=512,
                seq_length=4096,
                precision="bf16",
                lr=1.2e-4,
                min_lr=1.2e-5,
                warmup_steps=1,
                train_steps=10,
            ),
            perf=dict(
                moe_token_dispatcher_type="alltoall",
                moe_permute_fusion=False,
                moe_router_fusion=False,
                apply_rope_fusion=False,
                cross_entropy_loss_fusion=False,
                manual_gc_interval=5,
            ),
        ),
    ),
    # the same ModelZoo file for Qwen3-235B-A22B (its --num-layers-per-virtual-pipeline-stage, the embedding and
    # loss counted in the split) at the Bridge 26.04.01 H100 layout: TP 2, PP 8, VP 4, EP 32 on 256 GPUs (bf16, as
    # the ModelZoo file; the Bridge row is FP8)
    "qwen3-235b-a22b": dict(
        source="yanring/Megatron-MoE-ModelZoo model_configs/benchmarking/Qwen3-235B-A22B.yaml @ 1ed4179f",
        world=256,
        left_out={
            "--cross-entropy-fusion-impl te": "megatron-core 0.19's Megatron-LM refuses it (TE's fusion disabled "
            "for stability): native on both sides",
            "--moe-router-fusion": "TE's kernel (not installed here): off on both sides",
        },
        flags=QWEN3_MODEL
        + "--num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 64"
        " --moe-ffn-hidden-size 1536 --tensor-model-parallel-size 2 --sequence-parallel"
        " --pipeline-model-parallel-size 8 --num-layers-per-virtual-pipeline-stage 3"
        " --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"
        " --expert-model-parallel-size 32 --context-parallel-size 1 --micro-batch-size 1 --global-batch-size 8192"
        " --seq-length 4096 --moe-token-dispatcher-type alltoall --cross-entropy-loss-fusion"
        " --cross-entropy-fusion-impl native --lr 3.9e-6 --min-lr 3.9e-7".split(),
        config=dict(
            model=qwen3_model(
                num_layers=94, hidden_size=4096, num_attention_heads=64, ffn_hidden_size=12288, moe_ffn_hidden_size=1536
            ),
            parallel=dict(
                tensor_model_parallel_size=2,
                sequence_parallel=True,
                pipeline_model_parallel_size=8,
                virtual_pipeline_model_parallel_size=4,
                account_for_embedding_in_pipeline_split=True,
                account_for_loss_in_pipeline_split=True,
                expert_model_parallel_size=32,
                expert_tensor_parallel_size=1,
            ),
            train=dict(
                micro_batch_size=1,
                global_batch_size=8192,
                seq_length=4096,
                precision="bf16",
                lr=3.9e-6,
                min_lr=3.9e-7,
                warmup_steps=1,
                train_steps=10,
            ),
            perf=dict(
                moe_token_dispatcher_type="alltoall",
                moe_permute_fusion=False,
                moe_router_fusion=False,
                apply_rope_fusion=False,
                cross_entropy_loss_fusion=True,
                cross_entropy_fusion_impl="native",
                manual_gc_interval=5,
            ),
        ),
    ),
    # Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh @ 157006d6 (dense; FP8 hybrid delayed scaling, FP8
    # parameter gather, zero-centred norms, per-token loss), its layout TP 1 on 8 GPUs
    "llama3-8b-fp8": dict(
        source="NVIDIA/Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh @ 157006d6",
        world=8,
        left_out={
            "--grad-reduce-in-bf16": "megagate reduces gradients in fp32 (no key)",
            "--calculate-per-token-loss": "megagate's loss is the mean per micro-batch (no key)",
            "--decoupled-lr / --decoupled-min-lr": "no separate embedding learning rate in megagate",
            "--empty-unused-memory-level 1": "a training-loop setting, not a config",
            "--sequence-parallel": "Megatron-LM drops it at TP 1; megagate refuses it there",
        },
        flags=(
            "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32"
            " --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192"
            " --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0"
            " --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused"
            " --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1"
            " --global-batch-size 128 --lr 0.00015 --min-lr 0.00001 --clip-grad 1.0 --weight-decay 0.1"
            " --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --cross-entropy-loss-fusion --manual-gc"
            " --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather"
            " --tensor-model-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer"
            " --overlap-grad-reduce --overlap-param-gather --vocab-size 128256 --normalization RMSNorm"
        ).split(),
        config=dict(
            model=dict(
                num_layers=32,
                hidden_size=4096,
                num_attention_heads=32,
                num_query_groups=8,
                head_dim=128,
                ffn_hidden_size=14336,
                vocab_size=128256,
                tie_embeddings=False,
                qk_layernorm=False,
                max_sequence_length=8192,
                rotary_base=1_000_000,
                init_method_std=0.0134,
                norm_zero_centered=True,
                norm_epsilon=1e-5,
                gate="baseline",
            ),
            train=dict(
                micro_batch_size=1,
                global_batch_size=128,
                seq_length=8192,
                precision="fp8",
                fp8_recipe="delayed",
                fp8_format="hybrid",
                fp8_param_gather=True,
                lr=0.00015,
                min_lr=0.00001,
                warmup_steps=1,
                train_steps=10,
            ),
            perf=dict(apply_rope_fusion=False, cross_entropy_loss_fusion=True),
        ),
    ),
}


def megatron_lm_config(flags: list[str], world: int) -> Any:
    """Megatron-LM's TransformerConfig of `flags`: its parser, `validate_args` and
    `core_transformer_config_from_args`, as `pretrain_gpt.py` builds it on rank 0 of `world` ranks."""
    import torch
    from megatron.training import arguments
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args, validate_args

    env = ("WORLD_SIZE", "RANK", "CUDA_DEVICE_MAX_CONNECTIONS")
    saved_argv, saved_env = sys.argv, {k: os.environ.get(k) for k in env}
    saved_cap, saved_arch = torch.cuda.get_device_capability, arguments.get_device_arch_version
    sys.argv = ["pretrain_gpt.py", *COMMON, *flags]
    os.environ.update(WORLD_SIZE=str(world), RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")  # the recipes' environment
    # validate_args asks the GPU's compute capability (grouped GEMM, TP's stream rules): an H100's, 9.0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    arguments.get_device_arch_version = lambda: 9
    try:
        args = parse_args()
        validate_args(args)
        return core_transformer_config_from_args(args), args
    finally:
        sys.argv = saved_argv
        torch.cuda.get_device_capability, arguments.get_device_arch_version = saved_cap, saved_arch
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def differences(ours: Any, theirs: Any) -> dict[str, tuple[Any, Any]]:
    """Every dataclass field whose value differs: {field: (megagate's, Megatron-LM's)}."""
    out = {}
    for f in dataclasses.fields(theirs):
        a, b = getattr(ours, f.name), getattr(theirs, f.name)
        if isinstance(a, functools.partial) and isinstance(b, functools.partial):  # init methods: by value
            a, b = (a.func, a.args, a.keywords), (b.func, b.args, b.keywords)
        try:
            same = a == b
            same = bool(same)
        except Exception:
            same = repr(a) == repr(b)
        if not same:
            out[f.name] = (a, b)
    return out
