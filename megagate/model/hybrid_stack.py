"""megatron's HybridModel and HybridStack with megagate's layers, final norm and GPTModel's checkpoint layout.

megagate's layers are whole TransformerLayers (mixer and MLP in one layer, as GPTModel built them): HybridStack
builds the "*" and "G" symbols from the spec given, and the "-"/"E" symbols (a separate MLP layer) are not used. So
parameter names and layer numbers are GPTModel's (`decoder.layers.N.{self_attention,mlp}`) and what is keyed on
them (initialisation, Hugging Face mapping, planner, monitors) reads the same model. Two things of HybridStack are
changed here:

* the final norm: HybridStack builds Transformer Engine's `TENorm` whatever the spec says (no TE on a CPU, and the
  local and zero-centred norms of megagate's local backend); here it is built from the spec's `final_norm`, under
  GPTModel's name `final_layernorm` (`final_norm` reads it, for HybridStack's forward);
* the distributed checkpoint: HybridStack writes one key per layer (`decoder.layers.N.`); a model whose layers are
  all alike is written as GPTModel's TransformerBlock writes it (one key per tensor, the layer a sharding axis), so
  a checkpoint of either model class loads into the other, and runs saved before the move resume unchanged;
  `GatedHybridModel` leaves out the empty `output_layer._extra_state` entry as GPTModel does, for the same reason.
"""

from __future__ import annotations

from typing import Any

from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.utils import sharded_state_dict_default


class GatedHybridStack(HybridStack):
    """HybridStack whose final norm is `final_norm` (a norm class or spec) under the name `final_layernorm`."""

    def __init__(self, config: Any, submodules: Any, *, final_norm: Any, post_layer_norm: bool = True, **kw: Any):
        super().__init__(config, submodules, post_layer_norm=False, **kw)  # no TENorm
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_layernorm = build_module(
                final_norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )

    @property
    def final_norm(self) -> Any:
        """HybridStack's name of the final norm (its forward reads it)."""
        return self.final_layernorm

    def _homogeneous(self, metadata: dict | None) -> bool:
        """Whether TransformerBlock would stack the layers along one sharding axis (its rules, as far as a
        megagate model can meet them: megagate marks hybrids `hetereogenous_dist_checkpoint`)."""
        metadata = metadata or {}
        return not (
            self.config.hetereogenous_dist_checkpoint
            or metadata.get("non_homogeneous_layers", False)
            or metadata.get("singleton_local_shards", False)
            or self.config.moe_layer_freq != 1
        )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple | None = None, metadata: dict | None = None
    ) -> ShardedStateDict:
        """HybridStack's per-layer keys for mixed layers; TransformerBlock's stacked layout for layers all alike."""
        if not self._homogeneous(metadata):
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        out: ShardedStateDict = {}
        layer_prefix = f"{prefix}layers."
        for index, layer in enumerate(self.layers):
            local = f"{layer_prefix}{index}."
            offsets = [(0, layer.layer_number - 1, self.config.num_layers)]  # the layer axis, as GPTModel's
            state = layer.sharded_state_dict(local, offsets, metadata)
            replace_prefix_for_sharding(state, local, layer_prefix)
            out.update(state)
        for name, module in self.named_children():
            if module is not self.layers:
                out.update(
                    sharded_state_dict_default(
                        module, f"{prefix}{name}.", sharded_offsets or (), metadata, tp_group=self.tp_group
                    )
                )
        return out


class GatedHybridModel(HybridModel):
    """megatron's HybridModel writing GPTModel's checkpoint entries: without the empty `output_layer._extra_state`
    (GPTModel drops it, and checkpoints without it must load)."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> ShardedStateDict:
        """LanguageModule's sharded state dict less the output layer's extra state, which must be empty."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        extra = out.pop(f"{prefix}output_layer._extra_state", None)
        if extra is not None and extra.data:
            raise ValueError(f"output_layer._extra_state holds data ({extra.data!r}); GPTModel's layout has none")
        return out
