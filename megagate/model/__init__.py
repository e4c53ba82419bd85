"""The gated-attention model: gate math and presets (gate), the table of gate parameters (gate_params), fused qkv row
layout and the tensor-parallel check (qkv_layout), the attention module (attention), the SDPA core attention
(core_attention), the kernel choices (kernels: backend, core attention, experts), megatron layer specs (spec), the
model description (model_config: ModelConfig, ParallelConfig) and the named models (presets), pure parameter/FLOP
arithmetic (counts), and megatron objects built from them (build)."""
