#!/usr/bin/env python
"""The planner's accuracy: simulate the clusters a `pdcluster bench serve` run measured, compare.
See benchmarks/planner_accuracy.py (`--help`)."""
import sys

from benchmarks.planner_accuracy import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
