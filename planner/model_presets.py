"""Named model shapes, so `pdcluster plan --model NAME` needs no checkpoint. Each one is copied from
the model's config.json on the Hugging Face Hub (the repository is named beside it); the field names
are those of transformers' config classes (models/<type>/configuration_<type>.py)."""

from __future__ import annotations

from planner.model_shape import Experts, LatentAttention, ModelShape

MXFP4_BYTES = 4.25 / 8  # 4-bit values plus one 8-bit (E8M0) scale per block of 32
FP8_BYTES = 1.0  # e4m3 with one float32 scale per 128 x 128 block (4 / 16384 bytes per value, not counted)


def _preset(name: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int,
            head_dim: int | None = None, tie: bool = False, bias: bool = False, ctx: int = 8192) -> ModelShape:
    return ModelShape(name, vocab, hidden, inter, layers, heads, kv, head_dim or hidden // heads, tie, bias, ctx)


def _deepseek_v3(name: str) -> ModelShape:
    # deepseek-ai/DeepSeek-V3 and deepseek-ai/DeepSeek-R1 (the same shape): config.json, DeepseekV3Config.
    # 61 layers, first_k_dense_replace 3, n_routed_experts 256, num_experts_per_tok 8,
    # n_shared_experts 1, moe_intermediate_size 2048, kv_lora_rank 512, q_lora_rank 1536,
    # qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, quantization_config fp8 (e4m3,
    # weight_block_size [128, 128]). The multi-token-prediction layer (num_nextn_predict_layers 1,
    # 14B parameters) is not served and not counted: 671B, as published.
    return ModelShape(name, 129280, 7168, 18432, 61, 128, 128, 192, max_context=163840,
                      experts=Experts(256, 8, 2048, shared=1, dense_layers=(0, 1, 2)),
                      mla=LatentAttention(512, 64, 128, 128, q_lora_rank=1536),
                      weight_bytes_per_param=FP8_BYTES)


def _gpt_oss(name: str, layers: int, experts: int) -> ModelShape:
    # openai/gpt-oss-120b (36 layers, 128 experts) and openai/gpt-oss-20b (24 layers, 32 experts):
    # config.json, GptOssConfig. hidden 2880, intermediate_size 2880 (each expert's), 64 heads of
    # 64, 8 KV heads, experts_per_token 4, layer_types alternating sliding_attention (even layers)
    # and full_attention, sliding_window 128, attention_bias (q/k/v/o), attention sinks, router and
    # expert biases; quantization_config mxfp4 for the experts only (modules_to_not_convert:
    # self_attn, mlp.router, embed_tokens, lm_head).
    return ModelShape(name, 201088, 2880, 2880, layers, 64, 8, 64, attention_bias=True, max_context=131072,
                      o_bias=True, attention_sinks=True, sliding_window=128,
                      sliding_layers=tuple(range(0, layers, 2)),
                      experts=Experts(experts, 4, 2880, bias=True, router_bias=True, bytes_per_param=MXFP4_BYTES))


def _qwen3_moe(name: str, hidden: int, inter: int, layers: int, heads: int, moe_inter: int) -> ModelShape:
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B: config.json, Qwen3MoeConfig. num_experts 128,
    # num_experts_per_tok 8, decoder_sparse_step 1 and mlp_only_layers [] (every layer MoE),
    # 4 KV heads, head_dim 128, q/k norms, use_sliding_window false, max_position_embeddings 40960.
    return ModelShape(name, 151936, hidden, inter, layers, heads, 4, 128, max_context=40960, qk_norm=True,
                      experts=Experts(128, 8, moe_inter))


# mistralai/Mixtral-8x7B-v0.1: config.json, MixtralConfig. 32 layers, hidden 4096, intermediate_size
# 14336 (each expert's), 32 heads, 8 KV heads, num_local_experts 8, num_experts_per_tok 2,
# sliding_window null, max_position_embeddings 32768.
MIXTRAL_8X7B = ModelShape("Mixtral-8x7B", 32000, 4096, 14336, 32, 32, 8, 128, max_context=32768,
                          experts=Experts(8, 2, 14336))

PRESETS: dict[str, ModelShape] = {m.name: m for m in (
    # dense, from each model's config.json on the Hub (meta-llama/*, Qwen/Qwen2.5-*)
    _preset("Llama-3-8B", 128256, 4096, 14336, 32, 32, 8),
    _preset("Llama-3-70B", 128256, 8192, 28672, 80, 64, 8),
    _preset("Llama-2-7B", 32000, 4096, 11008, 32, 32, 32, ctx=4096),
    _preset("Llama-2-13B", 32000, 5120, 13824, 40, 40, 40, ctx=4096),
    _preset("Llama-2-70B", 32000, 8192, 28672, 80, 64, 8, ctx=4096),
    _preset("Qwen2.5-7B", 152064, 3584, 18944, 28, 28, 4, bias=True, ctx=32768),
    _preset("Qwen2.5-72B", 152064, 8192, 29568, 80, 64, 8, bias=True, ctx=32768),
    # mixture of experts
    _deepseek_v3("DeepSeek-V3"),
    _deepseek_v3("DeepSeek-R1"),
    _gpt_oss("gpt-oss-120b", 36, 128),
    _gpt_oss("gpt-oss-20b", 24, 32),
    _qwen3_moe("Qwen3-30B-A3B", 2048, 6144, 48, 32, 768),
    _qwen3_moe("Qwen3-235B-A22B", 4096, 12288, 94, 64, 1536),
    MIXTRAL_8X7B,
)}
