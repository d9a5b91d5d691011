import numpy as np
import pytest

from adapt.replay.cost import MODELS, GPUSpec, ModelSpec, RooflineCostModel, roofline
from adapt.steplog import StepBatch

TINY = ModelSpec("tiny", layers=1, hidden=10, heads=1, kv_heads=1, head_dim=10, intermediate=10, vocab=10)
# 1e6 FLOP/s and 1e6 B/s at 100% efficiency: every number below is worked out by hand.
SLOW = GPUSpec("slow", memory_gb=1.0, peak_tflops=1e-6, hbm_gbps=1e-3, interconnect_gbps=1e-3)


def tiny_model(**kw) -> RooflineCostModel:
    return RooflineCostModel(TINY, SLOW, flops_efficiency=1.0, bw_efficiency=1.0, step_overhead_s=0.01, **kw)


def test_spec_arithmetic():
    assert TINY.layer_params == 2 * 10 * 10 + 2 * 10 * 10 + 3 * 10 * 10 == 700
    assert TINY.weight_bytes == (700 + 10 * 10) * 2 == 1600
    assert TINY.kv_bytes_per_token == 2 * 1 * 1 * 10 * 2 == 40
    # Llama-2-7B: 6.5e9 linear params in the layers + LM head is the published 6.7B total minus embeddings.
    assert MODELS["llama-2-7b"].linear_params == pytest.approx(6.48e9, rel=0.01)
    assert MODELS["llama-2-7b"].kv_bytes_per_token == 524288  # 0.5 MiB per token, the known figure


def test_prefill_chunk_is_compute_bound_by_hand():
    # 4-token chunk, nothing cached: attention units 4*0 + 4*5/2 = 10.
    # FLOPs = 2*700*4 + 2*10*10*1 + 4*1*10*10 = 6200 -> 6.2 ms; bytes 1600 -> 1.6 ms.
    t = tiny_model().time(StepBatch(tokens=4, sampled=1, prefill_attn_units=10, prefill_kv_read=0))
    assert t == pytest.approx(0.01 + 0.0062)


def test_decode_sum_versus_max_attention_by_hand():
    # Two decodes with contexts 10 and 30: sum reads 40 tokens, max reads 2 * 30 = 60 tokens.
    batch = StepBatch(tokens=2, sampled=2, num_decodes=2, decode_ctx_sum=40, decode_ctx_max=30)
    # q_dim = 10. FLOPs(sum) = 2*700*2 + 2*100*2 + 4*1*10*(40 + 2) = 2800 + 400 + 1680 = 4880
    # -> 4.88 ms, above the memory time (1600 + 40*40 bytes = 3.2 ms).
    assert tiny_model().time(batch) == pytest.approx(0.01 + 0.00488)
    # FLOPs(max) = 2800 + 400 + 4*10*(60 + 2) = 5680 -> 5.68 ms (memory 1600 + 40*60 = 4 ms).
    assert tiny_model(decode_attention="max").time(batch) == pytest.approx(0.01 + 0.00568)


def test_operator_overlap_adds_linear_and_attention_rooflines_by_hand():
    # Half the bandwidth (5e5 B/s) so that attention over a long context is memory-bound while the
    # GEMMs over 10 tokens stay compute-bound. Linear: 2*700*10 + 2*100*2 = 14,400 FLOPs -> 14.4 ms
    # vs 1,600 B of weights -> 3.2 ms. Attention: 4*10*(1000 + 2) = 40,080 FLOPs -> 40.08 ms vs
    # 40*1000 B of KV -> 80 ms. "operator" pays both: 14.4 + 80 ms. "step" hides the GEMMs under the
    # memory traffic: max(54.48 ms of FLOPs, 41,600 B -> 83.2 ms).
    half_bandwidth = GPUSpec("half", memory_gb=1.0, peak_tflops=1e-6, hbm_gbps=5e-4, interconnect_gbps=1e-3)
    batch = StepBatch(tokens=10, sampled=2, num_decodes=2, decode_ctx_sum=1000, decode_ctx_max=500)

    def model(**kw) -> RooflineCostModel:
        return RooflineCostModel(
            TINY, half_bandwidth, flops_efficiency=1.0, bw_efficiency=1.0, step_overhead_s=0.01, **kw
        )

    assert model(overlap="operator").time(batch) == pytest.approx(0.01 + 0.0144 + 0.080)
    assert model(overlap="step").time(batch) == pytest.approx(0.01 + 0.0832)
    assert model().overlap == "operator"  # the default, chosen by measurement (experiments.gpu_steps)
    with pytest.raises(ValueError, match="overlap"):
        model(overlap="both")


def test_decode_run_times_match_single_steps():
    model = roofline("llama-2-13b", "a100-80g")
    run = model.decode_run_times(num_decodes=3, context_sum=300, context_max=150, steps=5)
    for i, t in enumerate(run):
        one = model.time(StepBatch(3, 3, num_decodes=3, decode_ctx_sum=300 + 3 * i, decode_ctx_max=150 + i))
        assert t == pytest.approx(one)


def test_presets_are_physically_plausible():
    model = roofline("llama-2-13b", "a100-80g")
    decode_one = model.time(StepBatch(1, 1, num_decodes=1, decode_ctx_sum=1000, decode_ctx_max=1000))
    # 26 GB of weights at 80% of 2,039 GB/s is ~16 ms, plus 4 ms overhead.
    assert 0.018 < decode_one < 0.024
    assert 40_000 < model.kv_capacity_tokens() < 70_000
    with pytest.raises(ValueError, match="does not fit"):
        roofline("llama-3-70b", "a40").kv_capacity_tokens()
    tp4 = roofline("llama-3-70b", "a100-80g", tp=4)
    assert tp4.kv_capacity_tokens() > 0
    assert np.isfinite(tp4.time(StepBatch(512, 1, prefill_attn_units=512 * 256.5)))
    with pytest.raises(ValueError, match="unknown preset"):
        roofline("gpt-5", "a100-80g")
