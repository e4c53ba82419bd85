#!/usr/bin/env python
"""Train a byte-level BPE tokenizer.json: same as `megagate tokenizer train` (see --help)."""

import sys

from megagate.cli import main

if __name__ == "__main__":
    sys.exit(main(["tokenizer", "train", *sys.argv[1:]]))
