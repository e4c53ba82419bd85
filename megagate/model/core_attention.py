"""Core attention on torch's `scaled_dot_product_attention` (SDPA): the fast path without Transformer Engine.

megatron's local `DotProductAttention` materialises the scores and probabilities `[b, np, sq, sk]` (and keeps them
for backward), so its memory grows with sq²; SDPA dispatches to a fused kernel (flash / cuDNN / memory-efficient on
CUDA, the flash kernel on CPU) that never stores them. `SDPACoreAttention` is a drop-in megatron core-attention
module: the constructor and `forward` of megatron-core 0.19's `DotProductAttention`, the same function (softmax
scale, causal or explicit boolean mask, GQA group mapping, attention dropout under megatron's RNG tracker), the
same `[sq, b, np·hn]` output. So megatron's output-gate hook (`_apply_output_gate`, which runs on that output),
selective recompute (`_checkpointed_attention_forward` calls this module with the same arguments) and the
diagnostics' pre-forward hook on `core_attention` (which reads `softmax_scale`) work unchanged.

What it cannot compute is refused in one line (`ConfigError`) instead of computing something else: packed
sequences (THD), context parallelism, attention bias, sliding-window attention and non-vanilla softmax.

One numerical difference from megatron's local module, by design: a query row whose keys are *all* masked gets zeros
from SDPA, where megatron's `masked_fill(-10000)` gives the mean of the values. Such rows only arise from padding
masks; this repository's data path passes no mask (causal kernels build their own).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from torch import Tensor

from megagate.errors import ConfigError

# Names of torch's SDPA backends, in torch's own preference order on CUDA.
_CUDA_BACKENDS = (
    ("cudnn", "cudnn_sdp_enabled"),
    ("flash", "flash_sdp_enabled"),
    ("mem_efficient", "mem_efficient_sdp_enabled"),
    ("math", "math_sdp_enabled"),
)


def enabled_sdpa_backends() -> list[str]:
    """The SDPA backends torch may dispatch to on CUDA in this process (its global switches), best first."""
    return [name for name, flag in _CUDA_BACKENDS if getattr(torch.backends.cuda, flag)()]


class SDPACoreAttention(MegatronModule):
    """megatron core attention computed with `torch.nn.functional.scaled_dot_product_attention`.

    query [sq, b, np, hn], key/value [sk, b, ng, hn] (this tensor-parallel rank's heads) → context [sq, b, np·hn].
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ConfigError(
                f"core_attention='sdpa' does not support context_parallel_size={config.context_parallel_size}: "
                "context parallelism needs Transformer Engine's attention (core_attention='te')"
            )
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ConfigError(
                f"core_attention='sdpa' does not support window_size={config.window_size} (sliding-window "
                "attention); use core_attention='local' or 'te'"
            )
        if config.softmax_type != "vanilla":
            raise ConfigError(
                f"core_attention='sdpa' does not support softmax_type={config.softmax_type!r}; only 'vanilla' "
                "(use core_attention='local' or 'te')"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp_size = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)

        # The scale applied to q·k. megatron's apply_query_key_layer_scaling divides its softmax_scale by the layer
        # number and multiplies the scores back inside its fp32 softmax: the net scale is this one, and SDPA's
        # kernels accumulate the softmax in fp32 anyway, so the trick has nothing left to protect here.
        self.softmax_scale = (
            1.0 / math.sqrt(self.hidden_size_per_attention_head) if softmax_scale is None else float(softmax_scale)
        )
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """Attention of query [sq, b, np, hn] over key/value [sk, b, ng, hn]; returns [sq, b, np·hn].

        `attention_mask` (megatron's convention: boolean, True = masked out, broadcastable to [b, np, sq, sk])
        takes precedence over the mask type, as in megatron's local module; without one, the causal mask type
        means `is_causal` (sq == sk).
        """
        if packed_seq_params is not None:
            raise ConfigError(
                "core_attention='sdpa' does not support packed sequences (packed_seq_params, THD format); use "
                "core_attention='te'"
            )
        if attention_bias is not None:
            raise ConfigError("core_attention='sdpa' does not support attention_bias; use core_attention='te'")
        sq, b, np_, hn = query.shape
        ng = key.size(2)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type

        # [sq, b, np, hn] -> [b, np, sq, hn]; [sk, b, ng, hn] -> [b, ng, sk, hn] (views: SDPA takes strided input)
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)

        mask = None
        is_causal = False
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ConfigError(
                    f"core_attention='sdpa' takes megatron's boolean attention_mask (True = masked), got dtype "
                    f"{attention_mask.dtype}"
                )
            mask = ~attention_mask  # SDPA's boolean mask: True = takes part
        elif mask_type == AttnMaskType.causal and sq > 1:
            # megatron's local module asserts this too; SDPA's is_causal would silently align top-left
            if sq != key.size(0):
                raise ConfigError(f"causal self-attention needs sq == sk, got sq={sq}, sk={key.size(0)}")
            is_causal = True

        # GQA: query head h reads group h // (np / ng), megatron's repeat_interleave mapping, which is also SDPA's
        # enable_gqa mapping. torch's CPU flash kernel and CUDA's flash kernel take grouped heads directly; with a
        # mask on CUDA the memory-efficient kernel runs, whose GQA support differs between torch releases, so there
        # the groups are expanded (O(s) memory, like q itself).
        enable_gqa = False
        if ng != np_:
            if q.device.type == "cpu" or mask is None:
                enable_gqa = True
            else:
                k = k.repeat_interleave(np_ // ng, dim=1)
                v = v.repeat_interleave(np_ // ng, dim=1)

        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale)
        if enable_gqa:
            kwargs["enable_gqa"] = True
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # the model-parallel RNG stream, as megatron's local module: heads differ per TP rank
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            context = F.scaled_dot_product_attention(q, k, v, **kwargs)

        # [b, np, sq, hn] -> [sq, b, np, hn] -> [sq, b, np·hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
