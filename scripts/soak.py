#!/usr/bin/env python
"""Soak test: mixed load with faults on a schedule; reports sent / completed / retried / failed / lost,
leaked KV blocks and RSS per process. See benchmarks/soak.py (`--help`)."""
import sys

from benchmarks.soak import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
