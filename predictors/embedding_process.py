"""MiniLM in a child process, for a live engine: at the lowest CPU priority, or on cores of its own.

Why not a thread of the engine's process: the encoder's Python work (tokenising, dispatching
hundreds of small torch ops per batch) holds the GIL that vLLM's engine loop needs between its own
ops, and a thread cannot give the engine priority over itself. A child process shares no GIL.

Where it runs matters more than the GIL on a CPU engine (`experiments.bench_throughput`, 768 x 128
tokens, 2 cores, re-measured 2026-11-25): sharing both cores with vLLM at nice 19 the child held
sagesched at 0.29 (0.27-0.48) of vLLM's default -- lower than the embedding thread's 0.54
(0.43-0.54): vLLM's CPU forward runs OpenMP regions on both cores, and a busy neighbour on either,
even a niced one, stretches every region. (An earlier measurement of 0.93 for the shared child did
not reproduce.) `ADAPT_EMBEDDING_CPUS` gives the child cores of its own, the engine kept off them
by the operator (`taskset`; vLLM's `VLLM_CPU_OMP_THREADS_BIND` did not restrict an in-process
engine here): with the engine on one core and MiniLM on the other, sagesched ran at 0.88 of vLLM's
default on the same one core, fcfs 0.92 in the same rounds -- the trade is the core, not the
engine's speed. On a GPU node the engine's process uses about one core and the spare ones are the
natural place for the child.

Protocol: pickled objects over the child's stdin and a duplicate of its stdout (anything a library
prints goes to stderr, so it cannot corrupt a reply). The child first sends "ready" once the model
is loaded, then answers each `(texts, batch_size)` with an array or `("error", message)`. The
engine kills it at shutdown, even mid-batch; it exits by itself when its stdin closes or its parent
is gone (within a second, even mid-batch), and it sits in its own session, so a terminal's Ctrl-C
stops the engine, which stops it. It sees no GPU: on a GPU node it would otherwise put a second
CUDA context and its memory beside vLLM's, outside vLLM's budget, and nice does not order GPU work.
Pickle is safe here: both ends are this package, talking over a pipe no one else holds. The
priority is relative: nice 19 adds 19 to the engine's own niceness (capped at 19).
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)

LOWEST_PRIORITY = 19
START_TIMEOUT_S = 300.0  # loading MiniLM takes ~10 s; a starved or hung child must not hold engine start
RETRY_AFTER_S = 60.0  # after a child failed to start, batches are refused this long, not each respawned
NICE_VARIABLE = "ADAPT_EMBEDDING_NICE"  # an operator's trade: 0 shares the CPU with the engine evenly
CPUS_VARIABLE = "ADAPT_EMBEDDING_CPUS"  # cores of its own, e.g. "1" or "2-3,6" (Linux CPU-list syntax)


class EmbeddingProcessError(RuntimeError):
    """The child could not embed a batch: it raised (it keeps serving), or it exited or never started
    (a later call starts a new one)."""


class EmbeddingProcess:
    """One child running `predictors.embedding`'s encoder; `embed` blocks the calling thread (not
    the GIL) until the vectors come back. Started on first use or by `start`; thread-safe."""

    def __init__(self, nice: int = LOWEST_PRIORITY, cpus: frozenset[int] | None = None) -> None:
        """`cpus`: the cores the child may run on (None: the engine's); the engine's own threads
        should then be kept off them (e.g. `taskset`)."""
        if not 0 <= nice <= LOWEST_PRIORITY:
            raise ValueError(f"embedding process: nice must be 0..{LOWEST_PRIORITY}, got {nice}")
        if cpus is not None and not cpus:
            raise ValueError("embedding process: cpus must name at least one core")
        self.nice = nice
        self.cpus = cpus
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._retry_at = 0.0  # monotonic time before which a failed start is not tried again
        self._closed = False

    def start(self) -> None:
        """Start the child if none runs and wait until its model is loaded (~10 s on 2 cores)."""
        with self._lock:
            self._start()

    def embed(self, texts: Sequence[str], batch_size: int) -> np.ndarray:
        with self._lock:
            child = self._start()
            try:
                pickle.dump((list(texts), batch_size), child.stdin)
                child.stdin.flush()
                reply = pickle.load(child.stdout)
            except (OSError, EOFError, pickle.UnpicklingError) as error:
                raise self._lost(error) from error
        if isinstance(reply, tuple):
            raise EmbeddingProcessError(f"embedding process: {reply[1]}")
        return reply

    def close(self) -> None:
        """Stop the child now, even mid-batch or mid-load (its vectors are of no use to an engine
        shutting down): an `embed` in flight raises at once instead of holding shutdown for the
        batch, and every later call raises (never starts another child)."""
        self._closed = True  # not under the lock: an `embed` in flight holds it
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()

    def _start(self) -> subprocess.Popen[bytes]:
        if self._closed:
            raise EmbeddingProcessError("embedding process: closed")
        child = self._child
        if child is not None and child.poll() is None:
            return child
        if time.monotonic() < self._retry_at:
            raise EmbeddingProcessError("embedding process: failed to start; not retried yet")
        command = _child_command(self.nice)
        # One thread: a parallel region waits for its slowest thread, and at the lowest priority
        # a second thread on a core the engine is using would hold every region up.
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environment, start_new_session=True
        )
        self._child = child  # from here `close` can stop it, even while its model loads
        try:
            self._place(child)
            readable, _, _ = select.select([child.stdout], [], [], START_TIMEOUT_S)
            if not readable:
                raise TimeoutError(f"model not loaded after {START_TIMEOUT_S:.0f} s")
            ready = pickle.load(child.stdout)
            if ready != "ready":
                raise ValueError(f"unexpected first reply {ready!r}")
            if self._closed:
                raise EmbeddingProcessError("embedding process: closed while its model loaded")
        except (OSError, EOFError, pickle.UnpicklingError, ValueError) as error:
            self._retry_at = time.monotonic() + RETRY_AFTER_S
            raise self._lost(error) from error
        except BaseException:  # never leave a child that has not said "ready" as the one to use
            self._lost(None)
            raise
        where = "the engine's cores" if self.cpus is None else f"cores {sorted(self.cpus)}"
        log.info("embedding process %d: model loaded, running at nice %d on %s", child.pid, self.nice, where)
        return child

    def _place(self, child: subprocess.Popen[bytes]) -> None:
        """Move the child to its own cores. A core the kernel refuses (offline, or outside this
        container's set) is a setting to correct, not a failure a restart would mend: no retry."""
        if self.cpus is None:
            return
        try:
            os.sched_setaffinity(child.pid, self.cpus)
        except OSError as error:
            self._retry_at = math.inf
            raise EmbeddingProcessError(
                f"{CPUS_VARIABLE}: cannot run the embedding process on cores {sorted(self.cpus)}: {error}"
            ) from error

    def _lost(self, cause: BaseException | None) -> EmbeddingProcessError:
        """Reap a child that stopped answering (or that `close` stopped); the next call starts
        another unless closed."""
        child, self._child = self._child, None
        code = None
        if child is not None:
            child.kill()
            code = child.wait()
        if self._closed:
            return EmbeddingProcessError("embedding process: closed")
        return EmbeddingProcessError(
            f"embedding process stopped (exit code {code}: {cause!r}); its stderr is above; "
            "a later batch starts a new one"
        )


def _child_command(nice: int) -> list[str]:
    """The child's command line: its priority, and this process's id (the parent it watches)."""
    return [sys.executable, "-m", "predictors.embedding_process", str(nice), str(os.getpid())]


def configured_nice() -> int:
    """`ADAPT_EMBEDDING_NICE` (0..19) when set, else the lowest priority. Where the engine keeps
    every core busy (vLLM's CPU backend spins its OpenMP threads), 19 leaves almost every request
    on its prior; a smaller value buys predictions with engine throughput."""
    setting = os.environ.get(NICE_VARIABLE, "").strip()
    if not setting:
        return LOWEST_PRIORITY
    try:
        nice = int(setting)
    except ValueError:
        nice = -1
    if not 0 <= nice <= LOWEST_PRIORITY:
        raise ValueError(f"{NICE_VARIABLE}: expected 0..{LOWEST_PRIORITY}, got {setting!r}")
    return nice


def configured_cpus() -> frozenset[int] | None:
    """`ADAPT_EMBEDDING_CPUS` as a set of cores (a Linux CPU list: "1", "2-3,6"), else None. Where
    an engine keeps every core it runs on busy, cores of the embedder's own are the one way it gets
    predictions in time without slowing the engine -- at the price of those cores."""
    setting = os.environ.get(CPUS_VARIABLE, "").strip()
    if not setting:
        return None
    cpus: set[int] = set()
    for part in setting.split(","):
        bounds = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        first, last = (int(bounds[1]), int(bounds[2] or bounds[1])) if bounds else (1, 0)
        if first > last:  # malformed, or a reversed range
            cpus = set()
            break
        cpus.update(range(first, last + 1))
    # The machine's cores, not this thread's: the engine may have bound its own threads elsewhere.
    count = os.cpu_count() or 1
    if not cpus or not cpus <= set(range(count)):
        raise ValueError(
            f"{CPUS_VARIABLE}: expected cores among 0-{count - 1} such as '1' or '2-3,6', got {setting!r}"
        )
    return frozenset(cpus)


def _exit_when_orphaned(parent: int, every_s: float = 1.0) -> None:
    """Exit once `parent` is gone (a killed engine cannot close the pipe in an orderly way, and a
    batch of hundreds of prompts would otherwise go on taking a core for tens of seconds)."""
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(0)


def _serve(nice: int, parent: int) -> None:
    """The child's loop: load the model, then answer batches until stdin closes."""
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a library's print lands in stderr, never inside a reply
    requests = os.fdopen(0, "rb")
    os.nice(nice)
    from predictors import embedding

    embedding.load_model()
    pickle.dump("ready", replies)
    replies.flush()
    while True:
        try:
            texts, batch_size = pickle.load(requests)
        except EOFError:
            return
        try:
            reply: object = embedding.embed(texts, batch_size)
        except Exception as error:  # reported to the engine, which keeps the requests on their prior
            reply = ("error", f"{type(error).__name__}: {error}")
        try:
            pickle.dump(reply, replies)
            replies.flush()
        except BrokenPipeError:  # the engine is gone
            return


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
