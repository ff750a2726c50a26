"""When a disaggregated request's prompt is prefilled on its decode worker instead of a prefill worker.

On one node the phases share the cores: a fixed prefill/decode split leaves the decode core
underused for compute while prompts queue at the prefill worker. A short prompt that would wait
behind more queued prompt tokens at the prefill workers than it adds locally is prefilled on the
decode worker, in its mixed steps (decode rows first, the prompt's chunks in the step's token
budget), and no KV moves. With the prefill workers idle, every prompt goes to them, so TPOT is
untouched at low load; as their queue grows, the decode worker takes the short prompts.

The cost is counted in prompt tokens queued (the router's own accounting, no RPC):

    local  iff  prompt <= max_tokens  and  local_queued + prompt <= prefill_queued

`prompt`: the prompt tokens the decode worker would compute, those its prefix cache is not expected
to hold (an earlier turn of the conversation: router.prefix_aware); the whole prompt otherwise.
`prefill_queued`: prompt tokens the router has on the least-loaded prefill worker (the one in
compute included); `local_queued`: prompt tokens it has sent to the decode worker to compute locally
and not yet seen a first token of. `max_tokens` = 0 turns it off (always remote).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalPrefillPolicy:
    max_tokens: int = 0  # longest prompt prefilled on a decode worker; 0: never

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"local prefill max_tokens must be >= 0, got {self.max_tokens}")

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def local(self, prompt_tokens: int, prefill_queued: int | None, local_queued: int) -> bool:
        """Prefill this prompt on its decode worker? `prefill_queued` None: no prefill worker is
        healthy (then local, when short enough, rather than failing the attempt)."""
        if not self.enabled or prompt_tokens > self.max_tokens:
            return False
        if prefill_queued is None:
            return True
        return local_queued + prompt_tokens <= prefill_queued
