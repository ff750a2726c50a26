"""Planner: hardware catalog, model shapes, roofline and fitted cost models, the calibration fit."""

from __future__ import annotations

import pytest

from planner.calibrate import fit
from planner.catalog import load_catalog, parse_prices
from planner.cost_model import FittedCostModel, RooflineCostModel, cost_model_for, fitted_from
from planner.models import PRESETS, from_checkpoint, model_shape

LLAMA3_8B = PRESETS["Llama-3-8B"]


def test_catalog_has_every_type_with_its_figures_and_a_source():
    cat = load_catalog()
    assert {"A100-80GB", "H100-SXM", "H200", "H20", "L40S", "B200", "cpu"} <= set(cat)
    for hw in cat.values():
        assert hw.tflops_bf16 > 0 and hw.hbm_gbps > 0 and hw.hbm_gb > 0 and hw.price_per_hour > 0
        assert hw.intra_node_gbps > 0 and hw.inter_node_gbps > 0 and hw.power_w > 0 and hw.source
    assert cat["H100-SXM"].tflops_bf16 == 989 and cat["H100-SXM"].hbm_gbps == 3350


def test_a_user_catalog_overrides_keys_and_adds_types(tmp_path):
    extra = tmp_path / "mine.yaml"
    extra.write_text("H100-SXM: {price_per_hour: 9.5}\n"
                     "MI300X: {tflops_bf16: 1307, hbm_gbps: 5300, hbm_gb: 192, intra_node_gbps: 448,\n"
                     "         inter_node_gbps: 50, power_w: 750, price_per_hour: 3.0}\n")
    cat = load_catalog([extra], parse_prices(["A100-80GB=1.1"]))
    assert cat["H100-SXM"].price_per_hour == 9.5 and cat["H100-SXM"].tflops_bf16 == 989
    assert cat["MI300X"].hbm_gb == 192 and cat["A100-80GB"].price_per_hour == 1.1
    extra.write_text("H100-SXM: {tflops: 1}\n")
    with pytest.raises(ValueError, match="H100-SXM.tflops: unknown key"):
        load_catalog([extra])
    with pytest.raises(ValueError, match="NAME=USD"):
        parse_prices(["H100-SXM"])


def test_llama3_8b_shape_parameters_and_kv_bytes():
    m = LLAMA3_8B
    # per layer: q,o 4096x4096 each, k,v 4096x1024 each, MLP 3 x 4096x14336, two norms
    assert m.layer_params == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096 == 218_112_000
    assert m.params == 2 * 128256 * 4096 + 32 * 218_112_000 + 4096 == 8_030_261_248
    assert m.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 128 * 1024  # DESIGN.md: 128 KiB per token
    assert m.weight_bytes(2) == 2 * 8_030_261_248
    assert model_shape("llama-3-70b").num_layers == 80


def test_shape_from_a_checkpoint_counts_the_parameters_transformers_has(checkpoint):
    from transformers import AutoModelForCausalLM

    path = checkpoint("qwen2-bias")  # tied embeddings + q/k/v biases
    shape = from_checkpoint(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.attention_bias and shape.tie_word_embeddings


def test_roofline_decode_of_llama3_8b_on_h100_by_hand():
    c = RooflineCostModel(load_catalog()["H100-SXM"], LLAMA3_8B)
    # memory-bound: weights without the embedding table, (8,030,261,248 - 525,336,576) x 2 bytes
    # = 15,009,849,344 B, plus the KV of 1000 context tokens + the new one: 1001 x 131,072 B,
    # over 3350 GB/s x 0.8 = 2.68e12 B/s -> 5.60069 ms + 0.04896 ms; plus the 1 ms step overhead.
    # (compute: 15.53 GFLOP / (989 TFLOP/s x 0.5) = 0.031 ms, far below)
    assert c.decode_time(1, 1000) == pytest.approx(15_009_849_344 / 2.68e12 + 1001 * 131_072 / 2.68e12 + 1e-3,
                                                   rel=1e-9)
    assert c.decode_time(1, 1000) == pytest.approx(6.6496e-3, rel=1e-4)


def test_roofline_prefill_of_llama3_8b_on_h100_by_hand():
    c = RooflineCostModel(load_catalog()["H100-SXM"], LLAMA3_8B)
    # compute-bound: 2 x 6,979,584,000 layer weights x 2048 tokens = 28,588,376,064,000
    # + attention 2 x 32 layers x 4096 x 2048^2 = 1,099,511,627,776 + LM head 2 x 525,336,576
    # = 29,688,938,364,928 FLOP over 989e12 x 0.6 = 593.4e12 FLOP/s = 50.032 ms, + 1 ms
    assert c.prefill_time(2048, 2048 * 2048, 0, 1) == pytest.approx(29_688_938_364_928 / 593.4e12 + 1e-3, rel=1e-9)
    # KV capacity: 80 GB x (0.9 - 0.05) - 16,060,522,496 B of weights = 51,939,477,504 B / 131,072
    assert c.kv_capacity_tokens == 396_266


def test_tensor_parallelism_splits_the_work_and_pays_for_all_reduces():
    hw = load_catalog()["H100-SXM"]
    one, two = RooflineCostModel(hw, LLAMA3_8B, tp=1), RooflineCostModel(hw, LLAMA3_8B, tp=2)
    assert one.prefill_time(2048, 2048**2) / 2 < two.prefill_time(2048, 2048**2) < one.prefill_time(2048, 2048**2)
    assert two.kv_capacity_tokens > 2 * one.kv_capacity_tokens  # the weights are paid once
    with pytest.raises(ValueError, match="max_tp"):
        cost_model_for(load_catalog()["L40S"], LLAMA3_8B, tp=8)


def test_fitted_model_is_the_calibrated_formula():
    c = FittedCostModel((0.01, 2e-4, 3e-8), (0.004, 1e-6, 5e-3), 1000, 9216)
    assert c.prefill_time(300, 300 * 300) == pytest.approx(0.01 + 2e-4 * 300 + 3e-8 * 90_000)
    assert c.decode_time(8, 4000) == pytest.approx(0.004 + 1e-6 * 4000 + 5e-3 * 8)
    coeffs = {"prefill": {"a": 0.01, "b": 2e-4, "c": 3e-8}, "decode": {"a": 0.004, "b": 1e-6, "c": 5e-3},
              "kv_capacity_tokens": 1000, "kv_bytes_per_token": 9216, "serving": {"decode_token_s": 1e-3},
              "model_shape": {"name": "builtin:tiny-llama"}}
    assert fitted_from(coeffs).decode == (0.004, 1e-6, 6e-3)  # + the worker's streaming per token
    with pytest.raises(ValueError, match="a Llama-3-8B checkpoint"):
        cost_model_for(load_catalog()["cpu"], LLAMA3_8B, coefficients=coeffs)


def test_a_measured_decode_table_is_interpolated_in_batch_and_extended_by_the_fit():
    """Rows (batch, seconds, context per sequence) as calibrate --from-bench measures them per bucket."""
    rows = ((1.0, 0.010, 200.0), (2.4, 0.016, 200.0), (5.0, 0.018, 210.0))
    c = FittedCostModel((0.0, 0.0, 0.0), (0.008, 5e-6, 1e-3), 1000, 9216, decode_table=rows)
    assert c.decode_time(1, 200) == pytest.approx(0.010)  # a row, at its own context
    # between rows: 2 is 1/1.4 of the way from 1 to 2.4
    assert c.decode_time(2, 400) == pytest.approx(0.010 + 0.006 / 1.4)
    # 5 sequences attending to 50 tokens fewer than the row's 5 x 210: b per token less
    assert c.decode_time(5, 1000) == pytest.approx(0.018 - 50 * 5e-6)
    # past the last row: + (c + b x its context per sequence) per sequence, 2.05 ms
    assert c.decode_time(8, 8 * 210) == pytest.approx(0.018 + 3 * 2.05e-3)
    # below the first row (a table without batch 1): less the same cost per sequence
    above_one = FittedCostModel((0.0, 0.0, 0.0), (0.008, 5e-6, 1e-3), 1000, 9216, decode_table=rows[1:])
    assert above_one.decode_time(1, 200) == pytest.approx(0.016 - 1.4 * 2e-3)
    assert FittedCostModel((0.0, 0.0, 0.0), (0.008, 5e-6, 1e-3), 1000, 9216).decode_time(5, 1000) == \
        pytest.approx(0.008 + 5e-3 + 5e-3)  # without a table: the formula
    live = {"decode": {"a": 0.008, "b": 5e-6, "c": 1e-3,
                       "table": [{"batch": b, "seconds": t, "context_per_seq": x, "steps": 100} for b, t, x in rows]}}
    coeffs = {"prefill": {"a": 0.01, "b": 2e-4, "c": 3e-8}, "decode": {"a": 0.004, "b": 1e-6, "c": 5e-3},
              "kv_capacity_tokens": 1000, "kv_bytes_per_token": 9216, "live": {"decode": live}}
    assert fitted_from(coeffs).decode_table == rows
    live["decode"]["table"].reverse()  # a table written in another order is read by batch
    assert fitted_from(coeffs).decode_table == rows
    same = FittedCostModel((0.0, 0.0, 0.0), (0.008, 5e-6, 1e-3), 1000, 9216,
                           decode_table=((2.0, 0.010, 200.0), (2.0, 0.012, 200.0)))
    assert same.decode_time(2, 400) == pytest.approx(0.012)  # rows of one batch: no division by zero
    live["decode"]["table"] = live["decode"]["table"][:1]  # one row is no table
    assert fitted_from(coeffs).decode_table == ()


def test_calibration_fit_recovers_known_coefficients():
    truth = [0.02, 3e-4, 4e-8]
    feats = [[1, n, n * n] for n in (16, 64, 128, 256, 512, 1024, 2048)] + [[1, 512, 4 * 128 * 128]]
    secs = [sum(c * x for c, x in zip(truth, f)) * (1.01 if i % 2 else 0.99) for i, f in enumerate(feats)]
    coef, err = fit(feats, secs)
    assert coef == pytest.approx(truth, rel=0.1)
    assert err["mean_abs_pct_error"] < 2.0
    coef, _ = fit([[1, 1], [1, 2], [1, 3]], [3.0, 2.0, 1.0])  # a decreasing trend: no negative slope
    assert min(coef) >= 0


def test_live_step_costs_replace_the_engine_fit_per_role():
    from planner.catalog import load_catalog as catalog
    from planner.models import model_shape
    from planner.plan import Plan, PlanContext, Pool, build_cluster

    live = {"decode": {"a": 0.007, "b": 5e-6, "c": 7e-4}, "prefill": {"a": 0.02, "b": 4e-4, "c": 2e-7}}
    coeffs = {"model": "builtin:tiny-llama", "model_shape": {"name": "builtin:tiny-llama"},
              "prefill": {"a": 0.01, "b": 2e-4, "c": 1e-7}, "decode": {"a": 0.004, "b": 1e-6, "c": 5e-3},
              "kv_capacity_tokens": 1000, "kv_bytes_per_token": 9216,
              "serving": {"decode_token_s": 1e-3, "cpu_per_token_s": 3e-3, "host_cores": 2},
              "live": {"decode": live}}
    ctx = PlanContext(model_shape("builtin:tiny-llama"), catalog(), coefficients=coeffs)
    disagg = build_cluster(Plan("disaggregated", Pool("cpu", 1), Pool("cpu", 1), 2048, 256), ctx)
    assert disagg.prefill[0].cost.prefill == (0.02, 4e-4, 2e-7)
    assert disagg.decode[0].cost.decode == (0.007, 5e-6, 7e-4)
    assert disagg.host_cpu_per_token_s == pytest.approx(2e-3)  # the serving path's CPU still floats over the host
    coloc = build_cluster(Plan("colocated", None, Pool("cpu", 2), 2048, 256), ctx)
    assert coloc.decode[0].cost.decode == (0.004, 1e-6, 6e-3)  # no live fit for colocated workers
    assert coloc.host_cpu_per_token_s == pytest.approx(2e-3)


def test_the_fixed_ttft_share_comes_from_the_idle_ttft_of_a_live_calibration():
    """TTFT with one stream = fixed serving share + prefill: the planner takes the modelled part away;
    the fixed share, less the first token's trip out, is the router-in delay the simulator adds. A
    live prefill step (the worker's own step counters) has the KV transfer and commit in it, so
    nothing is taken for a transfer, and the simulator adds none (transfer_in_step)."""
    from planner.catalog import load_catalog as catalog
    from planner.models import model_shape
    from planner.plan import Plan, PlanContext, Pool, build_cluster

    prefill = {"a": 0.02, "b": 4e-4, "c": 0.0}
    fixed = {"decode": 0.030, "colocated": 0.050}  # what each cluster's serving path adds, by construction
    kv = {"latency": 0.002, "gbps": 1.0, "bytes": 9216}

    def idle(mode: str) -> dict[str, float]:
        return {str(n): fixed[mode] + prefill["a"] + prefill["b"] * n for n in (64, 256, 768)}

    live = {m: {"decode": {"a": 0.007, "b": 5e-6, "c": 7e-4}, "prefill": prefill, "idle_ttft_s": idle(m)}
            for m in fixed}
    coeffs = {"model": "builtin:tiny-llama", "model_shape": {"name": "builtin:tiny-llama"},
              "prefill": {"a": 0.01, "b": 2e-4, "c": 0.0}, "decode": {"a": 0.004, "b": 1e-6, "c": 5e-3},
              "kv_capacity_tokens": 1000, "kv_bytes_per_token": kv["bytes"],
              "serving": {"router_in_s": 0.007, "first_token_out_s": 0.007, "kv_latency_s": kv["latency"],
                          "kv_gbps": kv["gbps"], "host_cores": 2},
              "live": live}
    ctx = PlanContext(model_shape("builtin:tiny-llama"), catalog(), coefficients=coeffs)
    disagg = build_cluster(Plan("disaggregated", Pool("cpu", 1), Pool("cpu", 1), 2048, 256), ctx)
    coloc = build_cluster(Plan("colocated", None, Pool("cpu", 2), 2048, 256), ctx)
    assert disagg.router_in_s == pytest.approx(0.030 - 0.007) and disagg.first_token_out_s == 0.007
    assert coloc.router_in_s == pytest.approx(0.050 - 0.007)
    assert disagg.transfer_in_step and not coloc.transfer_in_step
    assert not disagg.commit_waits_lock  # the lock wait is in these steps
    live["decode"]["prefill"] = {**prefill, "commit_wait_out": True}  # a bench fit took it out
    again = build_cluster(Plan("disaggregated", Pool("cpu", 1), Pool("cpu", 1), 2048, 256), ctx)
    assert again.transfer_in_step and again.commit_waits_lock
    # GPU prefill workers get the roofline's step costs: their KV transfer is the simulator's to add
    gpu = build_cluster(Plan("disaggregated", Pool("H100-SXM", 1), Pool("H100-SXM", 1), 2048, 256), ctx)
    assert not gpu.transfer_in_step
    del live["colocated"]["idle_ttft_s"]  # without the measurement: the zero-load probe's split
    assert build_cluster(Plan("colocated", None, Pool("cpu", 2), 2048, 256), ctx).router_in_s == 0.007
