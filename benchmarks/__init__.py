"""Benchmarks and long-running checks that drive the cluster from above: the KV transfer
benchmark (`pdcluster bench transfer`) and the soak test (`scripts/soak.py`)."""
