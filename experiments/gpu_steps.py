"""Step times of a real-size model on a real GPU, and which roofline form predicts them.

    python3 -m experiments.gpu_steps measure --out steps.csv     (on a CUDA machine; torch only)
    .venv/bin/python -m experiments.gpu_steps compare [--log CSV] [--json OUT]

The replay engine times a step with a roofline (`adapt.replay.cost`) in one of two forms: "step"
(one roofline over the whole step, so a mixed batch's decode KV reads hide under its GEMMs) or
"operator" (the linear layers' roofline plus attention's, added: separate kernels on one stream).
Which one is right is a question about hardware, so this answers it with hardware.

`measure` runs one decoder-only transformer step of a given shape -- a prefill chunk of P tokens
after p cached ones, plus D decodes of context C -- through a model with the public architecture of
Llama-2-7B and random bf16 weights: per layer RMSNorm, fused QKV GEMM, the new keys and values
written into a KV cache, attention over the cache (PyTorch SDPA: flash attention with a lower-right
causal mask for the chunk, one batched decode call), output GEMM, gated MLP; then the LM head over
the sampled rows. Each shape is captured in a CUDA graph and replayed, so `duration_s` is the GPU's
time for the step without Python launch overhead (vLLM also runs steps as CUDA graphs); the eager
time is recorded beside it. Rotary embeddings and sampling are left out (element-wise, small).
Prefill and decode attention are two kernels here; vLLM's unified attention kernel runs both in one
launch, so a mixed step's attention may overlap slightly more in vLLM than here.

`compare` fits each form's free constants (FLOP and bandwidth efficiency, per-step overhead) on the
prefill-only and decode-only steps and predicts the mixed steps it never saw -- the steps where the
two forms disagree -- and reports the error of each, of the preset constants, and of the linear
`cost-model` fitted the same way. The bundled logs (`experiments/data/`, Llama-2-7B and the
grouped-query Llama-3-8B) were measured on one H100 SXM 80GB (see that folder's README).
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from adapt.cli.usage import COUNT, OUTPUT, write_json

BUNDLED_LOGS = sorted((Path(__file__).parent / "data").glob("steps_h100_*.csv"))
SHAPE_COLUMNS: tuple[str, ...] = ("prefill_tokens", "prefill_cached", "decodes", "decode_context")


@dataclass(frozen=True)
class Shape:
    """One step: a prefill chunk of `prefill_tokens` after `prefill_cached` cached tokens (none when
    0) plus `decodes` decodes, each of `decode_context` cached tokens."""

    prefill_tokens: int
    prefill_cached: int
    decodes: int
    decode_context: int

    @property
    def kind(self) -> str:
        if self.prefill_tokens and self.decodes:
            return "mixed"
        return "prefill" if self.prefill_tokens else "decode"

    def work(self) -> list[tuple[int, int, bool, bool]]:
        """The (tokens, cached, is_decode, samples) list `adapt.steplog.step_batch` takes; the chunk
        is taken to be a prompt's last, so it samples."""
        work = [(1, self.decode_context, True, True)] * self.decodes
        if self.prefill_tokens:
            work.append((self.prefill_tokens, self.prefill_cached, False, True))
        return work


def default_shapes(pool_tokens: int) -> list[Shape]:
    """Prefill-only and decode-only steps to fit on, and mixed steps to test on, each within a
    per-layer KV pool of `pool_tokens` tokens."""
    shapes = [
        Shape(p, cached, 0, 0) for p in (64, 256, 512, 1024, 2048, 4096, 8192) for cached in (0, 1024, 4096)
    ]
    shapes += [Shape(0, 0, d, c) for d in (1, 4, 16, 32, 64, 128, 256) for c in (128, 512, 1024, 2048, 4096)]
    shapes += [
        Shape(p, cached, d, c)
        for p in (128, 512, 2048)
        for cached in (0, 1024)
        for d in (8, 32, 128)
        for c in (512, 2048)
    ]
    return [
        s
        for s in shapes
        if s.prefill_cached + s.prefill_tokens + s.decodes * (s.decode_context + 1) <= pool_tokens
    ]


class RandomLlama:
    """A decoder with Llama's layer structure and random weights; `step(shape)` returns a function
    that runs one step of that shape on static inputs (so it can be captured in a CUDA graph)."""

    def __init__(self, spec, device: str, dtype, pool_tokens: int) -> None:
        import torch

        self.torch = torch
        self.spec = spec
        self.device = device
        self.dtype = dtype
        kv_dim = spec.kv_heads * spec.head_dim

        def weight(rows: int, cols: int):
            return torch.randn(rows, cols, device=device, dtype=dtype) * 0.02

        self.layers = [
            {
                "qkv": weight(spec.hidden, spec.q_dim + 2 * kv_dim),
                "o": weight(spec.q_dim, spec.hidden),
                "gate_up": weight(spec.hidden, 2 * spec.intermediate),
                "down": weight(spec.intermediate, spec.hidden),
                # Keys and values of `pool_tokens` tokens, each layer its own (as in a real cache).
                "k": torch.zeros(pool_tokens * kv_dim, device=device, dtype=dtype),
                "v": torch.zeros(pool_tokens * kv_dim, device=device, dtype=dtype),
            }
            for _ in range(spec.layers)
        ]
        self.lm_head = weight(spec.hidden, spec.vocab)

    def step(self, shape: Shape):
        torch = self.torch
        from torch.nn.attention.bias import causal_lower_right
        from torch.nn.functional import rms_norm, scaled_dot_product_attention, silu

        s = self.spec
        kv_dim = s.kv_heads * s.head_dim
        P, p, D, C = shape.prefill_tokens, shape.prefill_cached, shape.decodes, shape.decode_context
        T = P + D
        x0 = torch.randn(T, s.hidden, device=self.device, dtype=self.dtype)
        sampled = torch.arange(
            P - 1 if P else 0, T, device=self.device
        )  # the chunk's last token, the decodes
        prefill_len = p + P
        mask = causal_lower_right(P, prefill_len) if P else None
        groups = s.heads // s.kv_heads

        def views(layer: dict, name: str):
            """The layer's cache as [1, kv_heads, p + P, d] for the chunk and [D, kv_heads, C + 1, d]
            for the decodes, in disjoint parts of its pool."""
            pool = layer[name]
            chunk = pool[: prefill_len * kv_dim].view(1, s.kv_heads, prefill_len, s.head_dim)
            start = prefill_len * kv_dim
            dec = pool[start : start + D * (C + 1) * kv_dim].view(D, s.kv_heads, C + 1, s.head_dim)
            return chunk, dec

        caches = [(views(layer, "k"), views(layer, "v")) for layer in self.layers]

        def run():
            x = x0
            for layer, ((k_chunk, k_dec), (v_chunk, v_dec)) in zip(self.layers, caches, strict=True):
                h = rms_norm(x, (s.hidden,))
                qkv = h @ layer["qkv"]
                q, k, v = qkv.split((s.q_dim, kv_dim, kv_dim), dim=-1)
                q = q.view(T, s.heads, s.head_dim)
                k = k.view(T, s.kv_heads, s.head_dim)
                v = v.view(T, s.kv_heads, s.head_dim)
                outputs = []
                if P:
                    k_chunk[0, :, p:].copy_(k[:P].transpose(0, 1))
                    v_chunk[0, :, p:].copy_(v[:P].transpose(0, 1))
                    out = scaled_dot_product_attention(
                        q[:P].transpose(0, 1).unsqueeze(0),
                        k_chunk,
                        v_chunk,
                        attn_mask=mask,
                        enable_gqa=groups > 1,
                    )
                    outputs.append(out[0].transpose(0, 1).reshape(P, s.q_dim))
                if D:
                    k_dec[:, :, C].copy_(k[P:])
                    v_dec[:, :, C].copy_(v[P:])
                    out = scaled_dot_product_attention(
                        q[P:].unsqueeze(2), k_dec, v_dec, enable_gqa=groups > 1
                    )
                    outputs.append(out.reshape(D, s.q_dim))
                attn = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
                x = x + attn @ layer["o"]
                gate, up = (rms_norm(x, (s.hidden,)) @ layer["gate_up"]).chunk(2, dim=-1)
                x = x + (silu(gate) * up) @ layer["down"]
            return rms_norm(x[sampled], (s.hidden,)) @ self.lm_head

        return run


def _time_cuda(fn, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs, timed by CUDA events."""
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(out: Path, model: str, pool_tokens: int, repeats: int) -> None:
    import torch

    from adapt.replay.cost import MODELS
    from adapt.steplog import STEP_FIELDS, step_batch

    if not torch.cuda.is_available():
        sys.exit("measure: needs a CUDA GPU (this machine has none)")
    spec = MODELS[model]
    torch.manual_seed(0)
    engine = RandomLlama(spec, "cuda", torch.bfloat16, pool_tokens)
    gpu = torch.cuda.get_device_name()
    shapes = default_shapes(pool_tokens)
    print(
        f"{model} (random bf16 weights) on {gpu}: {len(shapes)} step shapes, median of {repeats}", flush=True
    )
    rows = []
    began = time.perf_counter()
    with torch.inference_mode():
        for i, shape in enumerate(shapes, 1):
            run = engine.step(shape)
            for _ in range(3):
                run()
            eager = _time_cuda(run, repeats)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run()
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                run()
            graph.replay()
            duration = _time_cuda(graph.replay, repeats)
            del graph
            row = {**step_batch(shape.work()).as_row(), "duration_s": duration}
            rows.append(
                {
                    **{c: getattr(shape, c) for c in SHAPE_COLUMNS},
                    **row,
                    "eager_s": eager,
                    "gpu": gpu,
                    "model": model,
                }
            )
            print(
                f"[{i}/{len(shapes)}] {shape.kind:<7} P={shape.prefill_tokens} p={shape.prefill_cached}"
                f" D={shape.decodes} C={shape.decode_context}: graph {duration * 1e3:.3f} ms,"
                f" eager {eager * 1e3:.3f} ms ({time.perf_counter() - began:.0f} s)",
                flush=True,
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(
            f,
            fieldnames=[*SHAPE_COLUMNS, *STEP_FIELDS, "duration_s", "eager_s", "gpu", "model"],
            lineterminator="\n",
        )
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} steps to {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("measure", help="time step shapes on this machine's GPU")
    run.add_argument("--out", type=OUTPUT, required=True, help="step log CSV to write")
    run.add_argument("--model", default="llama-2-7b", help="architecture preset (adapt.replay.cost.MODELS)")
    run.add_argument("--pool-tokens", type=COUNT, default=80_000, help="KV tokens per layer to allocate")
    run.add_argument("--repeats", type=COUNT, default=20, help="timed runs per shape (median kept)")
    cmp = commands.add_parser("compare", help="which roofline form predicts the measured mixed steps")
    cmp.add_argument(
        "--log", type=Path, action="append", help="step log written by measure (default: the bundled ones)"
    )
    cmp.add_argument(
        "--gpu", default="h100-80g", help="GPU preset the log was measured on (adapt.replay.cost.GPUS)"
    )
    cmp.add_argument("--json", type=OUTPUT, help="write the comparison here")
    args = parser.parse_args(argv)
    if args.command == "measure":
        measure(args.out, args.model, args.pool_tokens, args.repeats)
    else:
        from experiments.cost_forms import compare_forms, print_comparison

        results = [compare_forms(log, args.gpu) for log in args.log or BUNDLED_LOGS]
        for result in results:
            print_comparison(result)
        if args.json is not None:
            write_json(args.json, results, default=_finite)


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"not JSON serialisable: {value!r}")


if __name__ == "__main__":
    main()
