"""`pdcluster plan` end to end: the cluster.yaml it writes is accepted by the schema and brought up."""

from __future__ import annotations

import dataclasses

import pytest

from cli.main import main
from pdcluster.client import Client
from pdcluster.cluster_config import load_cluster_config
from pdcluster.launcher import up

pytestmark = pytest.mark.slow


def test_plan_writes_a_cluster_yaml_that_up_brings_up_and_stop_stops(tmp_path, capsys):
    rc = main(["plan", "--workload", "azure-conv", "--num-requests", "200", "--max-requests", "200",
               "--max-context", "1024", "--max-output", "64", "--model", "builtin:tiny-llama", "--pools", "cpu",
               "--tp", "1", "--max-workers", "1", "--slo-ttft-ms", "3000", "--slo-tpot-ms", "300", "--verify", "2",
               "--out", str(tmp_path), "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "Azure/AzurePublicDataset" in printed and "best: " in printed
    for name in ("table.md", "plan.json", "pareto.png", "cluster.yaml"):
        assert (tmp_path / name).is_file(), name
    cfg = load_cluster_config(tmp_path / "cluster.yaml")
    assert cfg.model.path == "builtin:tiny-llama" and all(p.hardware == "cpu" for p in cfg.pools)
    assert cfg.slo.ttft_ms == 3000 and cfg.slo.tpot_ms == 300
    # free ports: other clusters may run on this machine
    cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, grpc_port=0, http_port=0))
    handle = up(cfg, log_level="warning")
    try:
        roles = sorted(w["role"] for w in handle.workers)
        assert roles == (["decode", "prefill"] if cfg.mode == "disaggregated" else ["colocated"])
        with Client(handle.router_address, timeout_s=120) as client:
            out = client.complete("Once upon a time", max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
    finally:
        handle.stop()
    import ray

    assert not ray.is_initialized()
