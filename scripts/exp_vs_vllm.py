#!/usr/bin/env python
"""Experiment: serving against vLLM's CPU server, same checkpoint, same two cores, same requests.
See benchmarks/serving_vs_vllm.py (`--help`)."""
import sys

from benchmarks.serving_vs_vllm import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
