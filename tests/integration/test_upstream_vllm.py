"""The adapter against upstream vLLM, the build GPU nodes install (`.[gpu]`), not only the CPU build
the rest of the suite runs: the scheduler harness on the oldest and newest release the extra allows
(`scripts/upstream_vllm.py`; each wheel installed once, without its dependencies, under
~/.cache/adapt/upstream-vllm)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from serving_hooks.vllm_interface import UPSTREAM_VERSIONS

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_extra_allows_exactly_the_checked_range():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    oldest, newest = UPSTREAM_VERSIONS[0], UPSTREAM_VERSIONS[-1]
    major, minor, _ = newest.split(".")
    assert extras["gpu"] == [f"vllm>={oldest.removesuffix('.0')},<{major}.{int(minor) + 1}"]


@pytest.mark.slow
@pytest.mark.parametrize("version", UPSTREAM_VERSIONS)
def test_the_scheduler_harness_passes_on_upstream_vllm(version):
    done = subprocess.run(
        [sys.executable, "scripts/upstream_vllm.py", version], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, f"upstream vLLM {version}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert re.search(rf"vllm {re.escape(version)}: passed -- \d+ passed", done.stdout), done.stdout
