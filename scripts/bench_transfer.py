#!/usr/bin/env python
"""KV transfer benchmark (grpc / shm vs a plain socket and memcpy; layer-wise overlap). See kv_transfer/bench.py."""
import sys

from kv_transfer.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
