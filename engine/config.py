"""Engine configuration and the model shape read from a checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.kv_spec import KV_CACHE_DTYPES, KV_LAYOUT_VERSION, KVSpec  # noqa: F401  (the layout version: re-exported)

if TYPE_CHECKING:  # torch is imported where a dtype or device is made, not when this module is
    import torch

    from engine.quantized_weights import Quantization

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)

DTYPE_NAMES = ("float32", "bfloat16", "float16")


AUTO_DTYPE = "auto"  # the checkpoint's own dtype (config.json `dtype` / `torch_dtype`), float32 if it names none


def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in DTYPE_NAMES}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if not isinstance(dtype, str):
        if dtype not in _torch_dtypes().values():
            raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype}")
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)} or {AUTO_DTYPE!r}, got {dtype!r}")
    return _torch_dtypes()[dtype]


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU does `dtype` matrix math in hardware (oneDNN's own test)."""
    import torch

    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def checkpoint_dtype(hf_config: Any) -> torch.dtype:
    """The dtype a checkpoint's config names (float32 when it names none or one not served here)."""
    import torch

    dtypes = _torch_dtypes()
    named = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(named, str):
        named = dtypes.get(named.removeprefix("torch."))
    return named if named in dtypes.values() else torch.float32


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a checkpoint, taken from its Hugging Face config."""

    path: str
    architecture: str
    hf_config: Any  # transformers PretrainedConfig (rope parameters are read from it)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Qwen3)
    max_position_embeddings: int
    # each layer's sliding window (None: full attention): a query at position p attends to the keys
    # at p - window < k <= p, itself included (transformers' masking_utils.sliding_window_overlay)
    layer_windows: tuple[int | None, ...]
    eos_token_ids: frozenset[int]
    # mixture of experts (engine/models/moe.py): no experts, a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's
    norm_topk_prob: bool = True  # the top-k routing weights are renormalised to sum to 1
    moe_layers: frozenset[int] = frozenset()  # the layers whose MLP is the experts
    # DeepSeek's routing (engine/models/moe.py): "softmax" (Mixtral, Qwen3-MoE), "deepseek_v2", "deepseek_v3"
    router: str = "softmax"
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # experts in groups; a token picks from its `topk_group` best groups only
    topk_group: int = 1
    topk_method: str = "greedy"  # DeepSeek-V2: "greedy" or "group_limited_greedy"
    shared_intermediate_size: int = 0  # the always-on shared experts, as one MLP of this width
    # multi-head latent attention (engine/models/mla.py): kv_lora_rank 0 is none
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: queries projected directly
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the RoPE dims are rotated as interleaved pairs
    # gpt-oss: a learned per-head logit joins each softmax (takes mass, adds no value), o_proj has a
    # bias, and the experts' SwiGLU is clamped at `swiglu_limit` with `swiglu_alpha`
    attention_sinks: bool = False
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # a quantized checkpoint's format (engine/quantized_weights.py), dequantized at load; None: plain
    quantization: Quantization | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        from transformers import AutoConfig

        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model path {str(path)!r} is not a Hugging Face checkpoint directory (no config.json)")
        raw = json.loads(config_file.read_text())
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r} in {path}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        quantization = None
        if "quantization_config" in raw:  # fp8 block scales, mxfp4 experts; any other method refused
            from engine.quantized_weights import read_quantization

            quantization = read_quantization(raw["quantization_config"], path)
        hf = AutoConfig.from_pretrained(path)
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope = _rope_parameters(hf)
        if rope.get("rope_type", "default") in ("dynamic", "longrope"):
            raise ValueError(
                f"rope type {rope['rope_type']!r} changes with sequence length and is not supported; "
                "supported: default, linear, llama3, yarn"
            )
        eos = hf.eos_token_id
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
        eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        return cls(
            path=str(path),
            architecture=arch,
            hf_config=hf,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            # latent attention: one latent shared by every head (engine/models/mla.py)
            num_kv_heads=1 if getattr(hf, "kv_lora_rank", None) else getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(getattr(hf, "attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            max_position_embeddings=hf.max_position_embeddings,
            layer_windows=read_layer_windows(arch, hf),
            eos_token_ids=eos_ids,
            **read_experts(arch, hf),
            **_latent_attention(arch, hf),
            quantization=quantization,
        )

    @property
    def kv_spec(self) -> KVSpec:
        """What each layer keeps per token (engine/kv_spec.py)."""
        windows = self.layer_windows if any(self.layer_windows) else ()
        if self.kv_lora_rank:
            return KVSpec(self.num_layers, 1, self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank, windows)
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, windows=windows)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.kv_spec.bytes_per_token(dtype)

    def compat_hash(self, dtype: torch.dtype, block_size: int, spec: KVSpec | None = None) -> str:
        """Two workers can exchange KV blocks only if this matches (model, dtype, block size, layout;
        `spec`: the cache's own, quantized pages included, default the model's)."""
        spec = self.kv_spec if spec is None else spec
        return spec.compat_key(dtype, block_size, [self.architecture, self.vocab_size, self.hidden_size])


def read_experts(arch: str, hf: Any) -> dict[str, Any]:
    """The ModelConfig fields of a mixture-of-experts checkpoint ({} for a dense one)."""
    if arch == "MixtralForCausalLM":  # every layer; the top-k weights always renormalised
        return dict(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.intermediate_size, norm_topk_prob=True,
                    moe_layers=frozenset(range(hf.num_hidden_layers)))
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):  # after the first dense layers
        v3 = arch == "DeepseekV3ForCausalLM"
        return dict(num_experts=hf.n_routed_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                    moe_layers=frozenset(range(hf.first_k_dense_replace, hf.num_hidden_layers)),
                    router="deepseek_v3" if v3 else "deepseek_v2",
                    routed_scaling_factor=float(hf.routed_scaling_factor), n_group=hf.n_group or 1,
                    topk_group=hf.topk_group or 1, topk_method=getattr(hf, "topk_method", "greedy") or "greedy",
                    shared_intermediate_size=hf.moe_intermediate_size * (hf.n_shared_experts or 0))
    if arch == "GptOssForCausalLM":  # every layer; top-k of the biased logits, then their softmax
        return dict(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.intermediate_size, moe_layers=frozenset(range(hf.num_hidden_layers)),
                    router="gpt_oss", attention_sinks=True, swiglu_alpha=float(hf.swiglu_alpha),
                    swiglu_limit=float(hf.swiglu_limit))
    if arch == "Qwen3MoeForCausalLM":  # every decoder_sparse_step-th layer, except mlp_only_layers
        step, dense = hf.decoder_sparse_step, set(hf.mlp_only_layers or ())
        layers = frozenset(i for i in range(hf.num_hidden_layers)
                           if hf.num_experts > 0 and i not in dense and (i + 1) % step == 0)
        return dict(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                    moe_layers=layers)
    return {}


WINDOW_LAYER_TYPES = ("sliding_attention", "full_attention")
# families whose every layer takes `sliding_window` (layer_types ignored), and those that need use_sliding_window
WINDOW_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
WINDOW_IF_USED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def read_layer_windows(arch: str, hf: Any) -> tuple[int | None, ...]:
    """Each layer's window as transformers' modeling code applies it: Llama has none; Mistral and
    Mixtral window every layer with `sliding_window`, Qwen3-MoE too given `use_sliding_window`; the
    others by `layer_types` (Qwen2/Qwen3 derive them from `use_sliding_window` and
    `max_window_layers`: the layers from that index on are windowed), so a family alternating
    windowed and full layers is read layer by layer."""
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if arch in WINDOW_IF_USED and not getattr(hf, "use_sliding_window", False):
        window = None
    if arch == "LlamaForCausalLM" or not window:
        return (None,) * n
    if arch in WINDOW_EVERY_LAYER:
        return (window,) * n
    types = getattr(hf, "layer_types", None)
    if types is None:  # configs older than layer_types
        first = getattr(hf, "max_window_layers", 0)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - set(WINDOW_LAYER_TYPES))
    if unknown or len(types) != n:
        raise ValueError(f"layer_types {list(types)!r}: served are {n} layers, each one of "
                         f"{' / '.join(WINDOW_LAYER_TYPES)}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _latent_attention(arch: str, hf: Any) -> dict[str, Any]:
    """The ModelConfig fields of multi-head latent attention ({} without it)."""
    if arch not in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return {}
    return dict(kv_lora_rank=hf.kv_lora_rank, q_lora_rank=hf.q_lora_rank or 0, qk_nope_head_dim=hf.qk_nope_head_dim,
                qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                # V2 rotates interleaved pairs always (as complex numbers), V3 when its config says so
                rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(getattr(hf, "rope_interleave", False)))


def _rope_parameters(hf: Any) -> dict:
    """rope settings across transformers versions (v5 `rope_parameters`, v4 `rope_scaling`)."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


@dataclass
class EngineConfig:
    """Knobs of one engine (one worker's model + KV cache + scheduler)."""

    model: str = "builtin:tiny-llama"
    dtype: str = AUTO_DTYPE  # or float32 / bfloat16 / float16
    device: str | None = None  # None: cuda if available, else cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 4096
    block_size: int = 16
    num_blocks: int | None = None  # None: from the memory budget below
    kv_cache_memory_bytes: int | None = None  # None: 512 MiB on CPU, 90% of free GPU memory on CUDA
    # "auto" (the model's dtype) or quantized pages: "int8", "fp8_e4m3", "fp8_e5m2" (engine/kv_quant.py)
    kv_cache_dtype: str = "auto"
    # an opt-in bound on each sequence's KV (approximate, as StreamingLLM): every layer attends to
    # the first kv_sink_tokens positions (rounded up to whole blocks) and the last kv_recent_tokens
    # (rounded out to whole blocks), and the blocks between are given back. None: off (exact)
    kv_sink_tokens: int = 0
    kv_recent_tokens: int | None = None
    # the KV offload tier (engine/kv_tier.py): blocks evicted from the prefix cache go to a directory
    # of this many bytes shared by the engines given the same kv_offload_path, and come back on a
    # prefix hit instead of being computed again. 0: off. Path None: a directory of this engine's own
    kv_offload_bytes: int = 0
    kv_offload_path: str | None = None
    max_num_batched_tokens: int = 2048  # token budget of one forward pass (long prompts are chunked)
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU
    enforce_eager: bool = False  # plain torch only: no native kernel (engine/native.py), no prepacked oneDNN weights
    # the model split over this many processes of one machine (engine/tp_layout.py); the engine's
    # process is rank 0 and starts the others (engine/tp_ranks.py)
    tensor_parallel_size: int = 1
    # a mixture-of-experts model's routed experts placed whole, E/N per rank, instead of each split N
    # ways (engine/tp_layout.py); attention and the dense and shared MLPs stay tensor-parallel. With
    # tensor_parallel_size 1 it changes nothing (one rank holds every expert whole either way)
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.dtype != AUTO_DTYPE:
            parse_dtype(self.dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.kv_sink_tokens, int) or self.kv_sink_tokens < 0:
            raise ValueError(f"kv_sink_tokens must be an integer >= 0, got {self.kv_sink_tokens!r}")
        if self.kv_recent_tokens is not None and (not isinstance(self.kv_recent_tokens, int)
                                                  or self.kv_recent_tokens < 1):
            raise ValueError(f"kv_recent_tokens must be an integer >= 1 or None (off), got {self.kv_recent_tokens!r}")
        if self.kv_sink_tokens and self.kv_recent_tokens is None:
            raise ValueError("kv_sink_tokens bounds a sequence's KV only with kv_recent_tokens set")
        if not isinstance(self.kv_offload_bytes, int) or self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be an integer >= 0 (0: no offload tier), got {self.kv_offload_bytes!r}")
        if self.kv_offload_bytes and not self.enable_prefix_caching:
            raise ValueError("the KV offload tier keeps blocks evicted from the prefix cache: it needs enable_prefix_caching")
        if self.kv_offload_bytes and self.tensor_parallel_size > 1:
            raise ValueError("the KV offload tier serves engines of one rank; tensor_parallel_size > 1 is not supported with it")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:  # a decode step is one token per sequence
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if not isinstance(self.expert_parallel, bool):
            raise ValueError(f"expert_parallel must be true or false, got {self.expert_parallel!r}")

    @property
    def kv_bound(self) -> tuple[int, int] | None:
        """(sink tokens rounded up to whole blocks, recent tokens), or None: every key kept."""
        if self.kv_recent_tokens is None:
            return None
        return -(-self.kv_sink_tokens // self.block_size) * self.block_size, self.kv_recent_tokens

    def torch_dtype(self, model_cfg: ModelConfig) -> torch.dtype:
        """The dtype weights and KV are held in. "auto": the checkpoint's, except float32 on a CPU
        without native 16-bit matrix math (no AVX-512 BF16 / AMX there: oneDNN falls back to
        emulation, measured 7x slower than float32 on an AVX2 EPYC)."""
        import torch

        if self.dtype != AUTO_DTYPE:
            return parse_dtype(self.dtype)
        dtype = checkpoint_dtype(model_cfg.hf_config)
        if self.torch_device.type == "cpu" and dtype != torch.float32 and not cpu_has_native(dtype):
            return torch.float32
        return dtype

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
