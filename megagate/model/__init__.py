"""The gated-attention model: gate math and presets (gate), the table of gate parameters (gate_params), fused qkv row
layout and the tensor-parallel check (qkv_layout), the attention module (attention), megatron layer specs (spec),
model description and presets (config), pure parameter/FLOP arithmetic (counts), and megatron objects built from them
(build)."""
