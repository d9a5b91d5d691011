"""Per-step batch time: an analytic roofline from public model and GPU specs.

A step's time is a fixed overhead plus the larger of its compute time and its memory time
(whichever resource the step saturates), plus tensor-parallel all-reduce time:

    compute = (2 * linear_params * tokens + 2 * hidden * vocab * sampled
               + 4 * layers * q_dim * attn_units) / (tp * peak_flops * flops_efficiency)
    memory  = (weight_bytes + kv_bytes_per_token * kv_read_tokens) / (tp * hbm_bw * bw_efficiency)
    comm    = 2 * layers * ring_allreduce(tokens * hidden * dtype_bytes)          (tp > 1)

That is `overlap="step"`: the whole step is one roofline, so a mixed batch's decode KV reads hide
under its GEMM compute. `overlap="operator"` (the default) takes the roofline of the linear layers
(GEMMs over every token: weights vs FLOPs) and of attention (KV reads vs FLOPs) separately and adds
them, because they are separate kernels that run one after the other on one stream -- the batch-time
model of the SLAI paper (section 3.2: linear time by token count plus one GeMV per decode) and of
Vidur (per-operator times summed). It charges decodes in a compute-bound mixed batch for their KV
reads, which the "step" form lets them have for free. It is the default because it is what a GPU
measures: on Llama-2-7B and Llama-3-8B steps timed on an H100 (`experiments.gpu_steps`), with each
form's constants fitted on pure prefill and pure decode steps, the operator form predicts the unseen
mixed steps at 5.5% / 7.2% mean error and the step form at 13.3% / 9.6%, too fast: a mixed step
takes 1.2-1.3x the longer of its two parts run alone.

`attn_units` is sum over prefill chunks of c * (p + c / 2) plus the decode contexts (one query
token each): the query-key and attention-value products, 2 FLOPs per multiply-add each.
`kv_read_tokens` is the KV read by attention: a chunk's earlier context p, a decode's context.

Decode attention can be "sum" (each sequence reads its own KV: the default, what paged attention
kernels do when work is split per sequence) or "max" (the batch is paced by its longest context:
every decode costs as much as the longest -- the effect JITServe's input-length window and EWSJF's
queues exploit; use it to study uneven batches).

The efficiencies and the overhead are assumptions, not measurements; a `cost-model` fitted to a
real engine's step log replaces this model when calibration matters.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Literal, get_args

import numpy as np

from adapt.steplog import StepBatch, attention_work

DecodeAttention = Literal["sum", "max"]
Overlap = Literal["step", "operator"]
OVERLAPS: tuple[str, ...] = get_args(Overlap)
DEFAULT_OVERLAP: Overlap = "operator"


@dataclass(frozen=True)
class ModelSpec:
    """Architecture figures from each model's public config.json on its model card."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    def splits_over(self, tp: int) -> bool:
        """vLLM's rule: the attention heads split evenly over the TP group, and the KV heads either
        split evenly or are replicated a whole number of times."""
        kv_ok = self.kv_heads % tp == 0 if tp <= self.kv_heads else tp % self.kv_heads == 0
        return self.heads % tp == 0 and kv_ok

    @property
    def layer_params(self) -> int:
        """Linear weights of one decoder layer: q,o (hidden x q_dim), k,v (hidden x kv_dim), and a
        gated MLP (3 x hidden x intermediate)."""
        kv_dim = self.kv_heads * self.head_dim
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * kv_dim + 3 * self.hidden * self.intermediate

    @property
    def linear_params(self) -> int:
        return self.layers * self.layer_params

    @property
    def weight_bytes(self) -> int:
        """Weights read every step: the decoder layers plus the LM head (embeddings are gathered)."""
        return (self.linear_params + self.hidden * self.vocab) * self.dtype_bytes

    @property
    def total_param_bytes(self) -> int:
        """Resident weights (input embeddings and LM head untied, as in all presets)."""
        return (self.linear_params + 2 * self.hidden * self.vocab) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class GPUSpec:
    """Dense BF16/FP16 tensor-core peak, memory bandwidth and capacity from vendor datasheets."""

    name: str
    memory_gb: float
    peak_tflops: float
    hbm_gbps: float
    interconnect_gbps: float


MODELS: dict[str, ModelSpec] = {
    # meta-llama/Llama-2-7b-hf config.json
    "llama-2-7b": ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000),
    # meta-llama/Llama-2-13b-hf config.json
    "llama-2-13b": ModelSpec("llama-2-13b", 40, 5120, 40, 40, 128, 13824, 32000),
    # meta-llama/Meta-Llama-3-8B config.json (grouped-query attention, 8 KV heads)
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    # mistralai/Mistral-7B-v0.1 config.json
    "mistral-7b": ModelSpec("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000),
    # meta-llama/Meta-Llama-3-70B config.json
    "llama-3-70b": ModelSpec("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
}

GPUS: dict[str, GPUSpec] = {
    # NVIDIA A100 80GB SXM datasheet: 312 TFLOPS BF16 dense, 2,039 GB/s, NVLink 600 GB/s
    "a100-80g": GPUSpec("a100-80g", 80, 312.0, 2039.0, 600.0),
    # NVIDIA H100 SXM5 80GB datasheet: 989 TFLOPS BF16 dense, 3,350 GB/s, NVLink 900 GB/s
    "h100-80g": GPUSpec("h100-80g", 80, 989.0, 3350.0, 900.0),
    # NVIDIA A40 datasheet: 149.7 TFLOPS BF16 dense, 696 GB/s, NVLink bridge 112.5 GB/s
    "a40": GPUSpec("a40", 48, 149.7, 696.0, 112.5),
    # NVIDIA RTX 6000 Ada datasheet: 364 TFLOPS FP16 dense (FP16 accumulate), 960 GB/s, PCIe 4 64 GB/s
    "rtx6000ada": GPUSpec("rtx6000ada", 48, 364.0, 960.0, 64.0),
}


@dataclass(frozen=True)
class RooflineCostModel:
    """Step time from specs. Defaults: 60% of peak FLOPs and 80% of peak bandwidth are what
    well-tuned kernels reach (vLLM/Sarathi-Serve report MFU 0.4-0.6 for prefill and MBU 0.7-0.85
    for decode); 4 ms of per-step scheduler/launch overhead at TP1 (assumed); 10 us per
    all-reduce launch (assumed); no intake time per arriving request (assumed negligible beside a
    GPU step; a `cost-model` fitted to a step log measures it)."""

    model: ModelSpec
    gpu: GPUSpec
    tp: int = 1
    flops_efficiency: float = 0.6
    bw_efficiency: float = 0.8
    step_overhead_s: float = 0.004
    allreduce_latency_s: float = 10e-6
    decode_attention: DecodeAttention = "sum"
    overlap: Overlap = DEFAULT_OVERLAP
    arrival_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp: must be >= 1, got {self.tp}")
        if self.decode_attention not in ("sum", "max"):
            raise ValueError(f"decode_attention: expected sum or max, got {self.decode_attention!r}")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"overlap: expected step or operator, got {self.overlap!r}")
        if not self.arrival_overhead_s >= 0:
            raise ValueError(f"arrival_overhead_s: must be >= 0, got {self.arrival_overhead_s}")

    def with_options(self, **changes: object) -> RooflineCostModel:
        return replace(self, **changes)

    @cached_property
    def _coefficients(self) -> tuple[float, float, int, float, float, float, int]:
        """(peak FLOP/s, bandwidth B/s, weight bytes, FLOPs per token, per sampled token, per
        attention unit, KV bytes per token): the products `time` multiplies by, grouped as it
        groups them, computed once (the engine times every step with them)."""
        m = self.model
        peak = self.tp * self.gpu.peak_tflops * 1e12 * self.flops_efficiency
        bandwidth = self.tp * self.gpu.hbm_gbps * 1e9 * self.bw_efficiency
        per_token, per_sample = 2.0 * m.linear_params, 2.0 * m.hidden * m.vocab
        return (
            peak,
            bandwidth,
            m.weight_bytes,
            per_token,
            per_sample,
            4.0 * m.layers * m.q_dim,
            m.kv_bytes_per_token,
        )

    def time(self, batch: StepBatch) -> np.ndarray | float:
        """Seconds for one step (or each of many steps when the fields are arrays)."""
        attn_units, kv_read = attention_work(batch, self.decode_attention)
        # One step's figures are scalars: Python's max (same value) costs a fraction of numpy's.
        ndarray = np.ndarray
        arrays = (
            isinstance(batch.tokens, ndarray)
            or isinstance(batch.sampled, ndarray)
            or isinstance(attn_units, ndarray)
            or isinstance(kv_read, ndarray)
        )
        return self._seconds(batch.tokens, batch.sampled, attn_units, kv_read, np.maximum if arrays else max)

    def _seconds(
        self,
        tokens: np.ndarray | float,
        sampled: np.ndarray | float,
        attn_units: np.ndarray | float,
        kv_read: np.ndarray | float,
        maximum: Callable[[Any, Any], Any],
    ) -> np.ndarray | float:
        """`time` from the step's token counts and attention work (scalars with `max`, or arrays
        with `np.maximum`)."""
        m = self.model
        peak, bandwidth, weight_bytes, per_token, per_sample, per_attention_unit, kv_per_token = (
            self._coefficients
        )
        linear_flops = per_token * tokens + per_sample * sampled
        attention_flops = per_attention_unit * attn_units
        kv_bytes = kv_per_token * kv_read
        if self.overlap == "operator":
            linear = maximum(linear_flops / peak, weight_bytes / bandwidth)
            attention = maximum(attention_flops / peak, kv_bytes / bandwidth)
            seconds = self.step_overhead_s + linear + attention
        else:
            flops = linear_flops + attention_flops
            seconds = self.step_overhead_s + maximum(flops / peak, (weight_bytes + kv_bytes) / bandwidth)
        if self.tp > 1:
            message = tokens * m.hidden * m.dtype_bytes
            ring = 2.0 * (self.tp - 1) / self.tp * message / (self.gpu.interconnect_gbps * 1e9)
            seconds = seconds + 2 * m.layers * (ring + self.allreduce_latency_s)
        return seconds

    def decode_run_times(
        self, num_decodes: int, context_sum: int, context_max: int, steps: int
    ) -> np.ndarray:
        """Times of `steps` consecutive decode-only steps of the same requests, each growing every
        context by one token per step (vectorised: the replay engine's fast path)."""
        batch = _decode_steps(num_decodes, context_sum, context_max, np.arange(steps, dtype=np.float64))
        return np.broadcast_to(self.time(batch), (steps,)).astype(np.float64)

    def decode_step_timer(
        self, num_decodes: int, context_sum: int, context_max: int
    ) -> Callable[[int], float]:
        """`decode_run_times(...)[step]` as a function of `step`, in Python floats: the same
        operations on the same values (IEEE doubles either way) as `time` of `_decode_steps` and
        `attention_work`, for the replay engine's short decode runs, where numpy's fixed cost per
        call would dominate. What a run's steps share -- under `overlap="operator"` the linear
        layers' time, the same at every step of it -- is computed once per run."""
        n = float(num_decodes)
        by_max = self.decode_attention == "max"
        if self.overlap != "operator" or self.tp > 1:

            def step_time(step: int) -> float:
                at = float(step)
                read = n * (context_max + at) if by_max else context_sum + num_decodes * at
                return float(self._seconds(n, n, 0.0 + read + n, 0.0 + read, max))

            return step_time
        peak, bandwidth, weight_bytes, per_token, per_sample, per_unit, kv_per_token = self._coefficients
        # `_seconds`' overhead + linear + attention, added left to right as it adds them.
        overhead_and_linear = self.step_overhead_s + max(
            (per_token * n + per_sample * n) / peak, weight_bytes / bandwidth
        )

        def operator_step_time(step: int) -> float:
            at = float(step)
            read = n * (context_max + at) if by_max else context_sum + num_decodes * at
            return overhead_and_linear + max(
                per_unit * (0.0 + read + n) / peak, kv_per_token * (0.0 + read) / bandwidth
            )

        return operator_step_time

    def kv_capacity_tokens(
        self, gpu_memory_utilization: float = 0.9, activation_reserve_gb: float = 2.0
    ) -> int:
        """KV-cache tokens that fit: the memory vLLM may use, minus weights and an activation
        reserve (per GPU), over the KV bytes of one token, summed over the TP group."""
        per_gpu = self.gpu.memory_gb * 1e9 * gpu_memory_utilization - activation_reserve_gb * 1e9
        free = self.tp * per_gpu - self.model.total_param_bytes
        if free <= 0:
            raise ValueError(
                f"{self.model.name} does not fit on {self.tp} x {self.gpu.name}: weights need "
                f"{self.model.total_param_bytes / 1e9:.1f} GB; raise tp"
            )
        return int(free // self.model.kv_bytes_per_token)


def _decode_steps(
    num_decodes: int, context_sum: int, context_max: int, step: float | np.ndarray
) -> StepBatch:
    """Decode-only step(s) `step` after the first (a float, or an array of them) of the same
    requests, each context grown by one token per step."""
    return StepBatch(
        tokens=float(num_decodes),
        sampled=float(num_decodes),
        num_decodes=float(num_decodes),
        decode_ctx_sum=context_sum + num_decodes * step,
        decode_ctx_max=context_max + step,
    )


def roofline(model: str, gpu: str, tp: int = 1, **options: object) -> RooflineCostModel:
    """The preset cost model for a model name and GPU name (see MODELS and GPUS)."""
    if model not in MODELS:
        raise ValueError(f"model: unknown preset {model!r}; expected one of {', '.join(MODELS)}")
    if gpu not in GPUS:
        raise ValueError(f"gpu: unknown preset {gpu!r}; expected one of {', '.join(GPUS)}")
    return RooflineCostModel(MODELS[model], GPUS[gpu], tp=tp, **options)  # type: ignore[arg-type]


def add_overlap_argument(
    parser: argparse.ArgumentParser,
    help: str = "roofline form: one per step, or linear and attention rooflines added (see cost.py)",
) -> None:
    """`--overlap`, the roofline form (`RooflineCostModel.overlap`), for every command that replays."""
    parser.add_argument("--overlap", choices=OVERLAPS, default=DEFAULT_OVERLAP, help=help)
