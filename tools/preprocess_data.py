#!/usr/bin/env python
"""Tokenize JSONL/Parquet/text into megatron .bin/.idx datasets: same as `megagate preprocess` (see --help)."""

import sys

from megagate.cli import main

if __name__ == "__main__":
    sys.exit(main(["preprocess", *sys.argv[1:]]))
