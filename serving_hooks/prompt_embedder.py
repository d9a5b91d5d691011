"""Prompt embeddings computed in vLLM's API-server process, before a request reaches the engine
(`adapt serve --embed-prompts`).

Why: the engine's background worker (`adapt.predictions`) hands an embedding over only after the
request has waited as long as MiniLM takes. On a CPU that is tens of milliseconds against 2 ms
engine steps, so a request that is not queued behind others was first scheduled on its prior, every
time. Here the HTTP middleware (`serving_hooks.http`) holds each generation request until its
prompt is embedded, then sends the vector along in `vllm_xargs.adapt_embedding`. The policy's first
decision then uses it (`RequestState.prompt_embedding`), and the request's TTFT grows by that wait.
On a GPU node this process's CPU cores are otherwise mostly idle.

What it embeds: a completion's `prompt` (a string, or a list holding one), a chat's message texts
joined by newlines (not the chat template's rendering, which the engine would embed).

Bounded, and never blocking indefinitely: until the model has loaded (it starts loading at the
server's first request, after vLLM has started its engine process), beyond `max_waiting` prompts
waiting, after `timeout_s` waiting for its vector, and where embedding fails, a request goes on
without a vector. The engine's worker then embeds it, as without this option. Prompts that arrive
together are embedded in one batch. Where the server checks API keys (`--api-key`, or
`VLLM_API_KEY`), a request without a valid one is not embedded (`serving_hooks.http.authorized`):
vLLM refuses it after this layer.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

ENABLED_ENV = "ADAPT_EMBED_PROMPTS"
MAX_WAITING_ENV = "ADAPT_EMBED_PROMPTS_MAX_WAITING"
THREADS_ENV = "ADAPT_EMBED_PROMPTS_THREADS"
TIMEOUT_ENV = "ADAPT_EMBED_PROMPTS_TIMEOUT_S"
DEFAULT_MAX_WAITING = 256
DEFAULT_TIMEOUT_S = 2.0


def prompt_text(body: dict[str, Any]) -> str | None:
    """The text to embed from an OpenAI completion or chat request body (None: nothing to embed,
    e.g. a prompt of token ids or several prompts)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt or None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    texts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):  # content parts: only the text ones
            texts.extend(
                part["text"]
                for part in content
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            )
    return "\n".join(texts) or None


def _embed_with_cache(texts: list[str]) -> np.ndarray:
    from predictors.embedding import shared_cache

    return shared_cache().embed(texts)


def _load() -> None:
    """Load MiniLM for this process, on `ADAPT_EMBED_PROMPTS_THREADS` torch threads (default 1).
    Measured on the 2-core machine at 8 req/s (`experiments.bench_embed_placement`, medians of 3
    rounds), torch's default of a thread per core contended with vLLM's own threads on those
    cores: TTFT p50 95 ms and E2E mean 0.67 s, against 37 ms and 0.27 s on one thread (the API
    server uses torch for nothing else)."""
    import torch

    from predictors.embedding import load_model

    threads = _setting(THREADS_ENV, int, 1)
    if threads < 1:
        raise ValueError(f"{THREADS_ENV}: must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    load_model()


class PromptEmbedder:
    """Embeds prompts for the middleware, batching those that wait together, in one thread.

    `embed` (texts -> unit vectors) and `load` are the model's; a test passes its own."""

    def __init__(
        self,
        max_waiting: int = DEFAULT_MAX_WAITING,
        embed: Callable[[list[str]], np.ndarray] = _embed_with_cache,
        load: Callable[[], None] = _load,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if max_waiting < 1:
            raise ValueError(f"{MAX_WAITING_ENV}: must be >= 1, got {max_waiting}")
        if not timeout_s > 0:
            raise ValueError(f"{TIMEOUT_ENV}: must be > 0, got {timeout_s}")
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._embed = embed
        self._load = load
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapt-embed-prompts")
        self._loaded: Future | None = None
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._waiting = 0
        self._batcher: asyncio.Task | None = None
        self.embedded = 0
        self.passed_through = 0  # went on without a vector: model not ready, too many waiting, no text
        self.timed_out = 0
        self.failed = 0
        # Time requests were held here waiting for a vector (however that ended): what a replay
        # of this server charges as `EngineConfig.intake_delay_s` (`adapt replay --intake-delay`).
        self.held = 0
        self.held_s = 0.0

    def start(self) -> None:
        """Start loading the model (in the embedding thread), once."""
        if self._loaded is None:
            self._loaded = self._executor.submit(self._load)

    @property
    def ready(self) -> bool:
        loaded = self._loaded
        return loaded is not None and loaded.done() and loaded.exception() is None

    def summary(self) -> dict[str, Any]:
        """What it did, for `GET /v1/adapt/status`."""
        loaded = self._loaded
        error = loaded.exception() if loaded is not None and loaded.done() else None
        return {
            "ready": self.ready,
            "load_error": None if error is None else f"{type(error).__name__}: {error}",
            "embedded": self.embedded,
            "passed_through": self.passed_through,
            "timed_out": self.timed_out,
            "failed": self.failed,
            "waiting": self._waiting,
            "mean_wait_s": self.held_s / self.held if self.held else None,
        }

    async def vector(self, text: str | None) -> np.ndarray | None:
        """`text`'s unit vector, or None where the request goes on without one (see the module)."""
        self.start()
        if not text or not self.ready or self._waiting >= self.max_waiting:
            self.passed_through += 1
            return None
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((text, future))
        self._waiting += 1
        held_at = loop.time()
        if self._batcher is None or self._batcher.done():
            self._batcher = loop.create_task(self._run())
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            self.timed_out += 1
            future.cancel()  # not embedded if its batch has not begun: no one waits for it any more
            return None
        finally:
            self._waiting -= 1
            self.held += 1
            self.held_s += loop.time() - held_at

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            # Prompts whose requests gave up waiting are left out: embedding them anyway made
            # the queue grow past `max_waiting` once a batch took longer than the timeout.
            batch = [(text, future) for text, future in self._pending if not future.done()]
            self._pending = []
            if not batch:
                continue
            results: list[np.ndarray | None] = [None] * len(batch)
            try:
                vectors = await loop.run_in_executor(self._executor, self._embed, [text for text, _ in batch])
                if len(vectors) != len(batch):
                    raise ValueError(f"{len(vectors)} vectors for {len(batch)} prompts")
                results = list(vectors)
                self.embedded += len(batch)
            except Exception:
                log.exception("API server: embedding %d prompts failed; the engine embeds them", len(batch))
                self.failed += len(batch)
            finally:  # every wait ends, whatever happened (a cancelled one is already done)
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


_embedder: PromptEmbedder | None = None


def configured_embedder() -> PromptEmbedder | None:
    """The process's embedder where `ADAPT_EMBED_PROMPTS=1` (set by `adapt serve --embed-prompts`),
    created on first use; None otherwise."""
    global _embedder
    if os.environ.get(ENABLED_ENV) != "1":
        return None
    if _embedder is None:
        _embedder = PromptEmbedder(
            _setting(MAX_WAITING_ENV, int, DEFAULT_MAX_WAITING),
            timeout_s=_setting(TIMEOUT_ENV, float, DEFAULT_TIMEOUT_S),
        )
    return _embedder


def _setting(name: str, kind: type, default: Any) -> Any:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(
            f"{name}: expected {'an integer' if kind is int else 'a number'}, got {raw!r}"
        ) from None
