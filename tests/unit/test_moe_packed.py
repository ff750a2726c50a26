"""bfloat16 routed experts on CPU tiles (engine/csrc/moe_experts_bf16.c, engine/models/moe_packed.py):
the tile layout, the kernel against float32 arithmetic (no further from it than torch's own
bfloat16 path), its portable C path everywhere and its AMX path where the CPU has one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.models.moe import Experts, dispatch
from engine.models.moe_packed import DEPTH, TILE, pack, packable
from engine.native import native_lib

LIB = native_lib()
AMX = bool(LIB is not None and LIB.pd_amx_ready())
PATHS = [False] + ([True] if AMX else [])
needs_lib = pytest.mark.skipif(LIB is None, reason="the native kernels did not build (no C compiler)")


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack`: (E, N, K)."""
    E, nb, kb = packed.shape[:3]
    return packed.permute(0, 1, 4, 2, 3, 5).reshape(E, nb * TILE, kb * DEPTH)


def test_the_tile_layout_is_a_permutation_of_the_weight():
    w = torch.arange(2 * 32 * 64, dtype=torch.float32).reshape(2, 32, 64)
    p = pack(w)
    assert p.shape == (2, 2, 2, 16, 16, 2)
    # element [e, nb, kb, kk, n, j] is W[e, 16 nb + n, 32 kb + 2 kk + j]
    assert p[1, 1, 0, 3, 5, 1] == w[1, 16 + 5, 2 * 3 + 1]
    assert p[0, 0, 1, 15, 0, 0] == w[0, 0, 32 + 30]
    assert torch.equal(_unpack(p), w)
    assert packable(640, 256) and not packable(640, 48) and not packable(100, 64)


def _experts(E: int, H: int, inter: int, seed: int) -> Experts:
    g = torch.Generator().manual_seed(seed)
    experts = Experts(E, H, inter)
    experts.gate_up_proj.data = (torch.randn(E, 2 * inter, H, generator=g) * 0.1).bfloat16()
    experts.down_proj.data = (torch.randn(E, H, inter, generator=g) * 0.1).bfloat16()
    return experts


def _float_reference(experts: Experts, x, ids, weights, E, held=None):
    gu, dn, inter = experts.gate_up_proj.float(), experts.down_proj.float(), experts.inter

    def run(e, rows):
        gate, up = F.linear(rows, gu[e]).split([inter, inter], dim=-1)
        return F.linear(F.silu(gate) * up, dn[e])
    return dispatch(x.float(), ids, weights, E, run, held)


@needs_lib
@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("E, H, inter, k", [(8, 64, 32, 2), (16, 96, 64, 4)])
def test_the_kernel_is_as_close_to_float32_as_torch_bfloat16_is(amx, E, H, inter, k):
    """1 to 70 tokens: one partial 16-row block, several, and experts with none; each expert no
    token chose has NaN weights, so a read of one would show."""
    torch_bf16 = _experts(E, H, inter, seed=E + H)
    g = torch.Generator().manual_seed(1)
    for tokens in (1, 3, 17, 70):
        x = torch.randn(tokens, H, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k, generator=g)
        want = _float_reference(torch_bf16, x, ids, weights, E)
        torch_err = (torch_bf16(x, ids, weights, E).float() - want).abs().max()
        unchosen = sorted(set(range(E)) - set(ids.flatten().tolist()))
        packed = Experts(E, H, inter)
        packed.gate_up_proj.data = torch_bf16.gate_up_proj.data.clone()
        packed.down_proj.data = torch_bf16.down_proj.data.clone()
        packed.gate_up_proj.data[unchosen] = float("nan")
        packed.down_proj.data[unchosen] = float("nan")
        packed.pack(LIB, amx=amx)
        got = packed(x, ids, weights, E)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert torch.isfinite(got).all(), f"{tokens} tokens: an unchosen expert was read"
        err = (got.float() - want).abs().max()
        assert err <= max(1.5 * torch_err, 1e-2 * want.abs().max()), (tokens, err, torch_err)


@needs_lib
@pytest.mark.parametrize("amx", PATHS)
def test_skewed_routing_gives_the_same_bits_on_any_number_of_threads(amx):
    """A prefill's router sends some experts many tokens and others none: the threads' shares are
    split by rows, so 1, 2 and 3 threads divide the work differently; the sums must not change."""
    E, H, inter, k, tokens = 8, 64, 64, 2, 150
    experts = _experts(E, H, inter, seed=5)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    bias = torch.tensor([3.0, 2.0, 0.0, 0.0, -1.0, -1.0, -9.0, -9.0])  # experts 6 and 7: (nearly) never
    ids = (torch.randn(tokens, E, generator=g) + bias).topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, generator=g)
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert counts.max() > 64 and counts.min() < 16  # several 32-row blocks, and a partial one or none
    want = _float_reference(experts, x, ids, weights, E)
    experts.pack(LIB, amx=amx)
    before = torch.get_num_threads()
    try:
        got = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got.append(experts(x, ids, weights, E))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    assert (got[0].float() - want).abs().max() <= 2e-2 * want.abs().max()


@needs_lib
@pytest.mark.parametrize("amx", PATHS)
def test_the_kernel_runs_only_the_experts_a_rank_holds(amx):
    """Expert parallelism: a rank holding experts [E/2, E) sums only their pairs."""
    E, H, inter = 8, 64, 32
    whole = _experts(E, H, inter, seed=3)
    held = range(E // 2, E)
    half = Experts(len(held), H, inter)
    half.gate_up_proj.data = whole.gate_up_proj.data[held.start:].clone()
    half.down_proj.data = whole.down_proj.data[held.start:].clone()
    x, ids, weights = _routing(E, H)
    want = _float_reference(half, x, ids, weights, E, held)
    half.pack(LIB, amx=amx)
    got = half(x, ids, weights, E, held)
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()
    assert not torch.allclose(got.float(), _float_reference(whole, x, ids, weights, E), atol=1e-2)


def _routing(E: int, H: int, tokens: int = 9, k: int = 2):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, k, generator=g)


@needs_lib
def test_shapes_the_layout_cannot_hold_are_refused():
    experts = _experts(4, 64, 32, seed=0)
    experts.pack(LIB, amx=False)
    experts.packed.H = 48  # as if the hidden size were not a multiple of 32
    with pytest.raises(RuntimeError, match="refused"):
        experts.packed(*_routing(4, 64))


@pytest.mark.skipif(not AMX, reason="no AMX tiles on this CPU")
@pytest.mark.parametrize("name", ["qwen3-moe", "deepseek-v3"])
def test_a_bfloat16_model_loads_its_experts_packed_on_amx(checkpoint, name):
    """The loader packs every routed layer's experts for the tiles; the layer then computes what
    the torch path on the same weights does, to bfloat16's precision."""
    from engine.builtin_model import resolve_model_path
    from engine.loader import load_model

    cfg = ModelConfig.from_pretrained(resolve_model_path(str(checkpoint(name))))
    packed = load_model(cfg, torch.bfloat16, torch.device("cpu"), 128)
    plain = load_model(cfg, torch.bfloat16, torch.device("cpu"), 128, pack=False)
    routed = [(a.mlp, b.mlp) for a, b in zip(packed.layers, plain.layers) if hasattr(a.mlp, "experts")]
    assert routed and all(a.experts.packed is not None and a.experts.gate_up_proj is None for a, _ in routed)
    x = torch.randn(12, cfg.hidden_size).bfloat16()
    with torch.no_grad():
        for a, b in routed:  # one routing for both (the native router's own test: test_token_ops.py)
            ids, weights = b.gate(x)
            want = _float_reference(b.experts, x, ids, weights, cfg.num_experts)
            got = a.experts(x, ids, weights, cfg.num_experts)
            assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()
