"""Models in and out of megagate: Hugging Face formats (hf: configs and tensors; hf_io: folders and checkpoints)."""
