"""The gated-attention model: gate math and presets (gate), fused qkv row layout (qkv_layout), the attention module
(attention), megatron layer specs (spec), model description and presets (config), pure parameter/FLOP arithmetic
(counts), and megatron objects built from them (build)."""
