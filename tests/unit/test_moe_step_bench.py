"""benchmarks/moe_step.py: the weight bytes a decode step must read, dense and MoE."""

from __future__ import annotations

from benchmarks.moe_step import step_bytes
from engine.builtin_model import BUILTIN_MODELS
from planner.models import from_checkpoint


def test_a_dense_step_reads_every_weight_and_a_moe_step_the_chosen_experts(tmp_path):
    import json

    def shape(name):
        d = tmp_path / name
        d.mkdir()
        spec = BUILTIN_MODELS[name]
        cfg = {**spec["config"], "architectures": [f"{spec['family']}ForCausalLM"],
               "model_type": {"Qwen3": "qwen3", "Qwen3Moe": "qwen3_moe"}[spec["family"]], "dtype": "bfloat16"}
        (d / "config.json").write_text(json.dumps(cfg))
        return from_checkpoint(d)

    dense, moe = shape("moe-400m-dense"), shape("moe-400m")
    assert step_bytes(dense, 2, 1) == step_bytes(dense, 2, 16) == 2 * (dense.params - dense.embedding_params)
    e, h = moe.experts, moe.hidden_size
    every = 2 * (moe.params - moe.embedding_params)
    one_token = every - 2 * moe.moe_layers * (e.num - e.per_token) * e.expert_params(h)
    assert abs(step_bytes(moe, 2, 1) - one_token) < 1e-3 * one_token  # batch 1: exactly its top-k
    # batch 16 of top-8 over 64: 1 - (7/8)^16 = 88% of the experts
    chosen = e.num * (1 - (1 - e.per_token / e.num) ** 16)
    assert abs(step_bytes(moe, 2, 16) - (every - 2 * moe.moe_layers * (e.num - chosen) * e.expert_params(h))) < 1
    assert step_bytes(moe, 2, 10_000) > 0.999 * every
    # moe-400m-dense is moe-400m's active size, the routers aside
    assert abs(step_bytes(dense, 2, 1) - one_token) < 0.01 * one_token
