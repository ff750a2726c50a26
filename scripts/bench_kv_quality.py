#!/usr/bin/env python
"""Quantized KV pages' quality on the yardstick model. See benchmarks/kv_quality.py (`--help`)."""
import sys

from benchmarks.kv_quality import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
