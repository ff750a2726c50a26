"""cluster.yaml: the repository's file is the default deployment, round trips, and every mistake is a
ConfigError naming the key path and what is allowed."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from engine.config import EngineConfig
from pdcluster.cluster_config import (
    API_KEYS_ENV,
    KV_TRANSFER_BACKENDS,
    ClusterConfig,
    ConfigError,
    PoolConfig,
    load_cluster_config,
)

REPO_FILE = Path(__file__).resolve().parents[2] / "cluster.yaml"


@pytest.fixture(autouse=True)
def _no_env_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEYS_ENV, raising=False)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cluster.yaml"
    p.write_text(text)
    return p


def _default_dict() -> dict:
    return yaml.safe_load(REPO_FILE.read_text())


def test_repo_file_is_the_default_deployment():
    cfg = load_cluster_config(REPO_FILE)
    assert cfg == ClusterConfig()
    assert cfg.ray.address is None
    assert cfg.model.path == "builtin:stdlib-4m" and cfg.model.max_model_len == 2048
    assert cfg.mode == "disaggregated"
    assert (cfg.router.host, cfg.router.grpc_port, cfg.router.http_port, cfg.router.api_keys) == (
        "127.0.0.1", 50051, 8000, ())
    assert [(p.name, p.role, p.replicas, p.hardware, p.resources) for p in cfg.pools] == [
        ("prefill", "prefill", 1, "cpu", {"num_cpus": 1}),
        ("decode", "decode", 1, "cpu", {"num_cpus": 1}),
    ]
    assert cfg.kv_cache.num_blocks == "auto" and cfg.kv_cache.memory_mb == 512
    assert cfg.kv_transfer.backend == "auto" and cfg.kv_transfer.compression == "none"
    assert (cfg.timeouts.startup_s, cfg.timeouts.request_s) == (180, 600)
    assert (cfg.slo.ttft_ms, cfg.slo.tpot_ms) == (1000, 50)
    # the routing that measured best (docs/results/serving_vs_vllm.md, kv_aware_serving.md): local
    # prefill of short prompts on, prefix-aware choice on, conditional disaggregation off
    assert (cfg.router.local_prefill_max_tokens, cfg.router.prefix_aware, cfg.router.local_prefill_uncached_tokens) == (
        512, True, 0)


@pytest.mark.parametrize("text", ["", "# only comments\n", "{}\n"])
def test_empty_file_is_the_default_deployment(tmp_path, text):
    assert load_cluster_config(_write(tmp_path, text)) == ClusterConfig()


def test_empty_sections_take_defaults():
    assert ClusterConfig.from_dict({"router": None, "kv_cache": {}, "engine": None}) == ClusterConfig()


def test_round_trip():
    cfg = ClusterConfig.from_dict({
        "ray": {"address": "ray://head.example:10001"},
        "model": {"path": "/models/qwen", "dtype": "bfloat16", "max_model_len": None},
        "router": {"host": "0.0.0.0", "grpc_port": 0, "http_port": 0, "api_keys": ["k1", "k2"]},
        "pools": [
            {"name": "pf-h100", "role": "prefill", "replicas": 2, "hardware": "H100",
             "resources": {"num_cpus": 4, "num_gpus": 1, "memory": 8 << 30, "h100": 1}},
            {"name": "dec", "role": "decode", "replicas": 0, "hardware": "gpu",
             "resources": {"num_gpus": 0.5}},
            {"name": "dec-2", "role": "decode", "cpus": [0, 3]},
        ],
        "kv_cache": {"block_size": 32, "num_blocks": 100, "memory_mb": None},
        "engine": {"max_num_batched_tokens": 512, "max_num_seqs": 8, "enable_prefix_caching": False,
                   "num_threads": 4},
        "kv_transfer": {"backend": "shm", "layerwise": False, "compression": "int8", "timeout_s": 2.5,
                        "shm_in_place": False, "shm_verify": True},
        "timeouts": {"startup_s": 1, "request_s": 0.5},
        "slo": {"ttft_ms": 250, "tpot_ms": 20.5},
    })
    d = cfg.to_dict()
    assert ClusterConfig.from_dict(d) == cfg
    assert yaml.safe_load(yaml.safe_dump(d)) == d  # plain data: dumps and reloads as YAML
    assert ClusterConfig.from_dict(ClusterConfig().to_dict()) == ClusterConfig()
    assert ClusterConfig.from_dict(_default_dict()).to_dict() == ClusterConfig().to_dict()
    assert cfg.validate() == cfg


def test_colocated_mode():
    cfg = ClusterConfig.from_dict({"mode": "colocated", "pools": [{"name": "all", "role": "colocated"}]})
    assert cfg.pools_by_role("colocated") == [PoolConfig(name="all", role="colocated")]
    assert cfg.pools_by_role("prefill") == []


def test_pools_by_role():
    cfg = ClusterConfig.from_dict({"pools": [
        {"name": "p1", "role": "prefill"}, {"name": "d1", "role": "decode"},
        {"name": "p2", "role": "prefill"}]})
    assert [p.name for p in cfg.pools_by_role("prefill")] == ["p1", "p2"]
    assert [p.name for p in cfg.pools_by_role("decode")] == ["d1"]
    with pytest.raises(ValueError, match="allowed: prefill, decode, colocated"):
        cfg.pools_by_role("decoder")


def _with(path: str, value) -> dict:
    """The default file with one key (dotted, list indices as numbers) set to value."""
    d = copy.deepcopy(_default_dict())
    keys = path.split(".")
    node = d
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
    node[int(keys[-1]) if isinstance(node, list) else keys[-1]] = value
    return d


def _pools(*pools: dict) -> dict:
    return {"pools": list(pools)}


ERRORS = [
    # (raw config, key path the message starts with, fragments it contains)
    (_with("pools.1.role", "decoder"), "pools[1].role",
     ["'decoder' is not allowed", "allowed: prefill, decode, colocated"]),
    (_with("router.grpc_prot", 1), "router.grpc_prot",
     ["unknown key", "allowed: api_keys, grpc_port, host, http_port"]),
    ({"routers": {}}, "routers", ["unknown key", "router", "kv_transfer"]),
    (_with("kv_cache.block_size", "sixteen"), "kv_cache.block_size", ["expected an integer, got 'sixteen'"]),
    (_with("kv_cache.block_size", 12), "kv_cache.block_size", ["power of two"]),
    (_with("kv_cache.num_blocks", 0), "kv_cache.num_blocks", ["'auto' or an integer >= 1"]),
    (_with("kv_cache.num_blocks", "many"), "kv_cache.num_blocks", ["'auto' or an integer >= 1"]),
    (_with("kv_cache.num_blocks", 4), "kv_cache.num_blocks", ["max_model_len 2048", ">= 128"]),
    (_with("kv_cache.dtype", "int4"), "kv_cache.dtype", ["'int4' is not allowed", "auto, int8, fp8_e4m3, fp8_e5m2"]),
    ({"kv_cache": {"dtype": "int8"}, "kv_transfer": {"compression": "int8"}}, "kv_transfer.compression",
     ["already quantized", "allowed: 'none'"]),
    (_with("router.grpc_port", 70000), "router.grpc_port", ["out of range", "0..65535"]),
    (_with("router.http_port", -1), "router.http_port", ["out of range", "0..65535"]),
    (_with("router.http_port", 50051), "router.http_port", ["router.grpc_port", "different port"]),
    (_with("router.api_keys", "secret"), "router.api_keys", ["expected a list of strings"]),
    (_with("router.api_keys", ["ok", ""]), "router.api_keys[1]", ["non-empty string"]),
    (_with("pools.0.replicas", -1), "pools[0].replicas", ["out of range", ">= 0"]),
    (_with("pools.0.replicas", 1.5), "pools[0].replicas", ["expected an integer, got 1.5"]),
    (_with("model.dtype", "fp8"), "model.dtype", ["'fp8' is not allowed", "float32, bfloat16, float16"]),
    (_with("model.max_model_len", 1), "model.max_model_len", [">= 2"]),
    (_with("model.path", ""), "model.path", ["must not be empty"]),
    ({"mode": "split"}, "mode", ["'split' is not allowed", "disaggregated, colocated"]),
    (_with("kv_transfer.backend", "rdma"), "kv_transfer.backend",
     ["'rdma' is not allowed", ", ".join(KV_TRANSFER_BACKENDS)]),
    (_with("kv_transfer.compression", "zstd"), "kv_transfer.compression", ["none, int8"]),
    (_with("kv_transfer.compression", False), "kv_transfer.compression", ["none, int8", "quote"]),  # `off`
    (_with("kv_transfer.layerwise", "yes please"), "kv_transfer.layerwise", ["expected true or false"]),
    (_with("kv_transfer.shm_in_place", "no"), "kv_transfer.shm_in_place", ["expected true or false"]),
    (_with("kv_transfer.shm_verify", 1), "kv_transfer.shm_verify", ["expected true or false"]),
    (_with("kv_transfer.timeout_s", 0), "kv_transfer.timeout_s", ["out of range", "> 0"]),
    (_with("timeouts.startup_s", -5), "timeouts.startup_s", ["> 0"]),
    (_with("timeouts.request_s", "10m"), "timeouts.request_s", ["expected a number, got '10m'"]),
    (_with("slo.ttft_ms", 0), "slo.ttft_ms", ["> 0"]),
    (_with("slo.tpot_ms", -1.5), "slo.tpot_ms", ["> 0"]),
    (_with("engine.max_num_seqs", 0), "engine.max_num_seqs", [">= 1"]),
    (_with("engine.max_num_seqs", 4096), "engine.max_num_batched_tokens", ["max_num_seqs", ">= 4096"]),
    (_with("engine.enable_prefix_caching", "true"), "engine.enable_prefix_caching",
     ["expected true or false"]),
    (_with("engine.num_threads", 0), "engine.num_threads", [">= 1"]),
    (_with("ray.address", "localhost"), "ray.address", ["'auto'", "ray://HOST[:PORT]", "HOST:PORT"]),
    (_with("ray.address", "head:99999"), "ray.address", ["HOST:PORT"]),
    ({"pools": {"name": "p"}}, "pools", ["expected a list of pools"]),
    (_pools("prefill", {"name": "d", "role": "decode"}), "pools[0]", ["expected a mapping"]),
    (_pools({"name": "Prefill_1", "role": "prefill"}, {"name": "d", "role": "decode"}), "pools[0].name",
     ["'Prefill_1' is not allowed", "[a-z0-9][a-z0-9-]*"]),
    (_pools({"name": "x", "role": "prefill"}, {"name": "x", "role": "decode"}), "pools[1].name",
     ["already used by pools[0]", "unique"]),
    (_pools({"role": "prefill"}), "pools[0].name", ["required", "[a-z0-9][a-z0-9-]*"]),
    (_pools({"name": "p"}), "pools[0].role", ["required", "prefill, decode, colocated"]),
    (_pools({"name": "p", "role": "prefill", "gpus": 1}), "pools[0].gpus",
     ["unknown key", "cpus, expert_parallel, hardware, max_replicas, min_replicas, name, replicas, resources, role"]),
    (_with("pools.0.cpus", []), "pools[0].cpus", ["non-empty list of CPU ids"]),
    (_with("pools.0.cpus", [0, 0]), "pools[0].cpus", ["distinct CPU ids"]),
    (_with("pools.0.cpus", ["0"]), "pools[0].cpus", ["list of CPU ids"]),
    (_with("pools.0.cpus", 1), "pools[0].cpus", ["list of CPU ids"]),
    (_with("pools.0.resources", {"num_cpus": -1}), "pools[0].resources.num_cpus", [">= 0"]),
    (_with("pools.0.resources", {"num_cpus": "two"}), "pools[0].resources.num_cpus", ["expected a number"]),
    (_with("pools.0.resources", {"num_cpu": 1}), "pools[0].resources.num_cpu", ["unknown key", "num_cpus"]),
    (_with("pools.0.resources", {"memory": 1.5}), "pools[0].resources.memory", ["expected an integer"]),
    (_with("pools.0.resources", {"GPU": 1}), "pools[0].resources.GPU", ["num_gpus"]),
    (_with("pools.0.resources", {"num_cpus": 1, "tpu-slice": -2}), "pools[0].resources.tpu-slice", [">= 0"]),
    (_with("pools.0.resources", [1]), "pools[0].resources", ["expected a mapping"]),
    (_with("pools.0.hardware", "H100"), "pools[0].resources.num_gpus", ["num_gpus > 0", "hardware: cpu"]),
    (_with("pools.0.resources", {"num_gpus": 1.5}), "pools[0].resources.num_gpus", ["whole number"]),
    # mode consistency
    (_pools({"name": "d", "role": "decode"}), "pools", ["at least one prefill replica", "prefill, decode"]),
    (_with("pools.1.replicas", 0), "pools", ["at least one decode replica", "(decode)"]),
    (_pools(), "pools", ["at least one prefill replica"]),
    (_pools({"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"},
            {"name": "c", "role": "colocated"}),
     "pools[2].role", ["not allowed in mode disaggregated", "allowed: prefill, decode"]),
    ({"mode": "colocated"}, "pools[0].role",
     ["'prefill' is not allowed in mode colocated", "allowed: colocated"]),
    ({"mode": "colocated", "pools": [{"name": "c", "role": "colocated", "replicas": 0}]}, "pools",
     ["at least one colocated replica"]),
    ([1, 2], "(top level)", ["expected a mapping"]),
    ({"router": "localhost"}, "router", ["expected a mapping", "grpc_port"]),
]


@pytest.mark.parametrize("raw,key,fragments", ERRORS, ids=[f"{i}-{e[1]}" for i, e in enumerate(ERRORS)])
def test_errors_name_key_and_allowed(raw, key, fragments):
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_dict(raw)
    msg = str(info.value)
    assert msg.startswith(f"{key}: "), msg
    for f in fragments:
        assert f in msg, (f, msg)
    assert isinstance(info.value, ValueError)


MORE_ERRORS = [
    # bounds on both sides, and the hints that follow the allowed range
    (_with("ray.max_restarts", 1001), "ray.max_restarts", ["1001 is out of range; allowed: 0..1000"]),
    (_with("router.max_retries", 11), "router.max_retries", ["11 is out of range; allowed: 0..10"]),
    (_with("router.grpc_port", 65536), "router.grpc_port", ["allowed: 0..65535 (0: pick a free port)"]),
    (_with("router.max_requests", 0), "router.max_requests", ["0 is out of range; allowed: >= 1"]),
    (_with("router.local_prefill_max_tokens", -1), "router.local_prefill_max_tokens", ["allowed: >= 0"]),
    (_with("kv_cache.memory_mb", 0), "kv_cache.memory_mb", ["allowed: >= 1"]),
    (_with("kv_cache.memory_mb", "1G"), "kv_cache.memory_mb", ["expected an integer or null, got '1G'"]),
    (_with("pools.0.resources", {"memory": -1}), "pools[0].resources.memory", ["-1 is out of range; allowed: >= 0 (bytes)"]),
    (_with("kv_transfer.lease_s", float("inf")), "kv_transfer.lease_s", ["inf is not allowed; allowed: a finite number"]),
    (_with("kv_transfer.timeout_s", -2), "kv_transfer.timeout_s", ["-2 is out of range; allowed: > 0"]),
    (_with("router.tls_cert", 5), "router.tls_cert", ["expected a string or null, got 5"]),
    (_with("router.host", " "), "router.host", ["must not be empty"]),
    (_with("pools.0.role", True), "pools[0].role", ["true is not allowed", "quote the value"]),
    (_with("router", {1: 2}), "router.1", ["unknown key"]),
    # an accelerator pool that leaves its resources at the default still needs a GPU
    (_pools({"name": "g", "role": "prefill", "hardware": "gpu"}, {"name": "d", "role": "decode"}),
     "pools[0].resources.num_gpus", ["num_gpus > 0"]),
    # of several mistakes the first in the file's order, unknown keys of a section first
    ({"router": {"grpc_port": -1, "bogus": 1}, "kv_cache": {"block_size": 3}}, "router.bogus", ["unknown key"]),
    ({"router": {"grpc_port": -1}, "kv_cache": {"block_size": 3}}, "router.grpc_port", ["out of range"]),
    (_pools({"name": "Bad"}), "pools[0].role", ["required"]),
]


@pytest.mark.parametrize("raw,key,fragments", MORE_ERRORS, ids=[f"{i}-{e[1]}" for i, e in enumerate(MORE_ERRORS)])
def test_bounds_and_first_mistake(raw, key, fragments):
    test_errors_name_key_and_allowed(raw, key, fragments)


def test_code_built_configs_are_not_checked_until_validate():
    cfg = replace(ClusterConfig(), router=replace(ClusterConfig().router, grpc_port=-1))  # no error here
    with pytest.raises(ConfigError, match=r"^router\.grpc_port: -1 is out of range"):
        cfg.validate()


def test_file_errors_name_the_file(tmp_path):
    p = _write(tmp_path, "router:\n  grpc_prot: 1\n")
    with pytest.raises(ConfigError, match=r"cluster\.yaml: router\.grpc_prot: unknown key") as info:
        load_cluster_config(p)
    assert info.value.key == "router.grpc_prot" and info.value.file == str(p)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    p = _write(tmp_path, "ray: {address: null}\nrouter:\n  host: 127.0.0.1\n   grpc_port: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_cluster_config(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}: line 4"), msg
    assert "invalid YAML" in msg


def test_duplicate_key_is_an_error(tmp_path):
    p = _write(tmp_path, "router:\n  http_port: 8000\n  http_port: 8001\n")
    with pytest.raises(ConfigError, match=r"line 3.*duplicate key 'http_port' \(first given on line 2\)"):
        load_cluster_config(p)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_cluster_config(tmp_path / "nope.yaml")


def test_env_api_keys_merge(tmp_path, monkeypatch):
    p = _write(tmp_path, "router: {api_keys: [from-file, shared]}\n")
    monkeypatch.setenv(API_KEYS_ENV, " from-env ,shared,, other ")
    assert load_cluster_config(p).router.api_keys == ("from-file", "shared", "from-env", "other")
    assert load_cluster_config(p, env={}).router.api_keys == ("from-file", "shared")
    assert load_cluster_config(REPO_FILE, env={API_KEYS_ENV: "k"}).router.api_keys == ("k",)
    monkeypatch.setenv(API_KEYS_ENV, "")
    assert load_cluster_config(p).router.api_keys == ("from-file", "shared")


def test_api_keys_not_in_repr():
    cfg = ClusterConfig.from_dict({"router": {"api_keys": ["very-secret"]}})
    assert "very-secret" not in repr(cfg)


def test_engine_kwargs_build_engine_config():
    cfg = ClusterConfig()
    kwargs = cfg.engine_kwargs()
    ec = EngineConfig(**kwargs)
    assert ec.model == "builtin:stdlib-4m" and ec.dtype == "auto" and ec.max_model_len == 2048
    assert ec.block_size == 16 and ec.num_blocks is None
    assert ec.kv_cache_memory_bytes == 512 * 1024 * 1024
    assert (ec.max_num_batched_tokens, ec.max_num_seqs, ec.enable_prefix_caching, ec.num_threads) == (
        2048, 256, True, None)

    custom = ClusterConfig.from_dict({
        "model": {"dtype": "bfloat16", "max_model_len": None},
        "kv_cache": {"block_size": 8, "num_blocks": 64, "memory_mb": None},
        "engine": {"max_num_batched_tokens": 64, "max_num_seqs": 4, "enable_prefix_caching": False,
                   "num_threads": 2},
        "pools": [{"name": "p", "role": "prefill"},
                  {"name": "d", "role": "decode", "hardware": "gpu", "resources": {"num_gpus": 1}}],
    })
    ec = EngineConfig(**custom.engine_kwargs())
    assert (ec.dtype, ec.max_model_len, ec.block_size, ec.num_blocks, ec.kv_cache_memory_bytes) == (
        "bfloat16", None, 8, 64, None)
    assert (ec.max_num_batched_tokens, ec.max_num_seqs, ec.enable_prefix_caching, ec.num_threads) == (
        64, 4, False, 2)
    prefill, decode = custom.pools
    assert EngineConfig(**custom.engine_kwargs(prefill)).device == "cpu"
    assert EngineConfig(**custom.engine_kwargs(decode)).device == "cuda"


def test_validate_checks_code_built_configs():
    cfg = replace(ClusterConfig(), mode="colocated")
    with pytest.raises(ConfigError, match=r"pools\[0\]\.role: 'prefill' is not allowed in mode colocated"):
        cfg.validate()


def test_the_ray_command_is_the_one_beside_this_interpreter(tmp_path, monkeypatch):
    import sys

    from pdcluster.launcher import ray_cli

    venv_bin, on_path = tmp_path / "venv" / "bin", tmp_path / "path"
    venv_bin.mkdir(parents=True)
    on_path.mkdir()
    (on_path / "ray").write_text("#!/bin/sh\n")
    (on_path / "ray").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(on_path))
    assert ray_cli() == str(on_path / "ray")  # nothing beside the interpreter: PATH
    (venv_bin / "ray").write_text("#!/bin/sh\n")
    (venv_bin / "ray").chmod(0o755)
    assert ray_cli() == str(venv_bin / "ray")  # a venv's own ray wins, activated or not
    (venv_bin / "ray").unlink()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="no `ray` command"):
        ray_cli()


@pytest.mark.parametrize("backend, in_place, verify", [("auto", True, False), ("shm", False, True), ("grpc", True, True)])
def test_the_shm_writer_options_reach_the_workers_that_use_them(backend, in_place, verify, monkeypatch):
    """kv_transfer.shm_in_place / shm_verify become the prefill worker's sender options and the
    decode worker's receiver option, for the backends with a shm part only."""
    from pdcluster.launcher import KV_FAULTS_ENV, worker_options

    monkeypatch.delenv(KV_FAULTS_ENV, raising=False)
    cfg = ClusterConfig.from_dict({"kv_transfer": {"backend": backend, "shm_in_place": in_place,
                                                   "shm_verify": verify}})
    prefill, decode = (worker_options(cfg, role, "127.0.0.1") for role in ("prefill", "decode"))
    if backend == "grpc":
        assert "kv_options" not in prefill and "kv_options" not in decode
    else:
        assert prefill["kv_options"] == {"in_place": in_place, "verify_in_place": verify}
        assert decode["kv_options"] == {"in_place": in_place}
    assert prefill["kv_backend"] == decode["kv_backend"] == backend
    assert "kv_options" not in worker_options(cfg, "colocated", "127.0.0.1")


def test_a_prefill_worker_on_cuda_pinned_to_torch_distributed_sends_over_nccl(monkeypatch):
    """Its decode worker's receiver builds NCCL groups for a CUDA cache; the sender must ask for
    NCCL too (its default is gloo), else every pair is refused at `up`."""
    from pdcluster.launcher import KV_FAULTS_ENV, worker_options

    monkeypatch.delenv(KV_FAULTS_ENV, raising=False)
    cfg = ClusterConfig.from_dict({"kv_transfer": {"backend": "torch_distributed"}})
    on_cuda = worker_options(cfg, "prefill", "127.0.0.1", device="cuda")
    assert on_cuda["kv_options"] == {"dist_backend": "nccl"}
    assert "kv_options" not in worker_options(cfg, "prefill", "127.0.0.1")  # CPU: gloo, the sender's default
    assert "kv_options" not in worker_options(cfg, "decode", "127.0.0.1", device="cuda")


def test_a_pool_tensor_parallel_size_reaches_its_engines():
    cfg = ClusterConfig.from_dict({"pools": [
        {"name": "p", "role": "prefill", "tensor_parallel_size": 2},
        {"name": "d", "role": "decode", "hardware": "h200", "tensor_parallel_size": 4,
         "resources": {"num_gpus": 4}}]})
    prefill, decode = cfg.pools
    assert EngineConfig(**cfg.engine_kwargs(prefill)).tensor_parallel_size == 2
    assert EngineConfig(**cfg.engine_kwargs(decode)).tensor_parallel_size == 4
    assert ClusterConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("pool, key, fragment", [
    ({"tensor_parallel_size": 0}, "pools[0].tensor_parallel_size", ">= 1"),
    ({"tensor_parallel_size": 2, "hardware": "h200", "resources": {"num_gpus": 1}}, "pools[0].num_gpus",
     "1 GPUs per replica cannot hold 2 tensor-parallel ranks"),
])
def test_a_tensor_parallel_size_its_resources_cannot_hold_is_refused(pool, key, fragment):
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_dict({"pools": [{"name": "p", "role": "prefill", **pool}, {"name": "d", "role": "decode"}]})
    assert str(e.value).startswith(key) and fragment in str(e.value)


def test_up_refuses_a_tensor_parallel_size_that_cannot_split_the_model_naming_the_pool():
    from pdcluster.ray_runtime import LaunchError
    from pdcluster.worker_launch import check_tensor_parallel

    tiny = {"path": "builtin:tiny-llama"}  # 8 heads, 4 KV heads
    ok = ClusterConfig.from_dict({"model": tiny, "pools": [{"name": "p", "role": "prefill", "tensor_parallel_size": 2},
                                                           {"name": "d", "role": "decode", "tensor_parallel_size": 4}]})
    check_tensor_parallel(ok)
    bad = ClusterConfig.from_dict({"model": tiny, "pools": [{"name": "p", "role": "prefill"},
                                                            {"name": "d", "role": "decode", "tensor_parallel_size": 3}]})
    with pytest.raises(LaunchError, match=r"pools\[1\].tensor_parallel_size \(pool 'd'\): .*divide the model's 8 "
                                          "attention heads"):
        check_tensor_parallel(bad)


def test_the_controller_section_is_off_by_default_and_maps_to_the_policy():
    cfg = ClusterConfig.from_dict({"controller": {"enabled": True, "interval_s": 2, "cooldown_s": 10},
                                   "slo": {"ttft_ms": 500, "tpot_ms": 40}})
    assert not ClusterConfig().controller.enabled
    c = cfg.controller_config()
    assert (c.interval_s, c.cooldown_s, c.slo_ttft_ms, c.slo_tpot_ms, c.flips) == (2.0, 10.0, 500.0, 40.0, True)


@pytest.mark.parametrize("raw, key, fragment", [
    ({"controller": {"scale_down_at": 0.5, "shrink_to": 0.4}}, "controller.scale_up_at", "scale_down_at < shrink_to"),
    ({"controller": {"enabled": True}, "mode": "colocated", "pools": [{"name": "w", "role": "colocated"}]},
     "controller.enabled", "mode colocated"),
    ({"pools": [{"name": "p", "role": "prefill", "replicas": 3, "max_replicas": 2}, {"name": "d", "role": "decode"}]},
     "pools[0].replicas", "max_replicas 2"),
    ({"pools": [{"name": "p", "role": "prefill", "min_replicas": 2}, {"name": "d", "role": "decode"}]},
     "pools[0].replicas", "min_replicas 2"),
])
def test_controller_settings_that_cannot_work_are_refused(raw, key, fragment):
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_dict(raw)
    assert str(info.value).startswith(f"{key}: ") and fragment in str(info.value), str(info.value)


def test_a_worker_as_an_autoscaler_bundle():
    """What the controller asks Ray's autoscaler to fit per worker (RayFleet.request_nodes): the
    pool's resources as Ray names them, and the pool's node marker where the cluster has it."""
    from pdcluster.worker_launch import worker_bundle

    cfg = ClusterConfig.from_dict({"pools": [
        {"name": "pf", "role": "prefill", "hardware": "H100",
         "resources": {"num_cpus": 4, "num_gpus": 1, "memory": 8 << 30, "h100": 1}},
        {"name": "dec", "role": "decode"}]})
    assert worker_bundle(cfg.pools[0], {"pool:pf": 2.0}) == {"CPU": 4.0, "GPU": 1.0, "h100": 1, "pool:pf": 1,
                                                             "memory": float(8 << 30)}
    assert worker_bundle(cfg.pools[1], {"pool:pf": 2.0}) == {"CPU": 1.0}
