"""Data tools: real-text corpus, tokenizers, parallel preprocessing to megatron's indexed format, blends, loaders.

Modules (each with one job; importing this package is cheap — no torch, no megatron):

- `corpus`      deterministic real-text corpus from the Python stdlib (docstrings, source) and license texts
- `tokenizer`   train byte-level BPE; load HF `tokenizer.json`, SentencePiece and tiktoken files; megatron adapter
- `fast_bpe`    rank-based (tiktoken) engine built from a `tokenizer.json`, producing HF's exact token ids
- `formats`     what an input file is, and streaming openers: .gz / .zst lines, Parquet row groups and columns
- `readers`     streaming input readers (JSONL, text, Parquet; folders, globs) with bad-line accounting
- `indexed`     streaming, atomic writer of megatron `IndexedDataset` files and a validating reader
- `preprocess`  the parallel preprocessing pipeline (`megagate preprocess`; `progress`: its progress line)
- `units`       a sharded run's work units: the plan, its manifest with input fingerprints, done records
- `shards`      plan, process units anywhere, merge them into the single run's bytes (streaming)
- `loader`      `build_datasets` (GPTDataset / BlendedMegatronDatasetBuilder) and `build_loader` (torch | dali)
- `sampler`     Megatron-LM's pretraining sampler and micro-batch assembly (which samples each rank reads)
- `dali_loader` the DALI pipeline behind `build_loader(kind="dali")`
- `demo`        `prepare_demo_data`: corpus -> tokenizer -> indexed prefix in one call, cached; `run_tokenizer`

`megagate data inspect PREFIX` is `megagate.commands.data` (reading through `indexed`).
"""
