"""Independent cells on every core: one function mapped over picklable items in a process pool.

Replay is pure Python and single-threaded, so the way to use a machine's cores is to run
independent replays (policy x workload x rate x seed, or a batch of Optuna trials) side by side.
`run_cells` is that one mechanism: results come back in the order of the items whatever order the
workers finish in, so a parallel run and a serial run of the same cells produce the same output.

Workers are *spawned*, not forked: the parent may hold threads (PyTorch, FAISS, MLflow's sqlite
connections) that a fork would copy in an unusable state. Each worker is told to leave its cores
alone between tasks (`OMP_WAIT_POLICY=PASSIVE`) and to use one BLAS/OpenMP thread, since the pool
already puts one process on each core.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

# Thread settings a worker process starts with (read by OpenMP, MKL, OpenBLAS and PyTorch when
# they load); a user's own setting wins.
WORKER_THREADS = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
}


def default_jobs() -> int:
    """The cores this process may run on (the affinity mask, which containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _start_worker() -> None:
    for name, value in WORKER_THREADS.items():
        os.environ.setdefault(name, value)


def run_cells(
    function: Callable[[Item], Result],
    items: Sequence[Item],
    *,
    jobs: int | None = None,
    describe: Callable[[Item], str] = str,
    cost: Callable[[Item], float] | None = None,
    progress: bool = True,
    on_result: Callable[[Item, Result], None] | None = None,
    ray: str | None = None,
) -> list[Result]:
    """`[function(item) for item in items]`, on up to `jobs` processes (default: every core), or
    as Ray tasks when `ray` names a cluster (`local`: start a Ray runtime on this machine with
    `jobs` CPUs; otherwise an address such as `auto` or `ray://head:10001`).

    `function` and the items must pickle (a module-level function; dataclasses of plain data).
    `cost` estimates an item's run time: the dearest start first, so a long cell does not start
    last and leave the other cores idle. `on_result` sees each result as it arrives (in completion
    order; the returned list is in item order). With one job, or one item, everything runs in this
    process: no pool, same results. A cell's exception reaches the caller as itself (re-raised
    from the worker), with a note naming the cell, so a failure in one of 80 replays says which."""
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs: expected at least 1, got {jobs}")
    order = sorted(range(len(items)), key=lambda i: -cost(items[i])) if cost else list(range(len(items)))
    if ray is not None:
        return _run_on_ray(function, items, order, ray, jobs, describe, progress, on_result)
    if jobs == 1 or len(items) <= 1:
        return [_collect(item, functools.partial(function, item), describe, on_result) for item in items]
    results: dict[int, Result] = {}
    bar = _progress_bar(len(items), f"{len(items)} cells on {min(jobs, len(items))} processes", progress)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(jobs, len(items)), mp_context=context, initializer=_start_worker) as pool:
        futures: dict[Future[Result], int] = {pool.submit(function, items[i]): i for i in order}
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    index = futures[future]
                    results[index] = _collect(items[index], future.result, describe, on_result)
                    bar(describe(items[index]))
        except BaseException:
            for future in pending:
                future.cancel()
            raise
        finally:
            bar(None)
    return [results[i] for i in range(len(items))]


def _run_on_ray(
    function: Callable[[Item], Result],
    items: Sequence[Item],
    order: list[int],
    address: str,
    jobs: int,
    describe: Callable[[Item], str],
    progress: bool,
    on_result: Callable[[Item, Result], None] | None,
) -> list[Result]:
    """The same cells as Ray tasks (one CPU each): the function and items travel to the workers
    as they would to a process pool, and the results come back in item order. A runtime this
    call starts stays up for the rest of the process (Ray shuts it down at exit), so a second
    sweep does not pay the start-up again."""
    import ray

    if not ray.is_initialized():
        if address == "local":
            ray.init(num_cpus=jobs, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        else:
            ray.init(address=address, logging_level="ERROR")
    remote = ray.remote(num_cpus=1)(_apply)
    shared = ray.put(function)  # sent to the object store once, not with every task
    index_of = {remote.remote(shared, items[i]): i for i in order}
    pending = list(index_of)
    results: dict[int, Result] = {}
    bar = _progress_bar(len(items), f"{len(items)} cells on Ray", progress)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            index = index_of[done[0]]
            results[index] = _collect(items[index], functools.partial(ray.get, done[0]), describe, on_result)
            bar(describe(items[index]))
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        raise
    finally:
        bar(None)
    return [results[i] for i in range(len(items))]


def _apply(function: Callable[[Item], Result], item: Item) -> Result:
    """What a Ray task runs: Ray's decorator takes only plain functions, and a cell function may be
    any picklable callable (a partial, an objective dataclass)."""
    return function(item)


def _collect(
    item: Item,
    fetch: Callable[[], Result],
    describe: Callable[[Item], str],
    on_result: Callable[[Item, Result], None] | None,
) -> Result:
    """One cell's result, however it is fetched (run here, a future, a Ray reference): a failure
    is re-raised as itself with a note naming the cell; `on_result` sees a success."""
    try:
        result = fetch()
    except Exception as exc:
        exc.add_note(f"in cell {describe(item)}")
        raise
    if on_result is not None:
        on_result(item, result)
    return result


def _progress_bar(total: int, title: str, enabled: bool) -> Callable[[str | None], None]:
    """A callable taking the name of each finished cell (None closes it): a tqdm bar on a
    terminal, one line per cell otherwise (a log file shows progress too)."""
    if not enabled:
        return lambda _name: None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, desc=title, unit="cell", file=sys.stderr, leave=False)

        def update(name: str | None) -> None:
            if name is None:
                bar.close()
            else:
                bar.set_postfix_str(name, refresh=False)
                bar.update()

        return update
    finished = 0

    def line(name: str | None) -> None:
        nonlocal finished
        if name is not None:
            finished += 1
            print(f"  [{finished}/{total}] {name}", file=sys.stderr)

    return line
