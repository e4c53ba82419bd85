"""Sub-commands contributed to the `megagate` CLI (registered by megagate/cli.py when this module exists)."""

COMMANDS: dict[str, tuple[str, str]] = {
    "preprocess": ("megagate.data.cli_preprocess", "tokenize JSONL/text into megatron .bin/.idx datasets (parallel, streaming, atomic)"),
    "tokenizer": ("megagate.data.cli_tokenizer", "train a byte-level BPE tokenizer, or check the fast engine against HF"),
    "data": ("megagate.data.cli_data", "inspect preprocessed datasets (documents, tokens, length histogram, decoded sample)"),
}
