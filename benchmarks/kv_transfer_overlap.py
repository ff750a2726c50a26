"""How much of the KV transfer hides behind the prefill forward pass: one prompt's TTFT with the
layers streamed from the layer hook, with each layer acknowledged before the pass goes on, and with
no transfer at all, in interleaved rounds."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from statistics import median

import torch

from benchmarks.kv_transfer_layouts import BLOCK_SIZE, LAYOUTS, Layout


def overlap(tokens: int, repeats: int, backend: str = "grpc") -> dict:
    from decode_worker import DecodeEngine
    from engine import Engine, EngineConfig, SamplingParams
    from kv_transfer import KVSender, create_sender
    from prefill_worker.prefill_engine import PrefillEngine

    class NullSender(KVSender):
        def send_layer(self, ticket, layer, kv):
            pass

        def commit(self, ticket, first_token, logprob):
            pass

        def abort(self, ticket, reason):
            pass

    class SyncSender(KVSender):
        """The backend's sender, but each layer is acknowledged before the forward pass goes on."""

        def __init__(self, inner) -> None:
            super().__init__(inner.compat_hash)
            self.inner = inner

        def send_layer(self, ticket, layer, kv):
            self.inner.send_layer(ticket, layer, kv)
            self.inner.flush(ticket)

        def commit(self, ticket, first_token, logprob):
            self.inner.commit(ticket, first_token, logprob)

        def abort(self, ticket, reason):
            self.inner.abort(ticket, reason)

    blocks = -(-tokens // BLOCK_SIZE) + 2
    cfg = EngineConfig(model="builtin:tiny-llama", device="cpu", num_blocks=blocks, max_model_len=tokens + BLOCK_SIZE,
                       max_num_batched_tokens=max(2048, tokens), enable_prefix_caching=False)
    decode = DecodeEngine(Engine(cfg, "decode"), backend=backend)
    pre_engine = Engine(cfg, "prefill")
    inner = create_sender(backend, decode.compat_hash, timeout_s=120.0)
    senders = {"normal": inner, "sync": SyncSender(inner),
               "compute": NullSender(decode.compat_hash)}
    g = torch.Generator().manual_seed(0)
    vocab = pre_engine.model_cfg.vocab_size
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {k: [] for k in senders}
    commit_ms: dict[str, list[float]] = {k: [] for k in senders}
    try:
        for rep in range(repeats + 1):  # the first round is a warm-up
            for mode, sender in senders.items():
                prefill = PrefillEngine(pre_engine, sender)
                prompt = torch.randint(4, vocab, (tokens,), generator=g).tolist()
                rid = uuid.uuid4().hex
                ticket = decode.reserve(rid, prompt, params)
                prefill.add(rid, prompt, params, ticket)
                start = time.perf_counter()
                results = []
                while prefill.has_work():
                    results.extend(prefill.step())
                elapsed = time.perf_counter() - start
                if len(results) != 1 or results[0].error:
                    raise RuntimeError(f"overlap {mode}: {results}")
                decode.abort_request(rid)
                if rep:
                    times[mode].append(elapsed)
                    commit_ms[mode].append(results[0].commit_ms)
    finally:
        inner.close()
        decode.close()
    def hidden(stat: Callable[[list[float]], float]) -> float | None:
        a, b, c = (stat(times[k]) for k in ("normal", "sync", "compute"))
        return 1 - (a - c) / (b - c) if b > c else None

    # paired by round (a round runs a, b, c back to back): drift of the machine between rounds cancels
    da = [x - z for x, z in zip(times["normal"], times["compute"])]
    db = [y - z for y, z in zip(times["sync"], times["compute"])]
    paired = 1 - median(da) / median(db) if median(db) > 0 else None
    lay = Layout("builtin", *LAYOUTS["builtin"])
    return {
        "tokens": tokens, "bytes": lay.nbytes(tokens), "repeats": repeats, "backend": backend,
        "ttft_s": {k: median(v) for k, v in times.items()},
        "ttft_min_s": {k: min(v) for k, v in times.items()}, "ttft_all_s": times,
        "commit_ms": {k: median(v) for k, v in commit_ms.items()},
        "hidden_fraction": hidden(median), "hidden_fraction_min": hidden(min), "hidden_fraction_paired": paired,
    }
