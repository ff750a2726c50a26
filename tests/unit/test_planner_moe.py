"""Planner: mixture-of-experts, latent-attention and windowed models: parameters, KV bytes, the
experts a step reads, tensor against expert parallelism, and shapes read from config.json."""

from __future__ import annotations

import dataclasses

import pytest

from planner.catalog import load_catalog
from planner.cost_model import RooflineCostModel, cost_model_for
from planner.models import PRESETS, model_shape
from planner.parallel import allowed, kv_copies
from planner.plan import PlanContext, Pool, fits

CAT = load_catalog()


# ---------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("name, total, active, counts_embeddings", [
    ("DeepSeek-V3", 671e9, 37e9, False),  # DeepSeek-V3 technical report
    ("DeepSeek-R1", 671e9, 37e9, False),
    ("gpt-oss-120b", 116.83e9, 5.13e9, False),  # OpenAI gpt-oss model card, table 1
    ("gpt-oss-20b", 20.91e9, 3.61e9, False),
    ("Qwen3-30B-A3B", 30.5e9, 3.3e9, True),  # Qwen3 model cards
    ("Qwen3-235B-A22B", 235e9, 22e9, True),
    ("Mixtral-8x7B", 46.7e9, 12.9e9, True),  # Mistral AI, "Mixtral of experts"
])
def test_presets_have_the_published_total_and_active_parameters(name, total, active, counts_embeddings):
    m = PRESETS[name]
    assert m.params == pytest.approx(total, rel=0.02)
    # active_params counts a token's embedding row; Qwen and Mistral publish the whole input table in it
    published_way = m.active_params + (m.embedding_params - m.hidden_size if counts_embeddings else 0)
    assert published_way == pytest.approx(active, rel=0.02)
    assert m.active_params < m.params / 3


def test_quantized_checkpoints_take_their_own_bytes():
    ds, oss = PRESETS["DeepSeek-V3"], PRESETS["gpt-oss-120b"]
    # FP8 layers, bf16 embeddings / LM head / norms / routers: ~1 byte per parameter (673 GB)
    assert ds.weight_bytes(2) == pytest.approx(673e9, rel=0.01)
    # MXFP4 experts (4.25 bits) + bf16 attention and embeddings: the 65 GB checkpoint
    assert oss.weight_bytes(2) == pytest.approx(65.2e9, rel=0.01)
    assert oss.expert_bytes(2) == oss.experts.expert_params(2880) * 4.25 / 8
    assert PRESETS["Mixtral-8x7B"].weight_bytes(2) == 2 * PRESETS["Mixtral-8x7B"].params  # not quantized


def test_dense_presets_keep_their_numbers():
    # the shapes and the roofline of the dense models, as planned before experts existed
    for name in ("Llama-3-8B", "Llama-3-70B", "Llama-2-7B", "Qwen2.5-7B", "Qwen2.5-72B"):
        m = PRESETS[name]
        h, q, kv = m.hidden_size, m.q_dim, m.kv_dim
        layer = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if m.attention_bias else 0) + 3 * h * m.intermediate_size + 2 * h
        assert m.params == m.vocab_size * h + m.num_layers * layer + h + (0 if m.tie_word_embeddings else m.vocab_size * h)
        assert m.matmul_params_per_token == m.num_layers * layer
        assert m.active_params == m.params - m.embedding_params + h
        assert m.kv_bytes_per_token(2) == m.kv_bytes_per_token(2, 100_000) == 2 * m.num_layers * kv * 2
        assert m.weight_bytes(2) == 2 * m.params
        c = RooflineCostModel(CAT["H100-SXM"], m, 4)
        bw, kvb = 4 * 3350e9 * 0.8, m.kv_bytes_per_token(2)
        weights = (m.weight_bytes(2) - m.embedding_params * 2) / bw
        ar = 2 * m.num_layers * 2 * 3 / 4 * h * 2 / 450e9
        decode = (weights + 513 * kvb / bw) + 2 * m.num_layers * 8e-6 + ar * 1 + 1e-3
        assert c.decode_time(1, 512) == pytest.approx(decode, rel=1e-12)
        flops = 2.0 * m.num_layers * layer * 4096 + 2.0 * m.num_layers * q * 4096 ** 2 + 2.0 * m.vocab_size * h
        prefill = max(flops / (4 * 989e12 * 0.6), weights + 4096 * kvb / bw) + 2 * m.num_layers * 8e-6 + ar * 4096
        assert c.prefill_time(4096, 4096 ** 2, 0, 1) == pytest.approx(prefill + 1e-3, rel=1e-12)
        assert c.kv_capacity_tokens == int((4 * 80e9 * 0.85 - m.weight_bytes(2)) // kvb)


# ---------------------------------------------------------------------------------------------- KV cache
def test_latent_attention_caches_one_latent_per_token_per_layer():
    m = PRESETS["DeepSeek-V3"]
    assert m.kv_bytes_per_token(2) == (512 + 64) * 61 * 2 == 70_272
    assert m.kv_bytes_per_token(1) == 35_136
    # against GQA's K and V per head: 2 x 128 heads x 128 x 61 layers x 2 bytes
    assert m.kv_bytes_per_token(2) < 2 * 128 * 128 * 61 * 2 / 50


def test_windowed_layers_hold_at_most_their_window():
    m = PRESETS["gpt-oss-120b"]
    per_layer = 2 * 8 * 64 * 2
    assert m.windowed_layers == 18 and m.sliding_layers[:3] == (0, 2, 4)
    assert m.kv_split(2) == (18 * per_layer, 18 * per_layer)
    assert m.kv_bytes_per_token(2) == 36 * per_layer == m.kv_bytes_per_token(2, 128)  # within the window: all
    # 1024 tokens: the full layers hold 1024, the windowed 128 -> per token 18 + 18 / 8 layers' worth
    assert m.kv_bytes_per_token(2, 1024) == 18 * per_layer + 18 * per_layer * 128 // 1024
    assert m.kv_bytes_per_token(2, 100_000) == pytest.approx(18 * per_layer, rel=0.01)
    # the roofline reads the window of each sequence, not its whole context, in windowed layers
    c = RooflineCostModel(CAT["H100-SXM"], m, 1)
    no_windows = RooflineCostModel(CAT["H100-SXM"], dataclasses.replace(m, sliding_window=0), 1)
    assert c.decode_time(64, 64 * 8000) < no_windows.decode_time(64, 64 * 8000)
    assert c.decode_time(64, 64 * 100) == pytest.approx(no_windows.decode_time(64, 64 * 100), rel=1e-9)
    # capacity at a typical context: more tokens fit than if every layer held every token
    longer = RooflineCostModel(CAT["H100-SXM"], m, 1, kv_context=4096)
    assert longer.kv_capacity_tokens > 1.8 * c.kv_capacity_tokens


# ---------------------------------------------------------------------------------------------- experts read
def test_distinct_experts_a_batch_touches():
    e = PRESETS["DeepSeek-V3"].experts
    assert e.distinct(1) == pytest.approx(8)  # one token reads its top-k
    assert e.distinct(2) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 2))
    assert e.distinct(512) == pytest.approx(256, rel=1e-6)  # a big batch reads every expert
    assert e.distinct(0) == 0
    assert PRESETS["Mixtral-8x7B"].experts.distinct(1) == pytest.approx(2)


def test_a_decode_step_reads_the_dense_part_and_the_experts_its_batch_touches():
    m = PRESETS["Mixtral-8x7B"]
    c = RooflineCostModel(CAT["H200"], m, 1)
    bw = 4800e9 * 0.8
    expert = m.experts.expert_params(4096) * 2 * 32  # one expert in all 32 layers
    dense = m.weight_bytes(2) - m.embedding_params * 2 - 8 * expert
    kv = 1001 * m.kv_bytes_per_token(2)
    assert c.decode_time(1, 1000) == pytest.approx((dense + 2 * expert + kv) / bw + 1e-3, rel=1e-9)
    # batch 1 reads about a quarter of the weights, a batch of 64 all of them
    assert (c.decode_time(1, 1000) - 1e-3) < 0.35 * (m.weight_bytes(2) / bw)
    step_64 = c.decode_time(64, 64_000) - 1e-3 - 64 * 1001 * m.kv_bytes_per_token(2) / bw
    assert step_64 == pytest.approx((dense + 8 * expert) / bw, rel=1e-3)


def test_prefill_flops_follow_active_parameters_and_latent_attention():
    m = PRESETS["DeepSeek-V3"]
    c = RooflineCostModel(CAT["H200"], m, 8, ep=True)
    n = 8192
    layers = 2.0 * m.matmul_params_per_token * n
    attention = 61 * 128 * (192 + 128) * n * n  # causal QK (192 per head) and PV (128), as computed
    lm = 2.0 * m.vocab_size * m.hidden_size
    assert c.prefill_time(n, n * n, 0, 1) == pytest.approx(
        (layers + attention + lm) / (8 * 989e12 * 0.6) + c._tp_fixed + c._tp_per_token * n + 1e-3, rel=1e-9)
    assert m.matmul_params_per_token == pytest.approx(m.active_params - m.hidden_size - m.lm_head_params - 7168)


# ---------------------------------------------------------------------------------------------- TP or EP
def test_the_rule_allows_tp_within_a_node_and_ep_where_the_degree_divides_the_experts():
    ds, mixtral, oss20 = PRESETS["DeepSeek-V3"], PRESETS["Mixtral-8x7B"], PRESETS["gpt-oss-20b"]
    h100 = CAT["H100-SXM"]
    assert allowed(ds, h100, 8) == ("tp", "ep")
    assert allowed(ds, h100, 16) == ("ep",)  # two nodes: only expert parallelism spans them
    assert allowed(ds, h100, 12) == ()  # not whole nodes
    assert allowed(mixtral, h100, 16) == ()  # 8 experts
    assert allowed(mixtral, h100, 8) == ("tp", "ep")
    assert allowed(oss20, h100, 1) == ("tp",)
    assert allowed(PRESETS["Llama-3-8B"], h100, 4) == ("tp",)
    with pytest.raises(ValueError, match="not allowed"):
        cost_model_for(h100, mixtral, 16, ep=True)


def test_deepseek_needs_two_h100_nodes_with_expert_parallelism_or_one_h200_node():
    ctx = PlanContext(PRESETS["DeepSeek-V3"], CAT)
    assert not fits(Pool("H100-SXM", 1, 8), ctx, 8192)  # 673 GB > 8 x 80 GB x 0.85
    assert not fits(Pool("H100-SXM", 1, 8, ep=True), ctx, 8192)
    assert fits(Pool("H100-SXM", 1, 16, ep=True), ctx, 8192)
    assert fits(Pool("H200", 1, 8), ctx, 8192) and fits(Pool("H200", 1, 8, ep=True), ctx, 8192)


def test_latent_kv_is_held_per_tp_rank_so_deepseek_decode_favours_ep_at_large_batch():
    ds = PRESETS["DeepSeek-V3"]
    assert kv_copies(ds, 8, ep=False) == 8 and kv_copies(ds, 8, ep=True) == 1
    assert kv_copies(PRESETS["Qwen3-30B-A3B"], 8, ep=False) == 2  # 4 KV heads over 8 ranks
    assert kv_copies(PRESETS["Llama-3-8B"], 8, ep=False) == 1
    tp = RooflineCostModel(CAT["H200"], ds, 8)
    ep = RooflineCostModel(CAT["H200"], ds, 8, ep=True)
    assert ep.kv_capacity_tokens > 3 * tp.kv_capacity_tokens
    assert ep.decode_time(256, 256 * 2000) < tp.decode_time(256, 256 * 2000)  # big batch: EP
    assert tp.decode_time(1, 2000) < ep.decode_time(1, 2000)  # one sequence: TP splits the dense reads
    assert ep.prefill_time(8192, 8192 * 1024, 0, 8) < tp.prefill_time(8192, 8192 * 1024, 0, 8)


def test_the_search_tries_each_allowed_layout_and_the_plan_names_it():
    from loadgen.scaling import Scaling
    from planner.search import Searcher, SLOTarget
    from planner.workload import PlanWorkload

    ctx = PlanContext(PRESETS["DeepSeek-V3"], CAT)
    w = PlanWorkload("t", "", [1000] * 50, [100] * 50, None, Scaling(1.0, "none"))
    s = Searcher(ctx, w, SLOTarget(2000, 100))
    assert s._pools("H100-SXM", 8) == []
    assert s._pools("H100-SXM", 16) == [Pool("H100-SXM", 1, 16, ep=True)]
    assert s._pools("H200", 8) == [Pool("H200", 1, 8), Pool("H200", 1, 8, ep=True)]
    assert str(Pool("H200", 3, 8, ep=True)) == "3x H200 ep8" and str(Pool("H200", 3, 8)) == "3x H200 tp8"


# ---------------------------------------------------------------------------------------------- config.json
def _tiny_configs():
    from transformers import DeepseekV2Config, DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig

    small = dict(vocab_size=97, hidden_size=64, num_attention_heads=4)
    return {
        "MixtralForCausalLM": MixtralConfig(**small, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2),
        "Qwen3MoeForCausalLM": Qwen3MoeConfig(**small, intermediate_size=96, moe_intermediate_size=16,
                                              num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_experts=8,
                                              num_experts_per_tok=2, mlp_only_layers=[1]),
        "DeepseekV2ForCausalLM": DeepseekV2Config(**small, intermediate_size=96, moe_intermediate_size=16,
                                                  num_hidden_layers=3, n_shared_experts=2, n_routed_experts=8,
                                                  num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None,
                                                  qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                                                  first_k_dense_replace=1),
        "DeepseekV3ForCausalLM": DeepseekV3Config(**small, intermediate_size=96, moe_intermediate_size=16,
                                                  num_hidden_layers=3, num_key_value_heads=4, n_shared_experts=1,
                                                  n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                                  kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
                                                  qk_nope_head_dim=16, first_k_dense_replace=1),
        "GptOssForCausalLM": GptOssConfig(**small, intermediate_size=32, head_dim=16, num_key_value_heads=2,
                                          num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2,
                                          sliding_window=8),
    }


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
                                  "DeepseekV3ForCausalLM", "GptOssForCausalLM"])
def test_model_shape_reads_each_architecture_and_counts_what_transformers_builds(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = _tiny_configs()[arch]
    cfg.architectures = [arch]
    cfg.save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    model = AutoModelForCausalLM.from_config(cfg)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.experts is not None and shape.experts.per_token == 2
    if arch.startswith("Deepseek"):
        assert shape.mla is not None and shape.experts.dense_layers == (0,)
        assert shape.kv_bytes_per_token(2) == (32 + 8) * 3 * 2
        assert shape.mla.q_lora_rank == (48 if arch == "DeepseekV3ForCausalLM" else None)
    if arch == "Qwen3MoeForCausalLM":
        assert shape.experts.dense_layers == (1,) and shape.qk_norm
    if arch == "GptOssForCausalLM":
        assert shape.sliding_window == 8 and shape.sliding_layers == (0, 2) and shape.attention_sinks
        assert shape.kv_bytes_per_token(2, 64) == 2 * 2 * 16 * 2 * 2 + 2 * 2 * 16 * 2 * 2 * 8 // 64


def test_model_shape_reads_the_checkpoints_quantization(tmp_path):
    import json

    for arch, method, check in (("DeepseekV3ForCausalLM", "fp8", lambda s: s.weight_bytes_per_param == 1.0),
                                ("GptOssForCausalLM", "mxfp4", lambda s: s.experts.bytes_per_param == 4.25 / 8)):
        path = tmp_path / arch
        cfg = _tiny_configs()[arch]
        cfg.architectures = [arch]
        cfg.save_pretrained(path)
        raw = json.loads((path / "config.json").read_text())
        raw["quantization_config"] = {"quant_method": method}
        (path / "config.json").write_text(json.dumps(raw))
        shape = model_shape(str(path))
        assert check(shape) and shape.quantized and shape.weight_bytes(2) < 2 * shape.params


def test_plan_simulate_prints_each_pools_layout(capsys):
    from planner.cli import main

    assert main(["simulate", "--workload", "synthetic", "--num-requests", "50", "--model", "DeepSeek-V3",
                 "--prefill", "H100-SXM:1:16", "--decode", "H200:1:ep8", "--rate", "1"]) == 0
    out = capsys.readouterr().out
    assert "P 1x H100-SXM ep16 | D 1x H200 ep8" in out  # 16 H100s: only EP, chosen for the plain number
    assert "parallel   decode 1x H200 ep8: expert parallel: 32 of 256 experts" in out and "(tp8 also allowed)" in out
    assert "36.6B active parameters" in out


def test_quantized_kv_pages_hold_more_tokens_and_move_fewer_bytes():
    """kv_cache.dtype int8 / fp8: a byte a value and a 4-byte scale a row, in the plan's capacity
    and transfer bytes; written into the plan's cluster.yaml."""
    ds, llama = PRESETS["DeepSeek-V3"], PRESETS["Llama-3-70B"]
    assert ds.kv_bytes_per_token(2) == 576 * 61 * 2  # bf16 latent rows
    assert ds.kv_bytes_per_token(2, quantized=True) == (576 + 4) * 61
    assert llama.kv_bytes_per_token(2, quantized=True) == 80 * 2 * 8 * (128 + 4)
    plain = RooflineCostModel(CAT["H200"], llama, 8)
    quant = RooflineCostModel(CAT["H200"], llama, 8, kv_quantized=True)
    assert quant.kv_capacity_tokens / plain.kv_capacity_tokens == pytest.approx(256 / 132, rel=1e-3)
    ctx = PlanContext(llama, CAT, kv_cache_dtype="int8")
    assert ctx.cost(Pool("H200", 1, 8)).kv_bytes_per_token == quant.kv_bytes_per_token
    from pdcluster.cluster_config import ClusterConfig
    from planner.plan import Plan
    from planner.report import cluster_dict
    from planner.search import SLOTarget

    d = cluster_dict(Plan("disaggregated", Pool("H200", 1, 8), Pool("H200", 1, 8)), ctx, SLOTarget(1000, 50), "/m", 3000)
    assert ClusterConfig.from_dict(d).kv_cache.dtype == "int8"
