"""Registry and hot-swap benchmark.

    .venv/bin/python -m experiments.bench_registry [--promotions N] [--poll S]

Prints: time to log + register one component (median of 10), time from an alias move to the new
version serving in a Slot polling every `--poll` seconds (median and p99 over N promotions), and
the cost of `slot.get()` on the hot path (ns per call). Uses a throw-away sqlite store.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import timeit
from pathlib import Path

import numpy as np

from adapt.cli.usage import COUNT, POSITIVE
from adapt.hotswap import Slot
from adapt.registry import Registry
from adapt.steplog import STEP_FIELDS
from predictors.cost_model import FittedCostModel


def _step_log(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 2048, 200).astype(float)
    return {
        **{name: np.zeros(200) for name in STEP_FIELDS},  # no cached prefixes, no decodes
        "tokens": tokens,
        "sampled": np.minimum(tokens, 64),
        "duration_s": 0.005 + 2e-5 * tokens,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--promotions", type=COUNT, default=20)
    parser.add_argument("--poll", type=POSITIVE, default=1.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        registry = Registry(f"sqlite:///{Path(tmp) / 'bench.db'}", cache_dir=Path(tmp) / "cache")
        log_times, versions = [], []
        for seed in range(10):
            model = FittedCostModel().fit(_step_log(seed))
            start = time.perf_counter()
            versions.append(registry.log(model, metrics=model.evaluate(_step_log(seed + 100))))
            log_times.append(time.perf_counter() - start)
        print(f"log + register one component: median {statistics.median(log_times) * 1000:.0f} ms")

        registry.promote("cost-model", versions[0])
        slot = Slot(registry, "cost-model", interval_s=args.poll).start()
        delays = []
        rng = np.random.default_rng(0)
        for i in range(args.promotions):
            target = versions[(i + 1) % len(versions)]
            time.sleep(rng.uniform(0, args.poll))  # promotions land at random points of the poll cycle
            moved = time.perf_counter()
            registry.promote("cost-model", target)
            while slot.version != target:
                time.sleep(0.001)
            delays.append(time.perf_counter() - moved)
        slot.stop()
        delays_ms = np.array(delays) * 1000
        print(
            f"alias move -> live at a {args.poll:g} s poll: median {np.median(delays_ms):.0f} ms,"
            f" p99 {np.percentile(delays_ms, 99):.0f} ms over {args.promotions} promotions"
        )
        calls = 1_000_000
        per_call = timeit.timeit(slot.get, number=calls) / calls
        print(f"slot.get(): {per_call * 1e9:.0f} ns per call")


if __name__ == "__main__":
    main()
