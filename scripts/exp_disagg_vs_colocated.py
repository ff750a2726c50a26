#!/usr/bin/env python
"""Experiment: disaggregated against colocated serving, same model, same cores, same workload.
See benchmarks/disagg_vs_colocated.py (`--help`)."""
import sys

from benchmarks.disagg_vs_colocated import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
