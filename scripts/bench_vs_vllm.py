#!/usr/bin/env python
"""Offline engine speed: pdcluster's `LLM` vs vLLM's CPU engine (`vllm.LLM`), side by side.
See benchmarks/engine_vs_vllm.py (`--help`)."""
import sys

from benchmarks.engine_vs_vllm import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
