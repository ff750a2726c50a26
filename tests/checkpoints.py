"""Tiny random checkpoints of every supported architecture, written with transformers itself."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512

# name -> (config class, model class, extra config kwargs)
SHAPES: dict[str, tuple[str, dict]] = {
    "llama-gqa": ("Llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mqa-tied": ("Llama", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "llama-headdim-linear": (
        "Llama",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
             rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "llama3-rope": (
        "Llama",
        dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=500000.0,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ),
    "mistral": ("Mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "qwen2-bias": ("Qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    # sliding windows shorter than the test prompts: every layer (Mistral); the layers from
    # max_window_layers on (Qwen2); windowed and full layers alternating by layer_types (Qwen3)
    "mistral-window": ("Mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=14)),
    "qwen2-window-layers": ("Qwen2", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                                          use_sliding_window=True, sliding_window=12, max_window_layers=1)),
    "qwen3-window-alternating": (
        "Qwen3",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=4, use_sliding_window=True,
             sliding_window=18, layer_types=["sliding_attention", "full_attention"] * 2),
    ),
    # mixture of experts: every layer routed, top-2 of 4, weights renormalised
    "mixtral": ("Mixtral", dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=None)),
    # top-2 of 8, renormalised
    "qwen3-moe": ("Qwen3Moe", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                                   num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)),
    # multi-head latent attention with experts: q LoRA, interleaved RoPE, a dense first layer, 8 experts
    # in 4 groups (top-2 groups, then top-2 experts) with a score bias, a shared expert, scaled weights
    "deepseek-v3": ("DeepseekV3", dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5)),
    # no q LoRA, RoPE not interleaved, YaRN with DeepSeek's mscale (the softmax scale changes too)
    "deepseek-v3-yarn": ("DeepseekV3", dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=0, rope_interleave=False,
        norm_topk_prob=False, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
    # DeepSeek-V2: softmax routing limited to the best groups, two shared experts, RoPE as complex pairs
    "deepseek-v2": ("DeepseekV2", dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", n_shared_experts=2, moe_intermediate_size=24, first_k_dense_replace=0,
        routed_scaling_factor=1.5)),
    # not renormalised, top-3 of 6, and a dense first layer (mlp_only_layers) before the routed one
    "qwen3-moe-dense-first": ("Qwen3Moe", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                               num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
                                               norm_topk_prob=False, mlp_only_layers=[0])),
    # gpt-oss: sinks, q/k/v/o biases, windowed and full layers alternating (window shorter than the
    # prompts), biased router top-2 of 4 then softmax, biased experts with the clamped SwiGLU
    "gpt-oss": ("GptOss", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
                                intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=10, layer_types=["sliding_attention", "full_attention"] * 2,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False})),
}


def make_checkpoint(out: Path, shape: str = "llama-gqa", dtype: torch.dtype = torch.float32, seed: int = 0,
                    max_shard_size: str | None = None, **overrides) -> Path:
    """Write a tiny checkpoint whose greedy choices are decisive (scaled output layer)."""
    import transformers

    family, kwargs = SHAPES[shape]
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
               pad_token_id=0, tie_word_embeddings=False)
    cfg.update(kwargs)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**cfg))
    with torch.no_grad():
        # Random models have near-uniform logits; scaling the head keeps top-2 far apart so greedy
        # decisions do not flip under equivalent but differently ordered float arithmetic.
        model.lm_head.weight.mul_(8.0)
        # and routers too: a near-tie between two experts would flip on compute-order noise
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.mul_(4.0)
        if family == "GptOss":  # zero-initialised by transformers: make the sinks and biases count
            for name, param in model.named_parameters():
                if name.endswith("sinks"):
                    param.copy_(torch.randn_like(param) * 2.0)
                elif name.endswith("bias"):
                    param.normal_(0, 0.5)
                elif name.endswith("router.weight"):
                    param.mul_(4.0)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 chooses with it: make it count
                buf.copy_(torch.rand_like(buf) * 0.2)
        if getattr(model.model.layers[0].self_attn.q_proj, "bias", None) is not None:
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(out, **kwargs)
    return out
