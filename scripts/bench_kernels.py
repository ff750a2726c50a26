#!/usr/bin/env python
"""The engine's CPU kernels against their rooflines and torch's. See benchmarks/engine_kernels.py (`--help`)."""
import sys

from benchmarks.engine_kernels import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
