#!/usr/bin/env python
"""Experiment: where a short request's TTFT goes while other requests stream their tokens.
See benchmarks/ttft_phases.py (`--help`)."""
import sys

from benchmarks.ttft_phases import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
