"""The KV offload tier through real workers: a cluster whose caches are too small to keep a prompt
serves it again from the node's tier, token for token what an engine without a tier serves; a full
tier only drops blocks; an engine that dies holding tier blocks loses nothing (its neighbour reads
them) and leaks nothing (the last engine out removes the directory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_tier import DIR_PREFIX
from engine.sampling_params import SamplingParams
from pdcluster.llm import LLM
from pdcluster.local_cluster import LocalCluster
from proto import worker_pb2 as wk

pytestmark = pytest.mark.slow

MODEL = "builtin:tiny-llama"
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[1] + [(37 * i + 11 * j) % 8000 + 4 for j in range(150)] for i in range(6)]


def _cfg(path: Path | None, offload: int = 64 << 20, blocks: int = 24) -> EngineConfig:
    return EngineConfig(model=MODEL, dtype="float32", num_blocks=blocks, block_size=16, max_model_len=256,
                        num_threads=1, max_num_seqs=4, kv_offload_bytes=offload if path else 0,
                        kv_offload_path=str(path) if path else None)


def _reference() -> list[list[int]]:
    llm = LLM(MODEL, dtype="float32", num_blocks=64, max_model_len=256)
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def test_a_cluster_serves_evicted_prefixes_from_its_tier_token_for_token(tmp_path: Path) -> None:
    tier = tmp_path / f"{DIR_PREFIX}cluster"
    want = _reference()
    with LocalCluster(_cfg(tier), 2, 1, router={"request_timeout_s": 60}) as c, c.client() as client:
        first = [client.complete(p, PARAMS).token_ids for p in PROMPTS]  # each evicts the one before
        again = [client.complete(p, PARAMS).token_ids for p in PROMPTS]
        stats = [w.stats() for w in c.workers]
    assert first == want and again == want
    assert len({s.tier_id for s in stats}) == 1 and stats[0].tier_id  # one tier, shared by the three
    assert sum(s.tier_saves for s in stats) > 0
    assert sum(s.tier_hits for s in stats) >= 9  # a prompt's 9 full blocks, at least, came back from the tier
    prefill = [s for s in stats if s.role == wk.WORKER_ROLE_PREFILL]
    assert sum(s.prefix_cache_hit_tokens for s in prefill) >= 5 * 9 * 16  # the second round barely computed
    assert not tier.exists()  # the last worker out removed it


def test_a_full_tier_only_drops_blocks(tmp_path: Path) -> None:
    tier = tmp_path / f"{DIR_PREFIX}small"
    block_file = 16 * 2 * 6 * 4 * 48 * 4 + 64 + 16 * 8  # K and V of 6 layers, the header, the token ids
    engine = Engine(_cfg(tier, offload=3 * block_file), "colocated")
    try:
        got = []
        for round_ in range(2):
            for i, p in enumerate(PROMPTS):
                seq = engine.add_request(f"{round_}-{i}", p, PARAMS)
                while engine.has_work():
                    engine.step()
                got.append(seq.token_ids[len(p):])
        s = engine.tier_stats()
        assert s.blocks <= 3 and s.used_bytes <= 3 * block_file and s.evictions > 0
        assert len(list(tier.glob("*.kv"))) <= 3
    finally:
        engine.close()
    assert got == _reference() * 2


_SAVER = textwrap.dedent("""
    import os, sys
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams
    cfg = EngineConfig(model="builtin:tiny-llama", dtype="float32", num_blocks=24, block_size=16, max_model_len=256,
                       num_threads=1, kv_offload_bytes=64 << 20, kv_offload_path=sys.argv[1])
    engine = Engine(cfg, "colocated")
    prompts = [[1] + [(37 * i + 11 * j) % 8000 + 4 for j in range(150)] for i in range(6)]
    for i, p in enumerate(prompts):  # each prompt evicts the one before: all but the last go to the tier
        engine.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        while engine.has_work():
            engine.step()
    print(engine.tier_stats().saves, flush=True)
    sys.stdin.read()  # hold the tier until killed
""")


def test_an_engine_that_dies_holding_tier_blocks_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    tier = tmp_path / f"{DIR_PREFIX}shared"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    saver = subprocess.Popen([sys.executable, "-c", _SAVER, str(tier)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        saves = int(saver.stdout.readline())
    finally:
        saver.send_signal(signal.SIGKILL)
        saver.wait(timeout=30)
    assert saves >= 3 * 9  # the 9 full blocks of each of the first three prompts at least
    assert any(u.name.startswith(f"{saver.pid}-") for u in (tier / "users").iterdir())  # it died without leaving
    engine = Engine(_cfg(tier), "colocated")
    try:
        got = []
        for i, p in enumerate(PROMPTS[:5]):
            seq = engine.add_request(str(i), p, PARAMS)
            while engine.has_work():
                engine.step()
            got.append(seq.token_ids[len(p):])
        assert engine.tier_stats().hits >= 3 * 9, engine.tier_stats()  # the dead engine's blocks came back
    finally:
        engine.close()
    assert got == _reference()[:5]
    assert not tier.exists()  # the dead engine's entry did not keep the directory alive


def test_a_prefill_worker_reads_another_nodes_tier_over_grpc(tmp_path: Path) -> None:
    """Node B: prefill-0 and the decode worker share tier B; node C: prefill-1 with tier C. Once
    prefill-0 is gone, prompts whose blocks only node B's tier holds go to prefill-1, which reads
    them from the decode worker's tier (the router names it) instead of computing them."""
    node_b, node_c = tmp_path / f"{DIR_PREFIX}node-b", tmp_path / f"{DIR_PREFIX}node-c"
    want = _reference()
    with LocalCluster(_cfg(node_b), 2, 1, prefill_engine=[_cfg(node_b), _cfg(node_c)], decode_engine=_cfg(node_b),
                      router={"request_timeout_s": 60, "max_retries": 3}) as c, c.client() as client:
        first = [client.complete(p, PARAMS).token_ids for p in PROMPTS]
        c.prefill_workers[0].stop()
        pool = c.router.pool
        for w in pool.workers():
            pool.check(w)  # the router sees prefill-0 gone now (its poll would within a second)
        node_c_fetcher = c.prefill_workers[1].tier_fetcher
        again = [client.complete(p, PARAMS).token_ids for p in PROMPTS]
        fetched = node_c_fetcher.blocks_fetched
        c_hits = c.prefill_workers[1].stats().tier_hits
    assert first == want and again == want
    assert fetched >= 9  # a prompt's full blocks, at least, came from node B's tier
    assert c_hits >= fetched  # and were read back from node C's tier into the engine
