"""`QuantileNet`'s forward pass in numpy: how `neural-length` serves the network it trained in torch.

Why not torch: a live prediction worker runs in a thread of vLLM's engine process, and a torch op
called from a thread other than the engine's own starts an OpenMP team of its own beside the one
vLLM's forward uses. On a CPU engine the two teams share the cores, and vLLM's forward slowed
(issue 22: jitserve with neural-length at 0.64 of vLLM's default throughput with torch). The
network is two hidden layers of 128 -- about a millisecond of numpy for 256 rows on this 2-core
machine -- so it runs here in the calling thread with one BLAS thread, and serving needs no torch
call at all. (The limit is process-wide while a pass runs: a BLAS call from another thread
meanwhile also runs on one thread. vLLM's forward goes through torch, not this BLAS.)

The weights are `QuantileNet.state_dict()`'s tensors, by the same names and in the same layout,
so a safetensors file written from either loads into both.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
from scipy.special import erf
from threadpoolctl import ThreadpoolController

# QuantileNet.body's layers that hold weights (0: Linear, 1: GELU, 2: Dropout, 3: Linear, 4: GELU,
# 5: Linear), in order
LINEAR_LAYERS = ("body.0", "body.3", "body.5")

_blas = ThreadpoolController()
# BLAS's thread count is one setting for the whole process: two threads limiting and restoring it
# at once could restore it in the wrong order and leave it at 1, so forward passes take turns.
_blas_turn = threading.Lock()


class QuantileNetArrays:
    """inputs -> hidden -> hidden -> one value per quantile (ascending), as `QuantileNet` in eval
    mode: exact (erf) GELU, no dropout, and the head's softplus steps that keep quantiles apart."""

    def __init__(self, weights: Mapping[str, np.ndarray], inputs: int, hidden: int, quantiles: int) -> None:
        expected = {
            "body.0.weight": (hidden, inputs),
            "body.0.bias": (hidden,),
            "body.3.weight": (hidden, hidden),
            "body.3.bias": (hidden,),
            "body.5.weight": (quantiles, hidden),
            "body.5.bias": (quantiles,),
        }
        found = {name: tuple(np.shape(value)) for name, value in weights.items()}
        wrong = [
            f"{name}: expected {expected.get(name, 'no such tensor')}, got {found.get(name, 'none')}"
            for name in sorted(expected.keys() | found.keys())
            if expected.get(name) != found.get(name)
        ]
        if wrong:
            raise ValueError("tensors do not fit the network: " + "; ".join(wrong))
        self.weights = dict(weights)  # as given: what a version saves
        # transposed once, so the forward pass is rows @ matrix
        self.layers = [
            (
                np.ascontiguousarray(np.asarray(weights[f"{layer}.weight"], dtype=np.float32).T),
                np.asarray(weights[f"{layer}.bias"], dtype=np.float32),
            )
            for layer in LINEAR_LAYERS
        ]

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        """(n, quantiles) float32 outputs for (n, inputs) rows."""
        x = np.asarray(rows, dtype=np.float32)
        with _blas_turn, _blas.limit(limits=1, user_api="blas"):  # no BLAS threads beside the engine's
            for matrix, bias in self.layers[:-1]:
                x = _gelu(x @ matrix + bias)
            matrix, bias = self.layers[-1]
            raw = x @ matrix + bias
        steps = np.logaddexp(np.float32(0.0), raw[:, 1:])  # softplus, without overflow
        return np.concatenate([raw[:, :1], raw[:, :1] + np.cumsum(steps, axis=1)], axis=1)


def _gelu(x: np.ndarray) -> np.ndarray:
    """x * Phi(x), the exact form torch's `nn.GELU()` computes by default."""
    return 0.5 * x * (1.0 + erf(x * np.float32(1.0 / np.sqrt(2.0))))
