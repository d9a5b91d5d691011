"""Paired comparison of an incumbent and a candidate on live traffic, corrected for drift.

Scoring each window of live traffic against a fixed reference (the first window) lets anything that
changes between windows -- the arrival rate, the mix, the backlog one window leaves the next --
pass for an effect of the parameters tried in it: at steady load window-to-window noise dominates,
under overload the growing backlog makes every later window look worse. The paired design here
removes both: windows alternate incumbent (I) and candidate (C),

    I0 C1 I1 C2 I2 ... Ck Ik

and the candidate's score is the mean over its k windows of the contrast with its two incumbent
neighbours, d_i = f(C_i; I_{i-1}, I_i) (e.g. C_i - (I_{i-1} + I_i) / 2), so whatever drifts
linearly over three windows cancels. Whether d is more than noise is judged against the same
contrast taken on incumbent windows alone, e_m = f(I_m; I_{m-1}, I_{m+1}): under the null (the
candidate is the incumbent) d and e have the same distribution, so their spread is the noise
level, measured on the live traffic rather than assumed. The rule is a one-sided z-test:

    adopt  iff  at least `min_noise` incumbent contrasts are known  and
                mean(d) > z * rms(e) * sqrt((2k - 1/2) / (3/2 k^2))

The factor is the standard deviation of mean(d) in units of that of e, for independent windows of
equal variance s^2: Var(e) = 3/2 s^2, and the k contrasts share their inner neighbours, so
Var(sum d) = (2k - 1/2) s^2 rather than 3/2 k s^2 (1 for k = 1, 0.64 for k = 3 where 1/sqrt(3)
would be 0.58). rms rather than the standard deviation: a residual drift that the contrast leaves
in e widens the threshold instead of being subtracted away. With z = 2 a candidate no better than
the incumbent is adopted about 2-5% of the time (more while only a handful of contrasts are known).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

W = TypeVar("W")
Contrast = Callable[[W, W, W], float]  # (window, left neighbour, right neighbour) -> contrast


def paired_contrasts(candidate: Sequence[W], incumbent: Sequence[W], contrast: Contrast) -> list[float]:
    """The k contrasts of a candidate's windows C_1..C_k with the k + 1 incumbent windows
    I_0..I_k that surround them (I_{i-1} before C_i, I_i after it)."""
    if len(incumbent) != len(candidate) + 1:
        raise ValueError(
            f"paired windows: {len(candidate)} candidate windows need {len(candidate) + 1}"
            f" incumbent neighbours, got {len(incumbent)}"
        )
    return [contrast(c, incumbent[i], incumbent[i + 1]) for i, c in enumerate(candidate)]


def incumbent_contrasts(incumbent: Sequence[W], contrast: Contrast) -> list[float]:
    """The null distribution: each inner incumbent window against its two incumbent neighbours."""
    return [contrast(incumbent[m], incumbent[m - 1], incumbent[m + 1]) for m in range(1, len(incumbent) - 1)]


def linear(window: float, left: float, right: float) -> float:
    """The contrast of plain numbers: the window minus the mean of its neighbours."""
    return window - (left + right) / 2


@dataclass(frozen=True)
class Verdict:
    """A candidate's paired score, the noise threshold it was held to, and the decision."""

    score: float  # mean paired contrast (positive: better than the incumbent)
    pairs: int
    noise_rms: float  # rms of the incumbent contrasts; nan when none is known yet
    noise_samples: int
    threshold: float  # what `score` had to exceed (inf while the noise is unknown)
    adopt: bool


@dataclass(frozen=True)
class AdoptionRule:
    """The one-sided test of the module doc."""

    z: float = 2.0
    min_noise: int = 3

    def __post_init__(self) -> None:
        if not (math.isfinite(self.z) and self.z > 0):
            raise ValueError(f"z: expected a finite number > 0, got {self.z!r}")
        if self.min_noise < 1:
            raise ValueError(f"min_noise: expected an integer >= 1, got {self.min_noise!r}")

    def judge(self, contrasts: Sequence[float], noise: Sequence[float]) -> Verdict:
        if not contrasts:
            raise ValueError("paired test: no candidate windows to judge")
        score = math.fsum(contrasts) / len(contrasts)
        rms = math.sqrt(math.fsum(e * e for e in noise) / len(noise)) if noise else math.nan
        known = len(noise) >= self.min_noise
        k = len(contrasts)
        threshold = self.z * rms * math.sqrt((2 * k - 0.5) / (1.5 * k * k)) if known else math.inf
        return Verdict(score, len(contrasts), rms, len(noise), threshold, known and score > threshold)
