"""TLS on the router's public ports, with a self-signed certificate made in the test: the gRPC API and
the HTTPS API serve clients that trust it, and refuse plaintext. Real servers in this process (no Ray)."""

from __future__ import annotations

import ssl

import grpc
import httpx
import pytest

from benchmarks.soak import self_signed
from engine.config import EngineConfig
from pdcluster.client import Client
from pdcluster.cluster_config import ClusterConfig, ConfigError
from pdcluster.local_cluster import LocalCluster
from router.server import RouterServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tls_stack(builtin_path, tmp_path_factory):
    cert, key = self_signed(str(tmp_path_factory.mktemp("tls")))
    cfg = EngineConfig(model=str(builtin_path), num_blocks=64, max_model_len=256, num_threads=1)
    with LocalCluster(cfg, tls=(cert, key), router={"model": "builtin:tiny-llama", "request_timeout_s": 30,
                                                    "api_keys": ["k"]}, http={"api_keys": ["k"]}) as c:
        yield c.router, c.http, cert


def test_grpc_over_tls_serves_a_client_that_trusts_the_certificate_only(tls_stack):
    router, _, cert = tls_stack
    with Client(router.address, api_key="k", tls_ca=cert) as client:
        assert len(client.complete("Hello", max_tokens=4, temperature=0.0, ignore_eos=True).token_ids) == 4
    with Client(router.address, api_key="k", timeout_s=5) as plain, pytest.raises(grpc.RpcError) as err:
        plain.complete("Hello", max_tokens=4)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_https_serves_with_the_certificate_and_refuses_plaintext(tls_stack):
    _, api, cert = tls_stack
    url = f"https://{api.address}/v1/completions"
    trust = ssl.create_default_context(cafile=cert)
    r = httpx.post(url, verify=trust, headers={"authorization": "Bearer k"}, timeout=30,
                   json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.post(url, verify=trust, json={"prompt": "Hello"}, timeout=30).status_code == 401  # keys still apply
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"https://{api.address}/health", timeout=5)  # a certificate nobody vouched for
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{api.address}/health", timeout=5)


def test_tls_config_needs_both_files(tmp_path):
    cfg = ClusterConfig.from_dict({"router": {"tls_cert": "c.pem", "tls_key": "k.pem"}})
    assert (cfg.router.tls_cert, cfg.router.tls_key) == ("c.pem", "k.pem")
    with pytest.raises(ConfigError, match=r"router\.tls_key: required"):
        ClusterConfig.from_dict({"router": {"tls_cert": "c.pem"}})
    with pytest.raises(ValueError, match=r"tls_cert: cannot read"):
        RouterServer("builtin:tiny-llama", tls_cert=str(tmp_path / "none.pem"), tls_key=str(tmp_path / "none.pem"))
