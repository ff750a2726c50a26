#!/usr/bin/env python
"""Quantized KV pages: capacity and decode attention time per format. See benchmarks/kv_pages.py (`--help`)."""
import sys

from benchmarks.kv_pages import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
