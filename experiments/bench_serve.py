"""Load generator: replay a workload against a running OpenAI-compatible server (`adapt serve`,
or any vLLM) and measure TTFT, TBT and end-to-end latency on the client side.

    .venv/bin/python -m experiments.bench_serve --url http://127.0.0.1:8000 --model MODEL
        [--workload jitserve-mix | --trace FILE] [--num-requests 50] [--rate 2.0]
        [--max-prompt-words 200] [--max-tokens 64] [--json OUT]

Requests keep their arrival times (time-scaled to --rate), their SLO and program travel as
`vllm_xargs`, prompts are the trace's text (or that many filler words), and responses stream, so
every token's arrival is timed. Compound calls are sent when their parents' responses are in.
A tiny CPU model cannot hold real lengths: --max-prompt-words and --max-tokens cap them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adapt.cli.usage import COUNT, OUTPUT, RATE, SEED, write_json
from adapt.requests import Request


@dataclass
class ClientRecord:
    request_id: str
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)


def xargs_for(request: Request) -> dict[str, Any]:
    slo, xargs = request.slo, {}
    if slo.kind != "best_effort":
        xargs["slo_kind"] = slo.kind
    for name in ("ttft_s", "tbt_s", "deadline_s", "tier"):
        if getattr(slo, name) is not None:
            xargs[name] = getattr(slo, name)
    if request.program is not None:
        xargs.update(program_id=request.program.program_id, stage=request.program.stage)
    return xargs


def prompt_for(request: Request, max_words: int | None) -> str | list[int]:
    """What to send as the prompt: the request's text (or a word per token) cut to `max_words`
    words; with `max_words` None, exactly `prompt_tokens` token ids, so the engine sees the trace's
    length whatever the tokenizer (ids from a range every vocabulary has, drawn per request so no
    two prompts share a cached prefix)."""
    if max_words is None:
        rng = np.random.default_rng(zlib.crc32(request.request_id.encode()))
        return rng.integers(5, 500, size=request.prompt_tokens).tolist()
    words = (request.prompt_text or "word " * request.prompt_tokens).split()[:max_words]
    return " ".join(words) or "hello"


async def _send(client, model: str, request: Request, max_words: int | None, max_tokens: int) -> ClientRecord:
    record = ClientRecord(request.request_id)
    prompt = prompt_for(request, max_words)
    start = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max(1, min(request.output_tokens, max_tokens)),
            stream=True,
            extra_body={"vllm_xargs": xargs_for(request), "ignore_eos": True},
        )
        async for _ in stream:
            now = time.perf_counter()
            if record.ttft_s is None:
                record.ttft_s = now - start
            else:
                record.gaps_s.append(now - last)
            last = now
        record.e2e_s = time.perf_counter() - start
        record.ok = True
    except Exception as exc:  # reported per request, never raised: the run goes on
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def run_load(
    url: str, model: str, requests: list[Request], max_words: int | None, max_tokens: int
) -> list[ClientRecord]:
    """Send every request at its arrival time (dependants after their parents finish); prompts as
    `prompt_for` makes them."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="adapt")
    done: dict[str, asyncio.Event] = {r.request_id: asyncio.Event() for r in requests}
    began = time.perf_counter()

    async def one(request: Request) -> ClientRecord:
        parents = request.program.parent_ids if request.program is not None else ()
        if parents:
            for parent in parents:
                await done[parent].wait()
            await asyncio.sleep(request.program.after_parents_s)  # type: ignore[union-attr]
        else:
            await asyncio.sleep(max(0.0, request.arrival_s - (time.perf_counter() - began)))
        record = await _send(client, model, request, max_words, max_tokens)
        done[request.request_id].set()
        return record

    try:
        return list(await asyncio.gather(*(one(r) for r in requests)))
    finally:
        await client.close()  # inside the loop: closed by the collector after it, it raises


def summarise(records: list[ClientRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]

    def pct(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "tbt_p50": pct(gaps, 50),
        "tbt_p99": pct(gaps, 99),
        "e2e_mean": float(np.mean(e2e)) if e2e else None,
        "e2e_p99": pct(e2e, 99),
    }


def load_requests(args: argparse.Namespace) -> list[Request]:
    if args.trace:
        from adapt.traces import load_trace
        from adapt.workloads.builders import build_requests, poisson_arrivals, scale_to_rate

        trace = load_trace(args.trace).head(args.num_requests)
        rng = np.random.default_rng(args.seed)
        arrivals = (
            poisson_arrivals(len(trace), args.rate, rng)
            if trace.arrival_s is None
            else scale_to_rate(trace.arrival_s, args.rate)
        )
        return build_requests(trace, arrivals)
    from adapt.workloads import get_workload

    return get_workload(args.workload).build(args.rate, args.num_requests, args.seed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--workload", default="jitserve-mix")
    source.add_argument("--trace")
    parser.add_argument("--num-requests", type=COUNT, default=50)
    parser.add_argument("--rate", type=RATE, default=2.0)
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument("--max-prompt-words", type=COUNT, default=200)
    parser.add_argument("--max-tokens", type=COUNT, default=64)
    parser.add_argument("--json", dest="json_out", type=OUTPUT)
    args = parser.parse_args(argv)
    requests = load_requests(args)
    records = asyncio.run(run_load(args.url, args.model, requests, args.max_prompt_words, args.max_tokens))
    summary = summarise(records)
    print(json.dumps(summary, indent=2))
    if args.json_out is not None:
        write_json(args.json_out, {"summary": summary, "records": [r.__dict__ for r in records]})


if __name__ == "__main__":
    main()
