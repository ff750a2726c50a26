"""Benchmarks, experiments and long-running checks that drive the cluster from above: the KV
transfer benchmark (`pdcluster bench transfer`), the soak test, the serving experiments (against
colocated serving, against vLLM, TTFT by phase), the offline engine benchmark against vLLM, and the
planner's accuracy against measured runs. Each module with a `main(argv)` runs as
`python -m benchmarks.<module>`, and through a small wrapper in scripts/ (scripts/exp_vs_vllm.py
runs benchmarks/serving_vs_vllm.py)."""
