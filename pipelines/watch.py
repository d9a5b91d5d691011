"""Detection: act on the online prediction quality the servers report, between scheduled retrains.

`adapt retrain --every S | --schedule CRON --watch URL,...` polls each server's `GET /v1/adapt/status`
every `--watch-interval` seconds. Its `quality` entries (`serving_hooks.metrics`) measure each
component per serving version and keep the previous version's last figures as `predecessor`. Two
decisions come of them:
- early retrain: a drift alarm on any server -- online coverage well below the version's held-out
  coverage, so the traffic moved -- runs a retrain pass now instead of at the next scheduled one.
  Not on a version with fewer than `least_requests` requests in its window, and at most once per
  `cooldown_s`: an alarm that stays on (the retrain found nothing better, or the servers have not
  swapped yet) must not retrain in a loop;
- rollback: a component whose serving version does worse online than the version before it --
  coverage, or for a length estimate its rank correlation, lower by more than `margin`, each side
  over at least `least_requests` requests -- goes back to that version: the champion alias moves
  (`Registry.rollback`) and the bad version is tagged `adapt.rolled_back` with the reason. Only
  while the registry's champion is still the version measured and its previous champion the
  predecessor measured: a newer promotion, or a rollback made already, is not fought.
  Figures from servers that serve the same version after the same predecessor are pooled, weighted
  by their requests; a replica still serving an older version does not count.

The decisions are pure functions of the status dicts and the registry's aliases (unit-tested on
hand-written dicts); `QualityWatch` does the I/O around them, and neither a server that does not
answer nor a registry error stops the loop: each is reported and that poll goes on without it.
"""

from __future__ import annotations

import urllib.parse
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from adapt.registry import CHAMPION, PREVIOUS, ChampionMoved, Registry
from serving_hooks.http import STATUS_TIMEOUT_S, read_status

DEFAULT_LEAST_REQUESTS = 200
DEFAULT_MARGIN = 0.05
DEFAULT_COOLDOWN_S = 300.0
ROLLED_BACK_TAG = "adapt.rolled_back"
QUALITY_METRICS = ("coverage", "rank_correlation")  # higher is better for both

Statuses = Mapping[str, Mapping[str, Any]]  # server URL -> its status JSON


class Aliases(NamedTuple):
    """What the registry serves for one component now."""

    champion: int | None
    previous: int | None


@dataclass(frozen=True)
class Rollback:
    component: str
    version: int  # the version that did worse: the champion now
    predecessor: int  # the version it goes back to
    reason: str


# ------------------------------------------------------------------ decisions
def early_retrain(
    statuses: Statuses,
    *,
    now: float,
    last_retrain_s: float | None,
    cooldown_s: float = DEFAULT_COOLDOWN_S,
    least_requests: int = DEFAULT_LEAST_REQUESTS,
) -> str | None:
    """Why to retrain now (one line naming each alarm), or None: no alarm on a version with
    `least_requests` requests, or the last pass ended less than `cooldown_s` ago."""
    if last_retrain_s is not None and now - last_retrain_s < cooldown_s:
        return None
    alarms = []
    for url, status in statuses.items():
        quality = status.get("quality") or {}
        for name in status.get("drift_alarms") or []:
            entry = quality.get(name) or {}
            if entry.get("requests", 0) >= least_requests:
                alarms.append(
                    f"{name} v{entry.get('version')} on {url}: coverage {entry.get('coverage')}"
                    f" vs held-out {entry.get('held_out_coverage')} over {entry['requests']} requests"
                )
    return "drift alarm: " + "; ".join(alarms) if alarms else None


def rollbacks(
    statuses: Statuses,
    aliases: Mapping[str, Aliases],
    *,
    least_requests: int = DEFAULT_LEAST_REQUESTS,
    margin: float = DEFAULT_MARGIN,
) -> list[Rollback]:
    """The components to roll back (module docstring), at most one each: only the registry's
    champion measured after its previous champion can qualify."""
    measured: defaultdict[tuple[str, int, int], list[tuple[Mapping, Mapping]]] = defaultdict(list)
    for status in statuses.values():
        for name, entry in (status.get("quality") or {}).items():
            before = entry.get("predecessor")
            if entry.get("version") is None or not before or before.get("version") is None:
                continue
            measured[(name, entry["version"], before["version"])].append((entry, before))
    decided = []
    for (name, version, predecessor), pairs in sorted(measured.items()):
        if name not in aliases or aliases[name] != Aliases(version, predecessor):
            continue
        for metric in QUALITY_METRICS:
            now, now_n = _pooled([entry for entry, _ in pairs], metric)
            then, then_n = _pooled([before for _, before in pairs], metric)
            if now is None or then is None or min(now_n, then_n) < least_requests:
                continue
            if now < then - margin:
                reason = (
                    f"online {metric} {now:.3f} over {now_n} requests, below v{predecessor}'s"
                    f" {then:.3f} over {then_n} by more than {margin}"
                )
                decided.append(Rollback(name, version, predecessor, reason))
                break
    return decided


def _pooled(entries: Sequence[Mapping[str, Any]], metric: str) -> tuple[float | None, int]:
    """The request-weighted mean of `metric` over the entries that have it, and their requests."""
    weighted = [(e[metric], e.get("requests", 0)) for e in entries if e.get(metric) is not None]
    total = sum(n for _, n in weighted)
    if not total:
        return None, 0
    return sum(value * n for value, n in weighted) / total, total


# ------------------------------------------------------------------------ I/O
def check_url(url: str) -> str:
    """A server's base URL as `--watch` takes it (http or https, with a host), without a trailing /."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--watch: {url!r} is not an http(s) URL with a host")
    return url.rstrip("/")


class QualityWatch:
    """Polls servers and acts on what `early_retrain` and `rollbacks` decide; one printed line per
    action, and per server that stops or starts answering (not one per failed poll)."""

    def __init__(
        self,
        urls: Sequence[str],
        registry: Registry,
        *,
        least_requests: int = DEFAULT_LEAST_REQUESTS,
        margin: float = DEFAULT_MARGIN,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        timeout_s: float = STATUS_TIMEOUT_S,
        api_key: str | None = None,  # the servers' --api-key: without it a keyed server answers 401
        say: Callable[[str], None] = lambda line: print(line, flush=True),  # a log read as it runs
    ) -> None:
        if not urls:
            raise ValueError("--watch: give the servers' URLs, comma-separated")
        self.urls = [check_url(url) for url in urls]
        self.registry = registry
        self.least_requests = least_requests
        self.margin = margin
        self.cooldown_s = cooldown_s
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.say = say
        self.last_retrain_s: float | None = None
        self._silent: set[str] = set()

    def poll(self, now: float) -> bool:
        """Read every server, roll back what did worse; True when a retrain pass should run now."""
        statuses = self.statuses()
        try:
            for rollback in rollbacks(
                statuses, self._aliases(statuses), least_requests=self.least_requests, margin=self.margin
            ):
                self.roll_back(rollback)
        except Exception as exc:  # a registry that does not answer now may answer at the next poll
            self.say(f"watch: registry error, no rollback this time: {type(exc).__name__}: {exc}")
        reason = early_retrain(
            statuses,
            now=now,
            last_retrain_s=self.last_retrain_s,
            cooldown_s=self.cooldown_s,
            least_requests=self.least_requests,
        )
        if reason is not None:
            self.say(f"watch: early retrain: {reason}")
        return reason is not None

    def retrained(self, now: float) -> None:
        """A retrain pass (early or scheduled) ended at `now`: the cooldown counts from here."""
        self.last_retrain_s = now

    def statuses(self) -> dict[str, dict[str, Any]]:
        """The status of every server that answers."""
        answered = {}
        for url in self.urls:
            try:
                answered[url] = read_status(url, self.timeout_s, self.api_key)
            except ConnectionError as exc:
                if url not in self._silent:
                    self.say(f"watch: {url} does not answer ({exc}); skipped until it does")
                    self._silent.add(url)
                continue
            if url in self._silent:
                self.say(f"watch: {url} answers again")
                self._silent.discard(url)
        return answered

    def _aliases(self, statuses: Statuses) -> dict[str, Aliases]:
        """The registry's champion and previous champion of every component measured after a
        predecessor (the only ones a rollback can concern)."""
        names = {
            name
            for status in statuses.values()
            for name, entry in (status.get("quality") or {}).items()
            if entry.get("predecessor")
        }
        return {
            name: Aliases(
                self.registry.resolve(name, CHAMPION, missing_ok=True),
                self.registry.resolve(name, PREVIOUS, missing_ok=True),
            )
            for name in sorted(names)
        }

    def roll_back(self, rollback: Rollback) -> None:
        """Act on a decision made from an earlier read of the aliases. The registry acts only while
        its champion and previous champion are still those measured, read again under its lock:
        another watch on the same store may have rolled back already, or a retrain promoted."""
        try:
            restored = self.registry.rollback(
                rollback.component, expect_champion=rollback.version, expect_target=rollback.predecessor
            )
        except ChampionMoved as exc:
            self.say(f"watch: {exc}")
            return
        self.registry.tag_version(rollback.component, rollback.version, ROLLED_BACK_TAG, rollback.reason)
        self.say(
            f"watch: rolled back {rollback.component} v{rollback.version} -> v{restored}: {rollback.reason}"
        )
