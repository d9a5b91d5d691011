"""The online-adaptation loop, closed inside a replay: serve, log, retrain, gate, hot-swap.

Every `every_s` seconds of simulated time, between two engine steps (`adapt.replay.checkpoints`):

1. the requests that left the engine since the last checkpoint are written as a request log,
   `requests-<n>.jsonl` in `log_dir`, in the format `adapt serve --log-dir` writes (with each
   request's prompt text when `log_prompts`, as `--log-prompts` writes it) -- and, when the
   engine records its steps (`EngineConfig(record_steps=True)`), its steps as `steps-<n>.csv` and
   its limits as `engine.json`, as a server writes them too;
2. `adapt retrain`'s own code (`pipelines.retrain.retrain_once`, the catalogue's retrainers for the
   components the policy uses, and `cost-model` when steps are logged) refits on the newest
   `history` logs, and its gate decides. With the step logs, a gate that replays the logged
   requests (the EWSJF layout's) replays them on the engine that served them, timed by the cost
   model just refitted from its steps, as it does for a live server; without them, on the gate's
   default engine, whose speed and size need not be the served engine's;
3. the policy's slots (`adapt.hotswap.PolicySlots`) follow the champion alias, so a promoted
   version is swapped into the running policy before the next step, as `adapt serve` does.

`before_retrain(at_s, data_dir)` lets a caller put its own candidates through the same registry
and gate at a checkpoint (the drift study's deliberately bad one); what it returns is recorded
with the retrain's decisions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from adapt.hotswap import PolicySlots
from adapt.registry import Registry
from adapt.replay.checkpoints import checkpoint_times, run_with_checkpoints
from adapt.replay.engine import ENGINE_FILE, ReplayEngine
from adapt.replay.metrics import ReplayResult, write_request_log
from adapt.requests import Request
from pipelines.retrain import Retrainer, RetrainResult, retrain_once


@dataclass
class Decision:
    """One gate decision at a checkpoint, and whether its version went live in the replay."""

    at_s: float
    component: str
    status: str  # registered | unchanged | no data | failed | refused (not registered: failed its checks)
    version: int | None
    promoted: bool
    detail: str
    source: str = "retrain"  # retrain | what a `before_retrain` hook calls its candidate
    swapped: bool = False


BeforeRetrain = Callable[[float, Path], list[Decision]]


class RetrainLoop:
    """The loop for one engine and one registry (see module doc)."""

    def __init__(
        self,
        engine: ReplayEngine,
        registry: Registry,
        log_dir: str | Path,
        retrainers: dict[str, Retrainer],
        *,
        history: int = 2,
        margin: float = 0.0,
        before_retrain: BeforeRetrain | None = None,
        log_prompts: bool = False,
    ) -> None:
        if history < 1:
            raise ValueError(f"history: must be >= 1 log, got {history}")
        self.engine = engine
        self.registry = registry
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.logs_steps = engine.config.record_steps
        used = set(engine.policy.components.values()) | ({"cost-model"} if self.logs_steps else set())
        self.retrainers = {name: r for name, r in retrainers.items() if name in used}
        self.history = history
        self.margin = margin
        self.before_retrain = before_retrain
        self.log_prompts = log_prompts
        self._prompt_texts: dict[str, str] = {}  # request id -> prompt text, when `log_prompts`
        self.slots = PolicySlots(registry, engine.policy)
        self.decisions: list[Decision] = []
        self.swaps: list[tuple[float, str, int]] = []  # (at_s, component, version) that went live
        self._logged = 0
        self._steps_logged = 0
        self._logs: list[list[Path]] = []  # per checkpoint: its request log and step log
        if self.logs_steps:  # the limits the gate's replay should use; it need not record steps
            limits = dataclasses.replace(engine.config, record_steps=False)
            (self.log_dir / ENGINE_FILE).write_text(limits.to_json())
        self.apply(0.0, at_once=True)  # the champion serves from the start, as a server loads it

    def apply(self, at_s: float, at_once: bool = False) -> dict[str, int]:
        """Swap in whatever the champion aliases point at now (between steps): at once before the
        first step, else live from the next step's plan, after its intake, as `adapt serve` applies
        a swap."""
        swapped = self.slots.apply(use=None if at_once else self.engine.use_component)
        self.swaps.extend((at_s, name, version) for name, version in swapped.items())
        return swapped

    def checkpoint(self, at_s: float) -> None:
        """Log, retrain, gate, swap (see module doc)."""
        records = self.engine.recorder.closed_since(self._logged)
        self._logged += len(records)
        logs = []
        if records:
            path = self.log_dir / f"requests-{len(self._logs):06d}.jsonl"
            logs.append(write_request_log(records, path, self._prompt_texts))
        if self.logs_steps:
            logs.extend(self._write_steps(self.log_dir / f"steps-{len(self._logs):06d}.csv"))
        if logs:
            self._logs.append(logs)
        data_dir = self._window(at_s)
        decisions = self.before_retrain(at_s, data_dir) if self.before_retrain else []
        with contextlib.redirect_stderr(io.StringIO()):  # retrain's per-component progress lines
            results = retrain_once(self.registry, data_dir, self.retrainers, margin=self.margin)
        decisions.extend(_decision(at_s, result) for result in results)
        swapped = self.apply(at_s)
        for decision in decisions:
            decision.swapped = swapped.get(decision.component) == decision.version
        self.decisions.extend(decisions)

    def _write_steps(self, path: Path) -> list[Path]:
        """The steps run since the last checkpoint as a step log (none: no file)."""
        import pandas as pd

        steps = pd.DataFrame(self.engine.recorder.step_log(since=self._steps_logged))
        self._steps_logged += len(steps)
        if steps.empty:
            return []
        steps.to_csv(path, index=False)
        return [path]

    def _window(self, at_s: float) -> Path:
        """A data directory holding (links to) the newest `history` checkpoints' logs, and the
        engine's limits when it logs its steps."""
        window = self.log_dir / f"window-{at_s:09.1f}"
        window.mkdir()
        for log in [path for logs in self._logs[-self.history :] for path in logs]:
            (window / log.name).symlink_to(log.resolve())
        if self.logs_steps:
            (window / ENGINE_FILE).symlink_to((self.log_dir / ENGINE_FILE).resolve())
        return window

    def run(self, requests: Sequence[Request], every_s: float, until_s: float) -> ReplayResult:
        """Replay `requests` with a checkpoint every `every_s` seconds up to `until_s`."""
        if self.log_prompts:
            self._prompt_texts = {r.request_id: r.prompt_text for r in requests if r.prompt_text is not None}
        times = checkpoint_times(every_s, until_s)
        return run_with_checkpoints(self.engine, requests, times, self.checkpoint)


def _decision(at_s: float, result: RetrainResult) -> Decision:
    return Decision(at_s, result.component, result.status, result.version, result.promoted, result.detail)
