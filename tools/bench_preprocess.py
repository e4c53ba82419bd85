#!/usr/bin/env python
"""Preprocessing throughput (HF loop vs hf/fast engines x workers) and loader samples/s on the stdlib corpus."""

import sys

from megagate.data.bench import main

if __name__ == "__main__":
    sys.exit(main())
