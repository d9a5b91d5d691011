"""MiniLM in a child process (what a live engine uses): the same vectors as in-process, at the
lowest CPU priority, and a failed or dead child costs one batch, never the caller."""

from __future__ import annotations

import os

import numpy as np
import pytest

from predictors import embedding
from predictors.embedding_process import LOWEST_PRIORITY, EmbeddingProcess, EmbeddingProcessError

TEXTS = ["What is the capital of France?", "Summarise this article in three lines.", "hi"]


@pytest.mark.slow
def test_child_embeds_as_this_process_does_and_survives_failures():
    child = EmbeddingProcess()
    try:
        vectors = child.embed(TEXTS, batch_size=2)
        assert vectors.shape == (3, embedding.DIMENSION) and vectors.dtype == np.float32
        np.testing.assert_allclose(vectors, embedding.embed(TEXTS), atol=1e-5)
        pid = child._child.pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == LOWEST_PRIORITY

        with pytest.raises(EmbeddingProcessError, match="embedding process: "):
            child.embed([None], batch_size=2)  # the model raises in the child: reported, child lives
        assert child._child.pid == pid
        np.testing.assert_allclose(child.embed(TEXTS[:1], batch_size=2), vectors[:1], atol=1e-5)

        os.kill(pid, 9)  # a child that dies mid-serve
        with pytest.raises(EmbeddingProcessError, match="stopped"):
            child.embed(TEXTS, batch_size=2)
        np.testing.assert_allclose(child.embed(TEXTS, batch_size=2), vectors, atol=1e-5)  # a new child
        assert child._child.pid != pid
    finally:
        child.close()
    assert child._child is None


def test_the_module_sends_embeddings_to_the_child_once_switched(monkeypatch):
    calls = []

    class FakeChild:
        def start(self):
            calls.append("start")

        def embed(self, texts, batch_size):
            calls.append(list(texts))
            return np.ones((len(texts), embedding.DIMENSION), dtype=np.float32)

    monkeypatch.setattr(embedding, "_child", FakeChild())
    monkeypatch.setattr(embedding, "_model", lambda: pytest.fail("the model loaded in-process"))
    embedding.load_model()
    assert embedding.embed(["a", "b"]).shape == (2, embedding.DIMENSION)
    assert embedding.embed([]).shape == (0, embedding.DIMENSION)
    assert calls == ["start", ["a", "b"]]


def test_the_priority_is_the_lowest_unless_an_operator_sets_it(monkeypatch):
    from predictors.embedding_process import NICE_VARIABLE, configured_nice

    monkeypatch.delenv(NICE_VARIABLE, raising=False)
    assert configured_nice() == LOWEST_PRIORITY
    monkeypatch.setenv(NICE_VARIABLE, "5")
    assert configured_nice() == 5
    monkeypatch.setenv(NICE_VARIABLE, "low")
    with pytest.raises(ValueError, match=NICE_VARIABLE):
        configured_nice()
    with pytest.raises(ValueError, match=r"0\.\.19"):
        EmbeddingProcess(nice=20)


def test_cores_of_its_own_are_a_linux_cpu_list_of_this_machines_cores(monkeypatch):
    from predictors.embedding_process import CPUS_VARIABLE, configured_cpus

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv(CPUS_VARIABLE, raising=False)
    assert configured_cpus() is None
    for setting, cpus in [("1", {1}), (" 2-3,6 ", {2, 3, 6}), ("0-7", set(range(8)))]:
        monkeypatch.setenv(CPUS_VARIABLE, setting)
        assert configured_cpus() == cpus
    for setting in ["8", "one", "3-", "-1", ",", "3-2"]:
        monkeypatch.setenv(CPUS_VARIABLE, setting)
        with pytest.raises(ValueError, match=r"among 0-7"):
            configured_cpus()
    with pytest.raises(ValueError, match="at least one core"):
        EmbeddingProcess(cpus=frozenset())


def _stand_in_child(monkeypatch, after_ready: str) -> None:
    """Replace the child's command by a Python one-liner that says "ready" at once (no model
    loads), then runs `after_ready`."""
    import sys

    from predictors import embedding_process

    script = "import pickle, sys, time; pickle.dump('ready', sys.stdout.buffer); sys.stdout.flush()"
    script += f"; {after_ready}"
    monkeypatch.setattr(embedding_process, "_child_command", lambda nice: [sys.executable, "-c", script])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move the child to one")
def test_the_child_runs_on_the_cores_it_was_given(monkeypatch):
    _stand_in_child(monkeypatch, "time.sleep(30)")
    core = max(os.sched_getaffinity(0))
    child = EmbeddingProcess(cpus=frozenset({core}))
    try:
        child.start()
        assert os.sched_getaffinity(child._child.pid) == {core}
    finally:
        child.close()


def test_a_core_the_kernel_refuses_is_reported_and_not_retried(monkeypatch):
    from predictors.embedding_process import CPUS_VARIABLE

    _stand_in_child(monkeypatch, "time.sleep(30)")
    child = EmbeddingProcess(cpus=frozenset({os.cpu_count() + 64}))  # no such core
    with pytest.raises(EmbeddingProcessError, match=CPUS_VARIABLE):
        child.start()
    assert child._child is None
    with pytest.raises(EmbeddingProcessError, match="not retried"):
        child.start()


def test_close_stops_a_child_mid_batch_at_once_and_for_good(monkeypatch, tmp_path):
    """A stand-in child that marks the batch's arrival and never answers it: `close` must not
    wait for it, the caller blocked in `embed` gets an error, and no call starts another child."""
    import threading

    arrived = tmp_path / "batch-arrived"
    _stand_in_child(
        monkeypatch, f"pickle.load(sys.stdin.buffer); open({str(arrived)!r}, 'w'); time.sleep(60)"
    )
    child = EmbeddingProcess()
    child.start()
    errors = []

    def embed():
        try:
            child.embed(TEXTS, batch_size=2)
        except EmbeddingProcessError as error:
            errors.append(error)

    caller = threading.Thread(target=embed)
    caller.start()
    for _ in range(500):  # up to 10 s for the batch to reach the child
        if arrived.exists():
            break
        threading.Event().wait(0.02)
    assert arrived.exists()
    stopped = child._child
    child.close()
    caller.join(timeout=5)
    assert not caller.is_alive() and stopped.poll() is not None
    assert len(errors) == 1 and "closed" in str(errors[0])
    with pytest.raises(EmbeddingProcessError, match="closed"):
        child.embed(TEXTS, batch_size=2)
    assert child._child is None


def test_a_child_exits_once_its_parent_is_gone(monkeypatch):
    from predictors import embedding_process

    parents = iter([100, 100, 1])  # reparented to init on the third look
    monkeypatch.setattr(embedding_process.os, "getppid", lambda: next(parents))
    monkeypatch.setattr(embedding_process.time, "sleep", lambda s: None)
    exits = []
    monkeypatch.setattr(embedding_process.os, "_exit", exits.append)
    embedding_process._exit_when_orphaned(100)
    assert exits == [0]


@pytest.mark.parametrize(
    ("command", "error"),
    [(["/bin/false"], "stopped"), (["/bin/sleep", "5"], "not loaded after")],
)
def test_a_child_that_cannot_start_fails_fast_and_is_not_respawned_at_once(monkeypatch, command, error):
    """One that exits, or one that never says it is ready: engine start is not held for ever, and
    the batches after it are refused at once instead of each starting another interpreter."""
    from predictors import embedding_process

    monkeypatch.setattr(embedding_process, "START_TIMEOUT_S", 0.5)
    monkeypatch.setattr(embedding_process, "_child_command", lambda nice: command)
    child = EmbeddingProcess()
    with pytest.raises(EmbeddingProcessError, match=error):
        child.start()
    assert child._child is None
    monkeypatch.setattr(embedding_process, "_child_command", lambda nice: pytest.fail("respawned"))
    with pytest.raises(EmbeddingProcessError, match="not retried yet"):
        child.embed(["a"], batch_size=1)
