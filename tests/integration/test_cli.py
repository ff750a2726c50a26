"""`pdcluster up --detach`, `status`, `generate`, `down` from a shell, as a user runs them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.net import fixed_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _pdcluster(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


def test_up_detach_status_generate_down_from_a_shell(tmp_path):
    port = fixed_port()
    config = tmp_path / "cluster.yaml"
    config.write_text((ROOT / "cluster.yaml").read_text().replace("grpc_port: 50051", f"grpc_port: {port}")
                      .replace("http_port: 8000", f"http_port: {fixed_port()}"))
    up = _pdcluster("up", "--detach", "-c", str(config))
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert f"127.0.0.1:{port}" in up.stdout and "prefill-0" in up.stdout and "decode-0" in up.stdout

        status = _pdcluster("status")
        assert status.returncode == 0, status.stderr[-3000:]
        lines = status.stdout.splitlines()
        assert any("prefill-0" in line and "healthy" in line for line in lines), status.stdout
        assert any("decode-0" in line and "healthy" in line for line in lines), status.stdout
        # what the cache keeps per token: K and V of every layer's heads, in the model's dtype (the
        # default model's bfloat16 where the CPU has it natively, else float32)
        kv = re.search(r"KV per token: heads:(\d+)x(\d+)x(\d+) (float32|bfloat16), (\d+) B/token", status.stdout)
        assert kv is not None, status.stdout
        heads, head_dim, layers, per_token = (int(kv[i]) for i in (1, 2, 3, 5))
        assert per_token == 2 * heads * head_dim * layers * (4 if kv[4] == "float32" else 2)

        gen = _pdcluster("generate", "--json", "--max-tokens", "8", "Once upon a time")
        assert gen.returncode == 0, gen.stderr[-3000:]
        result = json.loads(gen.stdout.strip().splitlines()[-1])
        assert len(result["token_ids"]) == 8 and result["finish_reason"] in ("length", "stop")
        assert result["timing"]["ttft_ms"] > 0

        streamed = _pdcluster("generate", "--max-tokens", "8", "Hello")
        assert streamed.returncode == 0 and "finish_reason=" in streamed.stderr

        served = _pdcluster("status").stdout  # each worker's prefix-cache hit rate, of the prompt tokens it served
        assert "prefix hits" in served and any("prefill-0" in line and "% of " in line for line in served.splitlines())
    finally:
        down = _pdcluster("down")
    assert down.returncode == 0, down.stderr[-3000:]
    after = _pdcluster("status")
    assert after.returncode != 0 and "no detached pdcluster" in after.stderr


def test_bad_cluster_yaml_is_refused_with_the_key_named(tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text("mode: disaggregated\nrouter: {grpc_prot: 1}\n")
    result = _pdcluster("up", "-c", str(config), timeout=60)
    assert result.returncode == 2
    assert "router.grpc_prot" in result.stderr and "allowed" in result.stderr
