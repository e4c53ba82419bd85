"""Models in and out of megagate, in Hugging Face formats: `hf` (the interface), `hf_config` (which format holds which
model; config.json both ways), `hf_weights` (exact tensor mapping), `hf_folder` (safetensors shards, tokenizer files,
config.json on disk), `hf_io` (`megagate export` / `import` / `analyze HF_DIR`: checkpoints <-> folders, models
through megagate.model_factory)."""
