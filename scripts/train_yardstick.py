#!/usr/bin/env python
"""Train the yardstick model (a small Llama on Python's standard library).
See benchmarks/yardstick_train.py (`--help`)."""
import sys

from benchmarks.yardstick_train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
