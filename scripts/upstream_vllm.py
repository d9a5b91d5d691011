"""Run the GPU-free scheduler harness against upstream vLLM releases (issue 23).

    .venv/bin/python scripts/upstream_vllm.py [VERSION ...] [--cache DIR]

GPU nodes install upstream `vllm` (`.[gpu]`), not the CPU build the test suite runs, so this checks
the adapter against the releases the extra allows (default: its oldest and newest,
`serving_hooks.vllm_interface.UPSTREAM_VERSIONS`). Each release's wheel is installed once, without
its dependencies, into `DIR/VERSION` (default `~/.cache/adapt/upstream-vllm`; pip caches the wheel
too), beside this venv's CPU torch; then the harness modules (`HARNESS`) run with
that vLLM first on the path and `VLLM_TARGET_DEVICE=cpu` (a CUDA wheel cannot infer a device on a
machine without a GPU; vLLM's scheduler and KV block accounting need none). The harness serves every
servable policy's requests in vLLM's real scheduler and checks every name the adapter relies on
(`serving_hooks/vllm_interface.py`). Prints one line per release; exits 1 if any failed, with the
harness's output for it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = (  # the harness modules: each drives vLLM's real scheduler without a model
    "tests/integration/test_scheduler_harness.py",
    "tests/integration/test_conformance_finishes.py",
    "tests/integration/test_adapter_policy_errors.py",
    "tests/integration/test_prediction_swaps.py",
)


def installed(version: str, cache: Path) -> Path:
    """`cache/version`, holding upstream vLLM `version` and nothing else; installed on first use
    (into a temporary directory renamed into place, so an interrupted install is never used)."""
    target = cache / version
    if (target / "vllm" / "__init__.py").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f".{version}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial)]
    done = subprocess.run([*command, f"vllm=={version}"], capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(f"vllm {version}: pip install failed:\n{done.stderr[-2000:]}")
    try:
        partial.rename(target)
    except OSError:  # another run installed it meanwhile
        shutil.rmtree(partial, ignore_errors=True)
    return target


def run_harness(version: str, cache: Path) -> subprocess.CompletedProcess:
    """The harness against upstream vLLM `version` (installed first if needed)."""
    site = installed(version, cache)
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH")))),
        "VLLM_TARGET_DEVICE": "cpu",
    }
    check = f"import vllm, sys; sys.exit(vllm.__version__ != {version!r})"
    if subprocess.run([sys.executable, "-c", check], env=environment, cwd=ROOT).returncode != 0:
        raise RuntimeError(f"vllm {version}: {site} does not import as vLLM {version}")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *HARNESS]
    return subprocess.run(command, env=environment, cwd=ROOT, capture_output=True, text=True)


def main() -> int:
    from serving_hooks.vllm_interface import UPSTREAM_VERSIONS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", default=list(UPSTREAM_VERSIONS), metavar="VERSION")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "adapt" / "upstream-vllm")
    args = parser.parse_args()
    failed = []
    for version in args.versions:
        start = time.monotonic()
        print(f"vllm {version}: installing (once) and running the scheduler harness ...", flush=True)
        try:
            result = run_harness(version, args.cache)
        except RuntimeError as exc:  # not installable or not importable: say so, check the others
            print(f"vllm {version}: FAILED -- {exc}", flush=True)
            failed.append(version)
            continue
        summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
        print(f"vllm {version}: {'passed' if result.returncode == 0 else 'FAILED'} -- {summary}"
              f" ({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
        if result.returncode != 0:
            failed.append(version)
            print(result.stdout[-6000:], result.stderr[-2000:], sep="\n", file=sys.stderr)
    if failed:
        print(f"the adapter fails on upstream vLLM {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
