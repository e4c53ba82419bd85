"""Evaluation of checkpoints on any data at any length: `megagate eval` (perplexity per dataset, length and position
bucket, with the F-Attn / M-Act diagnostics at each length), under any TP x PP x DP layout.

`options` parses and checks the command line (lengths, `--rope` overrides of the position embedding, data specs)
before anything is built; `core` loads each checkpoint into this rank's model chunks and runs megatron's
forward-only schedule; `output` writes the table, results.json and the perplexity-vs-length PNG.
"""
