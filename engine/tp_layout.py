"""Which part of the model one tensor-parallel rank holds (Megatron-style), and the slice of each
checkpoint tensor that is its share. Pure arithmetic: no torch, no processes.

With N ranks, rank r holds:
- attention: query heads [r*H/N, (r+1)*H/N) (H % N == 0). KV heads: when N divides them, the rank's
  K/N of them; when there are fewer KV heads than ranks (K divides N), the one KV head its query
  heads read, replicated on the N/K ranks that share it (MQA, and GQA with K < N). `qkv_proj` is
  column-parallel (the rank's rows of q, k and v), `o_proj` row-parallel (the columns of its query
  heads): each rank's output is a partial sum, and one all-reduce adds them.
- MLP: `gate_up_proj` column-parallel (rows [r*I/N, (r+1)*I/N) of gate and of up), `down_proj`
  row-parallel (those columns), then one all-reduce. Routed experts (engine/models/moe.py) alike,
  each expert split by its own intermediate size; the router is replicated.
- with `expert_parallel` (a mixture-of-experts model): the routed experts are not split but placed,
  whole, E/N per rank: rank r holds experts [r*E/N, (r+1)*E/N) (E % N == 0). Attention, the dense
  MLPs and DeepSeek's shared experts stay tensor-parallel as above. The MoE layer's output is then
  each rank's experts' weighted sum (plus its share of the shared experts), and the same one
  all-reduce adds the ranks' partial sums.
- everything else whole (replicated): the embedding (a lookup: nothing to split in compute, and a
  vocab-parallel one would add an all-reduce per step), the norms, and the LM head, which only
  rank 0 runs (it samples): sharding it would save memory on the other ranks but add a gather of
  the logits to every step. On an accelerator where the vocabulary matrix is large against the
  device, sharding it is the next step.
- the paged KV cache of its KV heads, with the same block ids on every rank (rank 0's block manager).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """(the model's index of the first KV head rank `rank` of `size` holds, how many): split when
    `size` divides the KV heads, else the one head its query heads read (replicated)."""
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {num_kv_heads} KV heads, or be "
                         "a multiple of them (the KV heads are then replicated)")
    if num_kv_heads < size:
        return rank // (size // num_kv_heads), 1
    per = num_kv_heads // size
    return rank * per, per


@dataclass(frozen=True)
class TPLayout:
    rank: int
    size: int
    num_heads: int  # the model's
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int = 0  # each routed expert's (0: a dense model)
    shared_intermediate_size: int = 0  # DeepSeek's shared experts, as one MLP
    # multi-head latent attention (0: none): each head's query width and its (key, value) widths in kv_b_proj
    qk_head_dim: int = 0
    kv_b_head_dim: int = 0
    v_head_dim: int = 0
    # expert parallelism: the routed experts whole, `num_experts` / size of them on each rank
    num_experts: int = 0
    expert_parallel: bool = False
    # gpt-oss keeps its experts stacked as the checkpoint has them: gate_up_proj (E, H, 2I) with gate
    # and up interleaved along the last dim, down_proj (E, I, H), and their biases (E, 2I), (E, H)
    stacked_experts: bool = False

    def __post_init__(self) -> None:
        n = self.size
        if n < 1 or not 0 <= self.rank < n:
            raise ValueError(f"tensor parallel rank {self.rank} of {n} is not a rank of the group")
        if self.num_heads % n:
            raise ValueError(f"tensor_parallel_size {n} must divide the model's {self.num_heads} attention heads")
        if self.num_kv_heads % n and n % self.num_kv_heads:
            raise ValueError(f"tensor_parallel_size {n} must divide the model's {self.num_kv_heads} KV heads, or be "
                             "a multiple of them (the KV heads are then replicated)")
        if self.intermediate_size % n:
            raise ValueError(f"tensor_parallel_size {n} must divide the model's intermediate size "
                             f"{self.intermediate_size}")
        if self.shared_intermediate_size % n:
            raise ValueError(f"tensor_parallel_size {n} must divide the shared experts' intermediate size "
                             f"{self.shared_intermediate_size}")
        if self.expert_parallel:
            if not self.num_experts:
                raise ValueError("expert_parallel needs a mixture-of-experts model (this one has no routed experts)")
            if self.num_experts % n:
                raise ValueError(f"expert_parallel: tensor_parallel_size {n} must divide the model's "
                                 f"{self.num_experts} routed experts")
        elif self.moe_intermediate_size % n:
            raise ValueError(f"tensor_parallel_size {n} must divide the experts' intermediate size "
                             f"{self.moe_intermediate_size}")

    @property
    def heads(self) -> int:
        """Query heads on this rank."""
        return self.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank (1 when they are replicated)."""
        return kv_head_range(self.num_kv_heads, self.size, self.rank)[1]

    @property
    def kv_replicated(self) -> bool:
        return self.num_kv_heads < self.size

    @property
    def first_kv_head(self) -> int:
        """The model's index of this rank's first KV head."""
        return kv_head_range(self.num_kv_heads, self.size, self.rank)[0]

    @property
    def inter(self) -> int:
        """The MLP's intermediate rows on this rank."""
        return self.intermediate_size // self.size

    @property
    def moe_inter(self) -> int:
        """Each routed expert's intermediate rows on this rank (expert parallel: all of them)."""
        return self.moe_intermediate_size if self.expert_parallel else self.moe_intermediate_size // self.size

    @property
    def experts(self) -> range:
        """The model's indices of the routed experts this rank holds (all of them without expert parallelism)."""
        if not self.expert_parallel:
            return range(self.num_experts)
        per = self.num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def shard(self, target: str, fused_shard: int | None) -> tuple[int, int, int] | None:
        """The slice (dim, start, length) of the checkpoint tensor that loads into `target` (the
        engine's parameter name; `fused_shard`: 0/1/2 for q/k/v in qkv_proj, 0/1 for gate/up), or
        None when the rank takes it whole."""
        if self.size == 1:
            return None
        hd = self.head_dim
        if self.qk_head_dim and ".self_attn." in target:  # latent attention: split by query heads
            return self._latent_shard(target)
        if ".shared_experts." in target:
            inter = self.shared_intermediate_size // self.size
            if ".gate_up_proj." in target:
                return 0, self.rank * inter, inter
            return (1, self.rank * inter, inter) if target.endswith("weight") else None
        if ".self_attn.sinks" in target:  # gpt-oss: one logit per query head
            return 0, self.rank * self.heads, self.heads
        if self.stacked_experts and ".experts." in target:
            return self._stacked_shard(target)
        if self.expert_parallel and target.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return None  # whole experts (which ones: `experts`)
        if target.endswith(".experts.gate_up_proj"):  # one expert's gate or up (the fused shard)
            return 0, self.rank * self.moe_inter, self.moe_inter
        if target.endswith(".experts.down_proj"):
            return 1, self.rank * self.moe_inter, self.moe_inter
        if ".qkv_proj." in target:
            if fused_shard == 0:
                return 0, self.rank * self.heads * hd, self.heads * hd
            return 0, self.first_kv_head * hd, self.kv_heads * hd
        if ".o_proj." in target:
            return (1, self.rank * self.heads * hd, self.heads * hd) if target.endswith("weight") else None
        if ".gate_up_proj." in target:
            return 0, self.rank * self.inter, self.inter
        if ".down_proj." in target:
            return (1, self.rank * self.inter, self.inter) if target.endswith("weight") else None
        return None

    def _stacked_shard(self, target: str) -> tuple[int, int, int] | None:
        """gpt-oss's stacked experts: expert parallel, the rank's experts (rows of dim 0) of every
        tensor; else each expert's intermediate slice: gate/up pairs [2 r I/N, 2 (r+1) I/N) of the
        last dim (gate and up interleaved, so a pair stays together), down_proj's rows of it; the
        down bias whole (`zeroed`: rank 0 adds it)."""
        if self.expert_parallel:
            return 0, self.experts.start, len(self.experts)
        i = self.moe_inter
        if target.endswith(".gate_up_proj"):
            return 2, 2 * self.rank * i, 2 * i
        if target.endswith(".gate_up_proj_bias"):
            return 1, 2 * self.rank * i, 2 * i
        if target.endswith(".down_proj"):
            return 1, self.rank * i, i
        return None

    def zeroed(self, target: str) -> bool:
        """Whether this rank loads zeros for `target`: the bias of a row-parallel layer (o_proj, an
        MLP's down_proj, a sharded stacked expert's down_proj_bias) is added by rank 0 alone, so the
        all-reduce that sums the ranks' partial outputs counts it once."""
        if self.size == 1 or self.rank == 0:
            return False
        if target.endswith(".experts.down_proj_bias"):  # gpt-oss: whole experts under EP keep theirs
            return not self.expert_parallel
        return target.endswith((".o_proj.bias", ".down_proj.bias"))

    def _latent_shard(self, target: str) -> tuple[int, int, int] | None:
        """Latent attention: the query projection and kv_b_proj by the rank's heads (rows), o_proj by
        their values (columns); the latent's own projection and norms whole (every rank keeps the
        whole latent)."""
        h = self.heads
        if ".q_proj." in target or ".q_b_proj." in target:
            return 0, self.rank * h * self.qk_head_dim, h * self.qk_head_dim
        if ".kv_b_proj." in target:
            return 0, self.rank * h * self.kv_b_head_dim, h * self.kv_b_head_dim
        if ".o_proj." in target:
            return (1, self.rank * h * self.v_head_dim, h * self.v_head_dim) if target.endswith("weight") else None
        return None

    def of_rank(self, rank: int) -> TPLayout:
        """Another rank's layout in the same group."""
        return dataclasses.replace(self, rank=rank)

    def assembly(self) -> list[tuple[int, int]]:
        """How the model's KV heads are put together from the ranks' caches: (rank, its KV heads to
        take), in head order; a replicated head is taken from the first rank that holds it."""
        plan, covered = [], 0
        for r in range(self.size):
            other = self.of_rank(r)
            if other.first_kv_head == covered:
                plan.append((r, other.kv_heads))
                covered += other.kv_heads
        return plan

    def describe(self) -> str:
        """The layout in a few words (compatibility hashes, logs, `pdcluster status`)."""
        kv = f"{self.kv_heads} KV head{'s' if self.kv_heads > 1 else ''} from {self.first_kv_head}"
        ep = f", ep: experts {self.experts.start}-{self.experts.stop - 1} whole" if self.expert_parallel else ""
        return (f"tp {self.rank}/{self.size}: heads {self.rank * self.heads}-{(self.rank + 1) * self.heads - 1}, {kv}"
                f"{' (replicated)' if self.kv_replicated else ''}{ep}")
