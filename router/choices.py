"""Several choices of one `Generate` call (SamplingParams.n / best_of): each runs as a router
request of its own, and their messages merge into the call's one stream.

Choice k is the request with n = 1 and seed + k (SamplingParams.choice_params), "<id>#<k>" on the
workers. Choice 0 leads: the others start once it has its first token, so its prompt's KV is in the
prefix caches by then (its prefill worker's, and its decode worker's, which the router prefers for
the others as it holds the longest prefix: the full blocks are shared there, and only the prompt's
last, partial block is computed and moved again per choice). SGLang serves n > 1 the same way (a
request that caches the prefix, then the n). Each choice fails over on its own
(router/orchestrator.py); a choice that fails the request fails the call, and the caller aborts the
others.

Messages carry their choice's `index` and interleave. Only choice 0 computes the prompt's logprobs;
the others' first messages carry a copy. best_of > n: every choice is held until all have
finished, then the n of highest cumulative logprob (the sum of the sampled tokens' logprobs) are
sent, renumbered 0.. in that order. The call's last message carries `usage.total_completion_tokens`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from proto import generate_pb2 as gen
from router.orchestrator import RequestError

ChoiceRun = Callable[[int], Iterator[gen.GenerateResponse]]  # choice k's messages; raises RequestError


class ChoiceMerge:
    def __init__(self, count: int, n: int, run: ChoiceRun, deadline: float, hide_logprobs: bool) -> None:
        """`count` choices (best_of) of which `n` are sent; `run(k)` produces choice k's messages;
        `hide_logprobs`: logprobs were computed only to rank best_of's choices."""
        self.count, self.n, self.run, self.deadline, self.hide_logprobs = count, n, run, deadline, hide_logprobs
        self._queue: queue.Queue = queue.Queue()
        self._lead = threading.Event()  # choice 0 has its first token (or has ended)

    def _pump(self, k: int) -> None:
        """Choice k's messages onto the queue, then exactly one terminal item (None or the error)."""
        try:
            if k and not self._lead.wait(max(0.0, self.deadline - time.monotonic())):
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request reached its deadline before "
                                                                      "its first choice had a token")
            for msg in self.run(k):
                msg.index = k
                self._queue.put((k, msg, None))
                if k == 0:
                    self._lead.set()
            self._queue.put((k, None, None))
        except BaseException as e:  # noqa: BLE001 (the reader raises it)
            self._queue.put((k, None, e))
        finally:
            if k == 0:
                self._lead.set()

    def messages(self) -> Iterator[gen.GenerateResponse]:
        """Every choice's messages (best_of > n: the n best, at the end); raises the first error."""
        for k in range(self.count):
            threading.Thread(target=self._pump, args=(k,), name=f"choice-{k}", daemon=True).start()
        held: list[list[gen.GenerateResponse]] = [[] for _ in range(self.count)]
        ranked = self.count > self.n
        prompt_logprobs: list[gen.TokenLogprob] = []
        started: set[int] = set()
        running, finished, total = self.count, 0, 0
        while running:
            try:
                k, msg, error = self._queue.get(timeout=max(1.0, self.deadline - time.monotonic() + 5.0))
            except queue.Empty:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's choices exceeded its deadline") \
                    from None
            if error is not None:
                raise error
            if msg is None:
                running -= 1
                continue
            if k not in started:
                started.add(k)
                if k == 0:
                    prompt_logprobs = list(msg.prompt_logprobs)
                else:  # choice 0's first message came first (the others start after it)
                    msg.prompt_logprobs.extend(prompt_logprobs)
            if msg.finish_reason:
                finished += 1
                total += msg.usage.completion_tokens
                if finished == self.count and not ranked:  # the call's last message
                    msg.usage.total_completion_tokens = total
            if ranked:
                held[k].append(msg)
            else:
                yield msg
        if ranked:
            yield from self._best(held, total)

    def _best(self, held: list[list[gen.GenerateResponse]], total: int) -> Iterator[gen.GenerateResponse]:
        cumulative = [sum(lp.logprob for m in msgs for lp in m.logprobs) for msgs in held]
        best = sorted(range(self.count), key=lambda k: (-cumulative[k], k))[: self.n]
        for j, k in enumerate(best):
            for m in held[k]:
                m.index = j
                if self.hide_logprobs:
                    del m.logprobs[:]
        held[best[-1]][-1].usage.total_completion_tokens = total
        for k in best:
            yield from held[k]
