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
sequences (THD), context parallelism, attention bias and sliding-window attention.

Softmax sinks (`config.softmax_type`, megatron's `SoftmaxOne`): "off-by-one" adds exp(0) to every row's softmax
denominator, "learnable" adds exp(s_h) with a learned per-head logit s_h (`softmax_offset`, [np] on this TP rank,
created, initialised and checkpointed as megatron's module does). SDPA computes it exactly with one extra key per
row: a zero key and a zero value, whose additive-mask entry is the sink logit (q·0 = 0, so its score is the logit;
its value adds nothing). The causal mask is then an explicit float mask.

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
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide
from torch import Tensor

from megagate.errors import ConfigError
from megagate.model.model_config import SOFTMAX_TYPES

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
        # a Parameter (learnable) registers itself; off-by-one's zeros are a plain attribute, as in megatron
        self.softmax_offset = _softmax_offset(config, self.num_attention_heads_per_partition)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> ShardedStateDict:
        """The learnable softmax offset, sharded over TP along its head axis (megatron's module's own layout)."""
        state = self.state_dict(prefix="", keep_vars=True) if self.config.softmax_type == "learnable" else {}
        return make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )

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
        # With a sink the mask is an explicit float mask per head (below): the groups are expanded there too.
        enable_gqa = False
        if ng != np_:
            if self.softmax_offset is None and (q.device.type == "cpu" or mask is None):
                enable_gqa = True
            else:
                k = k.repeat_interleave(np_ // ng, dim=1)
                v = v.repeat_interleave(np_ // ng, dim=1)

        if self.softmax_offset is not None:
            k, v, mask = _with_sink(q, k, v, mask, is_causal, self.softmax_offset)
            is_causal = False

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


def _softmax_offset(config: TransformerConfig, heads: int) -> Tensor | None:
    """megatron's softmax_offset for `heads` heads: None (vanilla), zeros (off-by-one), a parameter (learnable,
    `config.init_method` as megatron initialises it). With use_cpu_initialization on torch's default device (the
    CPU, or the meta device of a planner's build), where megatron's module allocates on CUDA unconditionally."""
    if config.softmax_type == "vanilla":
        return None
    if config.softmax_type not in SOFTMAX_TYPES:
        raise ConfigError(f"softmax_type={config.softmax_type!r} is not one of {', '.join(SOFTMAX_TYPES)}")
    device = None if config.use_cpu_initialization else torch.cuda.current_device()
    offset = torch.zeros(heads, device=device, dtype=config.params_dtype)
    if config.softmax_type == "off-by-one":
        return offset
    param = torch.nn.Parameter(offset)
    # sharded over TP by heads (megatron's module leaves the attribute unset, so its grad norm and a
    # layout-independent initialisation would treat every rank's heads as one replicated tensor)
    tensor_parallel.set_tensor_model_parallel_attributes(param, True, 0, 1)
    if config.perform_initialization:
        with torch.no_grad():
            config.init_method(param)
    return param


def _with_sink(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, sink: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """k/v [b, np, sk, hn] (groups already expanded to heads) with one zero key/value appended, and the additive
    float mask [b|1, np, sq, sk+1]: 0 / -inf from `mask` (True = takes part) or causality, the per-head sink logit
    of `sink` [np] in the last column. q [b, np, sq, hn] gives the shapes."""
    b, np_, sq, hn = q.shape
    sk = k.size(2)
    zeros = q.new_zeros(b, np_, 1, hn)
    k = torch.cat([k, zeros.to(k.dtype)], dim=2)
    v = torch.cat([v, zeros.to(v.dtype)], dim=2)
    if mask is None:
        allowed = torch.ones(1, 1, sq, sk, dtype=torch.bool, device=q.device)
        if is_causal:
            allowed = allowed.tril()
    else:
        allowed = mask
    allowed = allowed.expand(-1, np_, sq, sk) if allowed.size(1) == 1 else allowed.expand(-1, -1, sq, sk)
    scores = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    column = sink.to(q.dtype).reshape(1, np_, 1, 1).expand(scores.size(0), np_, sq, 1)
    return k, v, torch.cat([scores, column], dim=-1)
