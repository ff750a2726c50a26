"""Starting the ranks of a tensor-parallel engine: rank 0's side (`lead`, `handshake`), the other
ranks' main (`run_follower`), and `LocalRanks`, which runs them as child processes of rank 0's
process (the engine starts them so, in a worker as offline).

Rank 0 hosts the rendezvous; each other rank connects (its control channel, then the process
group), receives the number of KV blocks rank 0 sized, loads its shard, allocates its cache, says
READY, and follows rank 0's steps until it stops. A rank that fails to join in time fails the start.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
from collections.abc import Callable

import torch

from engine.config import EngineConfig, ModelConfig
from engine.tp_group import Leader, Rendezvous, TPError, follow
from engine.tp_layout import TPLayout
from engine.tp_steps import INIT, READY, STOP, RankKV, TPContext, follow_steps

log = logging.getLogger("pdcluster.engine")


def layout_for(model_cfg: ModelConfig, rank: int, size: int, expert_parallel: bool = False) -> TPLayout:
    """Rank `rank` of `size`'s layout of the model; ValueError when the model cannot be split so."""
    m = model_cfg
    check_expert_parallel(m, expert_parallel)
    latent = dict(qk_head_dim=m.qk_nope_head_dim + m.qk_rope_head_dim, kv_b_head_dim=m.qk_nope_head_dim + m.v_head_dim,
                  v_head_dim=m.v_head_dim) if m.kv_lora_rank else {}
    return TPLayout(rank, size, m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size, m.moe_intermediate_size,
                    m.shared_intermediate_size, **latent, num_experts=m.num_experts,
                    expert_parallel=expert_parallel and size > 1, stacked_experts=m.router == "gpt_oss")


def check_expert_parallel(model_cfg: ModelConfig, expert_parallel: bool) -> None:
    """`expert_parallel` needs routed experts (at any size: the flag on a dense model is a mistake);
    with one rank it changes nothing (that rank holds every expert whole either way)."""
    if not expert_parallel:
        return
    if not model_cfg.num_experts:
        raise ValueError(f"expert_parallel needs a mixture-of-experts model; {model_cfg.architecture} "
                         f"({model_cfg.path}) has no routed experts")


def lead(model_cfg: ModelConfig, leader: Leader, backend: str, join_timeout_s: float,
         check: Callable[[], None] | None = None, expert_parallel: bool = False) -> TPContext:
    """Rank 0's context once every other rank has joined the group (they connect to `leader.rendezvous`);
    `check` raises when one of them is known to have failed."""
    group = leader.join(backend, join_timeout_s, check)
    return TPContext(layout_for(model_cfg, 0, leader.size, expert_parallel), group, leader=leader,
                     join_timeout_s=join_timeout_s)


def handshake(ctx: TPContext, num_blocks: int) -> None:
    """Rank 0, once its cache is sized: tell the others, and wait until each has loaded its shard."""
    ctx.leader.send(torch.tensor([INIT, num_blocks]))
    for ch in ctx.leader.channels:
        ch.sock.settimeout(ctx.join_timeout_s)
        try:
            msg = ch.recv()
        finally:
            ch.sock.settimeout(ctx.group.timeout_s)  # from now on a stuck rank fails rank 0's sends and calls
        if msg is None or int(msg[0]) != READY:
            raise TPError("a tensor-parallel rank failed while loading its shard of the model")
        ctx.rank_info.append(msg[1:].tolist())


def run_follower(cfg: EngineConfig, rank: int, size: int, rendezvous: Rendezvous, backend: str = "gloo",
                 timeout_s: float = 60.0, rank_kv: RankKV | None = None) -> None:
    """Rank `rank` > 0: join, load the shard, start `rank_kv` (its KV sender or receiver), follow
    rank 0's steps until it stops (returns then)."""
    from engine.builtin_model import resolve_model_path
    from engine.model_runner import ModelRunner

    channel, group = follow(rendezvous, rank, size, backend, timeout_s)
    try:
        init = channel.recv()
        if init is None or int(init[0]) != INIT:
            return  # rank 0 went away before the start
        model_cfg = ModelConfig.from_pretrained(resolve_model_path(cfg.model))
        ctx = TPContext(layout_for(model_cfg, rank, size, cfg.expert_parallel), group)
        runner = ModelRunner(model_cfg, dataclasses.replace(cfg, num_blocks=int(init[1])), tp=ctx)
        info = rank_kv.start(runner) if rank_kv is not None else []
        channel.send(torch.tensor([READY, *info], dtype=torch.int64))
        follow_steps(runner, channel, rank_kv)
    finally:
        if rank_kv is not None:
            rank_kv.close()
        channel.close()
        group.close()


def _child(cfg: EngineConfig, rank: int, size: int, rendezvous: Rendezvous, backend: str, timeout_s: float,
           rank_kv: RankKV | None) -> None:
    try:
        run_follower(cfg, rank, size, rendezvous, backend, timeout_s, rank_kv)
    except Exception:  # noqa: BLE001 (rank 0 sees the group fail; say why here)
        log.exception("tensor-parallel rank %d failed", rank)
        raise


class LocalRanks:
    """Ranks 1.. of a tensor-parallel engine as child processes of this one (rank 0)."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, size: int, backend: str = "gloo",
                 timeout_s: float = 60.0, join_timeout_s: float = 300.0, rank_kv: RankKV | None = None) -> None:
        # refuse a size the model cannot be split by, before any process starts
        layout_for(model_cfg, 0, size, cfg.expert_parallel)
        self.leader = Leader(size, timeout_s=timeout_s)
        # a fork server that imported torch and the engine once starts each rank in a fraction of a
        # fresh interpreter's time; it never touches CUDA, so its children may (unlike plain fork)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["engine.tp_ranks", "engine.model_runner"])
        self.processes = [ctx.Process(target=_child, args=(cfg, r, size, self.leader.rendezvous, backend, timeout_s, rank_kv),
                                      name=f"tp-rank-{r}", daemon=True) for r in range(1, size)]
        for p in self.processes:
            p.start()
        try:
            self.context = lead(model_cfg, self.leader, backend, join_timeout_s, self._check, cfg.expert_parallel)
        except BaseException:
            self.close()
            raise

    def exited(self) -> list[tuple[int, int]]:
        """(rank, exit code) of the ranks whose process has ended."""
        return [(r, p.exitcode) for r, p in enumerate(self.processes, 1) if p.exitcode is not None]

    def _check(self) -> None:
        for r, code in self.exited():
            raise TPError(f"tensor-parallel rank {r} exited (code {code}) before it joined; its log says why")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the other ranks (STOP, then the channel's end; a rank still alive after `timeout_s` is
        killed; 0: killed at once, no STOP sent)."""
        if timeout_s > 0:
            try:
                self.leader.send(torch.tensor([STOP]))
            except TPError:
                pass
        self.leader.close()
        for p in self.processes:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join(1.0)


def threads_per_rank(size: int, num_threads: int | None) -> int:
    """Each rank's CPU threads: the ones asked for, else this machine's cores shared by the ranks."""
    return num_threads or max(1, (os.cpu_count() or 1) // size)
