#!/usr/bin/env python
"""The yardstick model's held-back perplexity, top-1 and a greedy completion.
See benchmarks/yardstick_eval.py (`--help`)."""
import sys

from benchmarks.yardstick_eval import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
