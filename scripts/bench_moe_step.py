#!/usr/bin/env python
"""A MoE decode step against a dense model of its active size. See benchmarks/moe_step.py (`--help`)."""
import sys

from benchmarks.moe_step import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
