#!/usr/bin/env python
"""KV transfer benchmark (grpc / shm vs a plain socket and memcpy; layer-wise overlap). See benchmarks/kv_transfer.py."""
import sys

from benchmarks.kv_transfer import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
