"""Run an `adapt` policy inside vLLM's V1 scheduler (the same policy object the replay engine runs).

Use: `LLM(model, scheduler_cls="serving_hooks.vllm_adapter.PolicyScheduler", ...)` (or `vllm serve
--scheduler-cls ...`), with the policy named in the `ADAPT_POLICY` environment variable
(`NAME` or `NAME:key=value`, as in `adapt replay --policies`); the engine-core process inherits it.

Each step the adapter mirrors vLLM's requests into `RequestState`s, asks the policy for a `Plan`
and applies it with vLLM's own mechanics before vLLM schedules:
- admission order: the plan's waiting requests are moved to the front of vLLM's FCFS waiting
  queue, in the plan's order (vLLM then admits from the front while budget and blocks last);
  waiting requests the plan does not list sit out the step, as in the replay engine (a policy may
  cap admissions, e.g. jitserve's batch size);
- deferral: deferred running requests are taken out of `self.running` for this step only;
- `running_order`: `self.running` is rearranged in that order for the step, so vLLM's own
  preemption path (it pops the end of its running list) evicts the policy's last request;
- preemption: vLLM's own `_preempt_request` (recompute); drops: `finish_requests(..., ABORTED)`;
- the policy's token budget (`Policy.token_budget`, e.g. Sarathi's 512) is the step's budget;
- what the policy sees is what the replay engine shows it: tokens when vLLM processes a step's
  output (`update_from_output`, one step late under async scheduling), the waiting requests in the
  order they (re-)entered the queue.
Mechanics vLLM cannot honour refuse the policy at start (`adapt.mechanics.ENGINES["vllm"]`). With
`ADAPT_RECORD_DECISIONS=1`, every step's decisions are kept in `self.decisions` in the format
`adapt.conformance` compares with a trace-driven replay; with `ADAPT_LOG_DECISIONS=1` (`adapt serve
--log-decisions`) they go to the decision log beside the request and step logs instead, for `adapt
conformance`.
A policy that raises is logged and counted, and that step runs as plain vLLM FCFS: the engine never
dies because of a policy. Under `adapt serve` (`ADAPT_WATCH_INTERVAL` set) the policy's learned
components follow the registry's champions live (`serving_hooks.live`), and with `ADAPT_METRICS=1`
the scheduler records Prometheus metrics for the server's `/metrics` (`serving_hooks.metrics`).
vLLM's scheduler is not a stable public API: every name this file relies on is listed, with the
vLLM versions it was checked on, in `serving_hooks.vllm_interface`, and checked at import and at
engine start, so an unsupported vLLM fails with its version and what it lacks. The policy is kept
as `adapt_policy`: vLLM's own `policy` attribute (its FCFS/priority setting) stays vLLM's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import FCFSRequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.request import RequestStatus

from adapt.mechanics import check_policy
from adapt.policy import EngineView, Plan, RequestState, WaitingView
from adapt.predictions import BackgroundWorker, BatchFunction, PredictionQueue, PredictionStats
from adapt.replay.engine import ENGINE_FILE, EngineConfig, running_drop
from adapt.requests import SLO, CompletedRequest
from adapt.steplog import ARRIVALS, POLICY_S, step_batch
from serving_hooks.live import LiveComponents
from serving_hooks.metrics import SchedulerMetrics
from serving_hooks.monitor import Monitor
from serving_hooks.policies import POLICY_CONFIG, make_policy_from_spec, pin_policy_config
from serving_hooks.vllm_interface import check_classes, check_scheduler
from serving_hooks.xargs import embedding_from_extra_args, program_from_extra_args, slo_from_extra_args

log = logging.getLogger("adapt.vllm")

# vLLM's finished statuses of a request that did not finish its answer: an abort (its client's --
# a disconnect, or a stop string, which vLLM's API server applies by aborting -- or the policy's
# drop), an error, a prompt vLLM ignored. Its policy hears no finish time, as for a drop in the
# replay, and the decision log notes when it left, not a length (`PolicyScheduler._record_end`).
UNFINISHED_STATUSES = frozenset(
    getattr(RequestStatus, name)
    for name in ("FINISHED_ABORTED", "FINISHED_ERROR", "FINISHED_IGNORED")
    if hasattr(RequestStatus, name)  # (older vLLMs lack some)
)

check_classes(
    vllm.__version__,
    {
        "scheduler": AsyncScheduler,
        "queue": FCFSRequestQueue,
        "status": RequestStatus,
        "scheduler_output": SchedulerOutput,
        "output": EngineCoreOutput,
        "outputs": EngineCoreOutputs,
    },
)


def _share_embedding(state: RequestState) -> None:
    """A prompt's vector the client sent, kept under its text: a worker that embeds this prompt
    (neural-length's bounds) finds it done."""
    if state.prompt_embedding is not None and state.prompt_text:
        from predictors.embedding import shared_cache

        shared_cache().remember(state.prompt_text, state.prompt_embedding)


class PolicyScheduler(AsyncScheduler):
    """vLLM's async scheduler, ordered by an `adapt` policy (see module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_scheduler(vllm.__version__, self)
        # vLLM's preemption path pops the end of the running list (which the adapter arranges in
        # the policy's order) only under FCFS; priority mode picks its own victim.
        if self.policy != SchedulingPolicy.FCFS or not isinstance(self.waiting, FCFSRequestQueue):
            raise ValueError("PolicyScheduler needs vLLM's FCFS scheduling policy (scheduling_policy='fcfs')")
        self.engine_token_budget = int(self.max_num_scheduled_tokens)  # what vLLM was started with
        # An engine that runs each step's output before the next schedule (vLLM's CPU platform
        # turns async scheduling off) gets vLLM's synchronous bookkeeping, as its default
        # `Scheduler` would: the async placeholders cost time and change no decision there.
        self._engine_async = bool(self.scheduler_config.async_scheduling)
        # How many requests vLLM lets run: `max_num_active_seqs` where set (it caps admissions
        # below `max_num_seqs`, the model runner's slot count); vLLMs without it admit up to that.
        self.admission_cap = int(getattr(self, "max_num_active_reqs", self.max_num_running_reqs))
        self.decisions: list[dict] | None = [] if os.environ.get("ADAPT_RECORD_DECISIONS") == "1" else None
        log_dir = os.environ.get("ADAPT_LOG_DIR")
        log_decisions = bool(log_dir) and os.environ.get("ADAPT_LOG_DECISIONS") == "1"
        if log_decisions and (unmodelled := self.unmodelled_settings()):  # no replay could follow it
            raise ValueError(f"--log-decisions: {unmodelled[0]}")
        self.monitor = (
            Monitor(
                log_dir, log_prompts=os.environ.get("ADAPT_LOG_PROMPTS") == "1", log_decisions=log_decisions
            )
            if log_dir
            else None
        )
        self._prefix_caching = bool(self.vllm_config.cache_config.enable_prefix_caching)
        if self.monitor is not None:
            self._log_engine()
        # Each step's decisions are recorded for `self.decisions` (in-process checks) or the log.
        self._recording = self.decisions is not None or log_decisions
        # The serving policy's spec, logged on the first record and on each whole-policy swap (None:
        # swapped in by a caller that gave none, which a replay cannot rebuild). A `policy-config`
        # alias is read once, here: the policy and its slots' references come from one version
        # even if the alias moves while the engine starts, and the log names that version.
        spec, _ = pin_policy_config(os.environ.get("ADAPT_POLICY", "fcfs"))
        self._policy_spec: str | None = spec
        self._spec_to_log: bool = True
        self._logged_versions: dict[str, str] | None = None  # as the decision log last named them
        self.adapt_policy = make_policy_from_spec(spec)
        self._check(self.adapt_policy)
        # Model calls of the serving policy run in background workers, never inside a step.
        self.prediction_queues: list[PredictionQueue] = []
        # Workers of policies swapped out: stopped at the swap, closed (joined) at shutdown -- a
        # step must not wait for a batch still in flight in one.
        self._retired_queues: list[PredictionQueue] = []
        self._embedding_child = False  # whether a worker's MiniLM was sent to a child process
        self._starting = True  # models load now, before the first request (not on a live swap)
        self.adapt_policy.use_predictions(self._prediction_queue)
        self._starting = False
        self.policy_errors = 0
        self._states: dict[str, RequestState] = {}
        self._running_ids: set[str] = set()
        self._last_schedule: float | None = None
        self._mean_batch_s = 0.0
        # Per step whose output has not come yet: when it started and whether it ran tokens.
        self._step_starts: deque[tuple[float, bool]] = deque()
        self._tokenizer: Any = None
        if self.adapt_policy.needs_prompt_text:  # loaded now, not on the first request's arrival
            self._load_tokenizer()
        self._program_starts: dict[str, float] = {}
        self.live = LiveComponents.from_environment(self.adapt_policy, spec)  # `adapt serve`: the registry
        self._dropped_ids: set[str] = set()  # the plan's drops, while `finish_requests` frees them
        self._drops_to_report: list[Any] = []  # dropped by the policy, not yet told to the client
        self._held: list[Any] = []  # waiting requests the plan did not list, out for one step
        self._unplanned: set[str] = set()  # on_arrival/on_preempt raised: FCFS admits these
        self._last_step: tuple[float, dict[str, float]] | None = None
        self._arrivals = 0  # requests added since the last schedule call (`adapt.steplog.ARRIVALS`)
        self._policy_s = 0.0  # the last step's time in the policy and its plan (`adapt.steplog.POLICY_S`)
        # The policy's waiting requests, in the order they (re-)entered the queue; it sees them
        # through the same view the replay engine gives it.
        self._waiting_states: dict[str, RequestState] = {}
        self._waiting_view = WaitingView(self._waiting_states)
        self._arrived_since: list[list] = []
        self._freed_since: list[str] = []
        # Output lengths of the requests that finished since the last step (a stop token,
        # max_tokens, repetition detection): what a replay of this log gives each request
        # (`adapt.conformance`); and when those that did not finish (`UNFINISHED_STATUSES`, the
        # plan's drops aside) left, where a replay aborts them.
        self._finished_since: dict[str, int] = {}
        self._aborted_since: dict[str, float] = {}
        # Prompt texts given to requests in flight since the last step (`_give_prompt_texts`).
        self._texts_since: dict[str, str] = {}
        # With prefix caching on, the content keys of the answers' full blocks of the requests
        # freed since the last step: a later prompt that contains an answer hits them.
        self._answer_blocks_since: dict[str, list[str]] = {}
        self._cache_reset: str | None = None  # a prefix cache reset since the last step
        self._cache_reset_t = 0.0  # when one that preempted running requests did
        # Streaming-input sessions (`_streaming_session`): their ids, and those seen since the
        # last step (for the decision log).
        self._sessions: set[str] = set()
        self._sessions_since: list[str] = []
        self._sessions_warned = False
        self._undelivered: deque[dict] = deque()  # decision records whose output is still coming
        self._preempt_order: list[str] = []  # this step's possible victims, in eviction order
        self._output_at: float | None = None  # while vLLM processes a step's output: its moment
        self._policy_preempts = 0  # this step's preemptions the plan asked for
        self.metrics = SchedulerMetrics.from_environment()  # None unless ADAPT_METRICS=1
        self._follow_live()  # a policy-config champion replaces --policy from the first step
        log.info("adapt policy %s scheduling vLLM %s", self.adapt_policy.name, vllm.__version__)

    # ----------------------------------------------------------- lifecycle
    def add_request(self, request: Any) -> None:
        continuing = request.request_id in self._states  # a streaming-input session's next input
        if continuing or getattr(request, "resumable", False):
            self._streaming_session(request.request_id)  # first: an end input frees the session at once
        super().add_request(request)
        if continuing:
            return
        self._arrivals += 1
        extra = getattr(request.sampling_params, "extra_args", None) if request.sampling_params else None
        now = time.monotonic()
        try:
            slo = slo_from_extra_args(extra)
            program = program_from_extra_args(extra, self._program_starts, now)
        except Exception as exc:  # the API layer rejects these; whatever gets past it, the engine serves on
            log.warning("request %s: ignoring invalid SLO %s: %s", request.request_id, extra, exc)
            slo, program = SLO(), None
        try:
            embedding = embedding_from_extra_args(extra)
        except Exception as exc:  # only in-process callers can send a bad one (the API layer refuses)
            log.warning("request %s: ignoring its prompt embedding: %s", request.request_id, exc)
            embedding = None
        state = RequestState(
            request.request_id,
            now,
            request.num_prompt_tokens,
            request.max_tokens or 0,
            slo,
            prompt_text=self._prompt_text(request) if self.adapt_policy.needs_prompt_text else None,
            program=program,
            prompt_embedding=embedding,
        )
        _share_embedding(state)
        self._states[request.request_id] = state
        self._waiting_states[request.request_id] = state
        if self._recording:
            extra = {"slo": dataclasses.asdict(slo), "prompt_text": state.prompt_text}
            if program is not None:
                extra["program"] = dataclasses.asdict(program)
            if embedding is not None:
                extra["prompt_embedding"] = embedding.tolist()
            if self._prefix_caching:
                extra["prompt_blocks"] = block_keys(request.block_hashes)
                if getattr(request, "skip_reading_prefix_cache", False):  # asked for prompt logprobs
                    extra["skip_reading_prefix_cache"] = True
            self._arrived_since.append(
                [request.request_id, now, request.num_prompt_tokens, request.max_tokens or 0, extra]
            )
        if not self._call("on_arrival", state, now):
            self._unplanned.add(request.request_id)

    def _streaming_session(self, request_id: str) -> None:
        """A streaming-input session (vLLM's resumable requests: more prompt arrives under the
        same id after each answer). Between inputs vLLM keeps the request, its KV blocks and a
        batch slot, and resumes it ahead of the waiting queue, outside the policy's order; the
        replay models none of it. The policy sees a session as one request that leaves the
        running batch between inputs and comes back with a longer prompt (`_sync`); a next input
        is no new arrival. The decision log notes the session, and a replay stops there
        (`adapt.conformance`)."""
        if not self._sessions_warned:
            self._sessions_warned = True
            log.warning(
                "request %s is a streaming-input session: served, but a replay does not model sessions "
                "(a decision log ends its replayable run here)",
                request_id,
            )
        self._sessions.add(request_id)
        if self._recording:
            self._sessions_since.append(request_id)

    def _prompt_text(self, request: Any) -> str | None:
        """The prompt as text: the engine core only keeps token ids, so decode them with the
        served model's tokenizer (a few microseconds per short prompt)."""
        if request.prompt_token_ids is None:
            return None
        tokenizer = self._load_tokenizer() if self._tokenizer is None else self._tokenizer
        return tokenizer.decode(request.prompt_token_ids, skip_special_tokens=True)

    def _load_tokenizer(self) -> Any:
        """The served model's tokenizer (~0.1 s to load): at engine start for a policy that reads
        prompts, else on first use (a policy swapped in live, the request log's prompts)."""
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.vllm_config.model_config.tokenizer)
        return self._tokenizer

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        """vLLM's reset (an operator's `/reset_prefix_cache`, e.g. after new weights), noted in
        the decision log: a replay forgets its cached blocks before the same step. One asked to
        reset running requests too (`reset_running_requests`) preempts them all first, between
        two steps, where the adapter's own bookkeeping does not look: the policy is told of each
        here, in the order vLLM preempted them (the last running first), so its next plan finds
        them waiting; the log notes the reset as "preempting" with its time, and a replay
        preempts the same requests there (`ReplayEngine.reset_prefix_cache`). Whatever vLLM
        returns or raises after preempting (a KV connector's blocks still held), the policy is
        told and the preemptions noted."""
        running = list(self.running)
        reset = False
        try:
            reset = super().reset_prefix_cache(*args, **kwargs)
        finally:
            now = time.monotonic()
            preempted = [r for r in reversed(running) if r.status == RequestStatus.PREEMPTED]
            for request in preempted:
                state = self._states.get(request.request_id)
                self._running_ids.discard(request.request_id)
                if state is not None:
                    self._preempted(state, now)
            if self.metrics is not None:
                self.metrics.preempted("prefix_cache_reset", len(preempted))
            if self._recording and (reset or preempted) and self._cache_reset != "preempting":
                self._cache_reset = "preempting" if preempted else "idle"  # one that preempted stays noted
                if preempted:
                    self._cache_reset_t = now
        return reset

    def _free_request(self, request: Any, *args: Any, **kwargs: Any):
        state = self._states.pop(request.request_id, None)
        self._running_ids.discard(request.request_id)
        self._unplanned.discard(request.request_id)
        self._sessions.discard(request.request_id)
        self._waiting_states.pop(request.request_id, None)
        # Its prefix-cache content keys, once, for the decision and request logs that keep them.
        logged = self._recording or (state is not None and self.monitor is not None)
        content = self._content_keys(request) if logged and self._prefix_caching else None
        now = self._output_at or time.monotonic()  # one moment for the log and the policy
        if self._recording:
            self._freed_since.append(request.request_id)
            self._record_end(request, now)
            if content is not None and content[1]:
                self._answer_blocks_since[request.request_id] = content[1]
        dropped = request.request_id in self._dropped_ids
        if state is not None:
            self._take_output(request, state, now)  # a finishing request's last token, first
            state.phase = "finished"
            # A dropped, aborted or failed request did not finish: policies tell the two apart by
            # this, as in the replay engine (an error's truncated answer is no length to learn).
            aborted = request.status in UNFINISHED_STATUSES
            state.finish_s = None if aborted else now
            self._call("on_finish", state, now)
            if self.monitor is not None:
                self._log_request(request, state, now, dropped, content)
                if self._idle():  # nothing may sit in the buffers while no step comes
                    self._flush_logs()
            if self.metrics is not None:
                outcome = "dropped" if dropped else "aborted" if aborted else "finished"
                self._record_finish(state, outcome, now)
        return super()._free_request(request, *args, **kwargs)

    def _record_end(self, request: Any, now: float) -> None:
        """How a request left, for the decision log: its answer's length where a sampled token
        ended it (a stop token, `max_tokens`, repetition detection), which a replay gives the
        request; else (`UNFINISHED_STATUSES`) when it left, where a replay aborts it
        (`ReplayEngine.abort`) -- but a drop, which the replay's own plan makes."""
        if request.status not in UNFINISHED_STATUSES:
            self._finished_since[request.request_id] = int(request.num_output_tokens)
        elif request.request_id not in self._dropped_ids:
            self._aborted_since[request.request_id] = now

    def _record_finish(self, state: RequestState, outcome: str, now: float) -> None:
        """Metrics of a request that left; when it was the last one, the gauges too (no step
        comes while the engine is idle). Trouble is logged, never raised into the engine."""
        try:
            self.metrics.finished(state, outcome, self.adapt_policy)  # type: ignore[union-attr]
            if self._idle():
                self._publish_metrics(now)
        except Exception:
            log.exception("metrics: could not record request %s", state.id)

    def _idle(self) -> bool:
        """Whether no step will come: no request left, or only streaming-input sessions waiting
        for their next input (vLLM does not count those as unfinished)."""
        if not self._sessions:
            return not self._states
        return all(request_id in self._sessions and self._paused(request_id) for request_id in self._states)

    def _paused(self, request_id: str) -> bool:
        """A streaming-input session between two inputs: vLLM keeps it, not in `running`."""
        request = self.requests.get(request_id)
        return request is not None and request.status.name == "WAITING_FOR_STREAMING_REQ"

    def _flush_logs(self) -> None:
        try:
            if self._last_step is not None:
                start, features = self._last_step
                self.monitor.step(start, time.monotonic() - start, {**features, ARRIVALS: self._arrivals})
                self._last_step = None
            self._arrivals = 0
            self.monitor.flush()
        except Exception:
            log.exception("monitor: could not flush the logs")

    def _content_keys(self, request: Any) -> tuple[list[str], list[str]]:
        """A request's prompt and answer blocks' content keys as the prefix cache holds them by
        its end (`block_keys`): the prompt's full blocks, then those its answer filled."""
        full_prompt = request.num_prompt_tokens // self.block_size
        return block_keys(request.block_hashes[:full_prompt]), block_keys(request.block_hashes[full_prompt:])

    def _log_request(
        self,
        request: Any,
        state: RequestState,
        freed_at: float,
        dropped: bool,
        content: tuple[list[str], list[str]] | None,
    ) -> None:
        """One request-log record; logging trouble is reported, never raised into the engine.
        With prefix caching on it carries the request's `content` keys (about 19 bytes per KV
        block of prompt and answer), so that a retrain gate replaying the log finds the hits this
        engine found."""
        try:
            output = int(request.num_output_tokens)
            finished = not dropped and request.status not in UNFINISHED_STATUSES and output > 0
            finish = freed_at
            first = min(max(state.first_token_s or finish, state.arrival_s), finish) if finished else None
            record = CompletedRequest(
                request_id=state.id,
                arrival_s=state.arrival_s,
                prompt_tokens=state.prompt_tokens,
                output_tokens=output,
                first_token_s=first,
                finish_s=finish if finished else None,
                outcome="finished" if finished else ("dropped" if dropped else "aborted"),
                slo=state.slo,
                program=state.program,
                preemptions=state.num_preemptions,
                prompt_text=self._prompt_text(request) if self.monitor.log_prompts else None,
            )
            # Its arrival on the wall clock too: `time.monotonic()` restarts when the host reboots,
            # and a retrain reading a log directory across a reboot orders requests by this one.
            record.extra["wall_arrival_s"] = round(time.time() - (time.monotonic() - state.arrival_s), 6)
            if content is not None:
                record.extra["prompt_blocks"], record.extra["answer_blocks"] = content
                if getattr(request, "skip_reading_prefix_cache", False):
                    record.extra["skip_reading_prefix_cache"] = True
            self.monitor.request(record)
        except Exception:
            log.exception("request log: could not record %s", request.request_id)

    def _call(self, hook: str, state: RequestState, now: float) -> bool:
        """Run one policy hook; False (logged, counted) when it raised."""
        try:
            getattr(self.adapt_policy, hook)(state, now)
        except Exception:  # a policy bug must not take the engine down
            self._policy_error()
            log.exception("policy %s.%s failed for %s", self.adapt_policy.name, hook, state.id)
            return False
        return True

    def _policy_error(self) -> None:
        self.policy_errors += 1
        if self.metrics is not None:
            self.metrics.policy_error()

    def replay_config(self) -> EngineConfig:
        """This engine's limits as a replay `EngineConfig`, for a replay that should decide as it
        does (`adapt.conformance`). Refuses settings the replay does not model."""
        unmodelled = self.unmodelled_settings()
        if unmodelled:
            raise ValueError(unmodelled[0])
        return self.engine_limits()

    def unmodelled_settings(self) -> list[str]:
        """What this engine does that a replay does not model, each as what to change."""
        sched = self.scheduler_config
        found = []
        if getattr(sched, "watermark", 0.0):
            found.append("replay does not model vLLM's KV watermark: start vLLM without one")
        if getattr(sched, "long_prefill_token_threshold", 0):
            found.append("replay does not model long_prefill_token_threshold: leave it at 0")
        if not getattr(sched, "enable_chunked_prefill", True):
            found.append("replay chunks prompts larger than a step's budget: start vLLM with chunked prefill")
        if getattr(self.vllm_config, "speculative_config", None) is not None:
            found.append("replay does not model speculative decoding: start vLLM without it")
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1 or type(groups[0].kv_cache_spec) not in (FullAttentionSpec, MLAAttentionSpec):
            kinds = ", ".join(type(group.kv_cache_spec).__name__ for group in groups)
            found.append(
                f"replay models one KV cache group of full attention, this model has {kinds}: sliding"
                " windows, Mamba and hybrid models free and cache blocks otherwise"
            )
        if getattr(self.vllm_config, "kv_transfer_config", None) is not None:
            found.append(
                "replay does not model KV connectors (offloading, disaggregation): start vLLM without one"
            )
        parallel = self.vllm_config.parallel_config
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if getattr(parallel, name, 1) > 1:
                found.append(f"replay does not model context parallelism's KV blocks: leave {name} at 1")
        return found

    def engine_limits(self) -> EngineConfig:
        """The limits a replay models (token budget, running cap, KV blocks, ...), whatever else
        the engine does: enough for a gate that compares candidates on this engine's load."""
        sched = self.scheduler_config
        usable_blocks = int(self.kv_cache_manager.block_pool.num_gpu_blocks) - 1  # vLLM's null block
        return EngineConfig(
            token_budget=self.engine_token_budget,
            max_running=self.admission_cap,
            block_size=int(self.block_size),
            max_model_len=int(self.max_model_len),
            kv_capacity_tokens=usable_blocks * int(self.block_size),
            async_scheduling=bool(sched.async_scheduling),
            reserve_full_sequence=bool(getattr(sched, "scheduler_reserve_full_isl", False)),
            prefix_caching=self._prefix_caching,
        )

    def _log_engine(self) -> None:
        """This engine's limits beside its logs, for the retrain gates that replay them. A gate
        compares candidates on one load, so what its replay does not model costs it some
        accuracy, not the comparison: written anyway, and said."""
        try:
            self.monitor.engine(self.engine_limits())  # type: ignore[union-attr]
        except OSError:  # like the logs themselves: trouble is logged, never stops the engine
            log.exception("monitor: could not write %s", ENGINE_FILE)
            return
        for setting in self.unmodelled_settings():
            log.info("monitor: %s beside the logs is approximate: %s", ENGINE_FILE, setting)

    # ------------------------------------------------------------ live swaps
    def _follow_live(self) -> None:
        """Apply what went live in the registry since the last step: a new policy-config (the
        whole policy) and new component versions. A swap that fails leaves the old one serving."""
        if self.live is None:
            return
        try:
            reading = self.adapt_policy.needs_prompt_text
            replacement = self.live.next_policy()
            if replacement is not None:
                self._switch_policy(replacement, spec=f"{POLICY_CONFIG}@v{self.live.next_config_version}")
                self.live.adopt(replacement)
            self.live.apply()
            if self.adapt_policy.needs_prompt_text and not reading:  # a version that reads prompts
                self._give_prompt_texts()
        except Exception:
            self._policy_error()
            log.exception("applying a new policy or component version failed; the old one serves")

    def _check(self, policy: Any) -> None:
        """Refuse a policy that relies on a mechanic this engine refuses (`adapt.mechanics`), and
        say which mechanics mean something else here than in replay."""
        for difference in check_policy(policy, "vllm", engine_token_budget=self.engine_token_budget):
            log.warning("policy %s in vLLM differs from replay: %s", policy.name, difference)

    def _switch_policy(self, policy: Any, spec: str | None = None) -> None:
        """Hand every request in flight to `policy`, oldest first (waiting ones as arrivals --
        a preempted one keeps its phase, so the policy can tell it was started -- running ones as
        arrivals then admissions), then let it schedule. If it is refused or raises on the way,
        the old policy keeps serving, with its own prediction queues. Its mechanics apply from the
        next step (`_apply_mechanics`). `spec` names it in the decision log. A policy that reads
        prompts gets the requests in flight with their text (`_give_prompt_texts`)."""
        self._check(policy)
        now = time.monotonic()
        previous_queues, self.prediction_queues = self.prediction_queues, []
        try:
            if policy.needs_prompt_text:
                self._give_prompt_texts()
            policy.use_predictions(self._prediction_queue)
            # admitted: running, or a streaming-input session between inputs (vLLM resumes it)
            running = {r.request_id for r in self.running}
            for state in sorted(self._states.values(), key=lambda s: s.arrival_s):
                policy.on_arrival(state, state.arrival_s)
                if state.id not in self._waiting_states:
                    policy.on_admit(state, now)
        except Exception:
            self._retire(self.prediction_queues)
            self.prediction_queues = previous_queues
            raise
        self._policy_spec, self._spec_to_log = spec, True
        log.info(
            "policy %s replaces %s with %d requests in flight",
            policy.name,
            self.adapt_policy.name,
            len(running),
        )
        self.adapt_policy = policy
        self._unplanned.clear()
        self._retire(previous_queues)

    def _retire(self, queues: list[PredictionQueue]) -> None:
        """Stop the workers of a policy that no longer serves, without waiting for a batch in
        flight (a step would wait up to `BackgroundWorker.close`'s 30 s); `shutdown` joins them."""
        for queue in queues:
            queue.stop()
        self._retired_queues.extend(queues)

    def _give_prompt_texts(self) -> None:
        """A policy that reads prompts took over (a whole policy, or a component version that
        reads them): requests in flight that arrived without their text (`add_request` decodes it
        only for such a policy) get it now, or they would stay on the policy's length-only prior.
        The decision log carries each (`prompt_texts`), so a replay gives its requests the same
        text at the same step (`adapt.conformance`)."""
        for request_id, state in self._states.items():
            request = self.requests.get(request_id)
            if state.prompt_text is not None or request is None:
                continue
            state.prompt_text = self._prompt_text(request)
            if state.prompt_text is None:  # no token ids (a prompt given as embeddings)
                continue
            _share_embedding(state)  # as on arrival
            if self._recording:
                self._texts_since[request_id] = state.prompt_text

    # ------------------------------------------------------------- one step
    def schedule(self, *args: Any, **kwargs: Any):
        now = time.monotonic()
        gap = None  # for the metrics: the last step's time, unless the engine idled since
        if self._last_schedule is not None and self._running_ids:
            gap = now - self._last_schedule
        self._last_schedule = now
        self._follow_live()
        self._apply_mechanics()
        self._sync()
        original = list(self.running)
        deferred: list[Any] = []
        fallback = False
        try:
            view = self._view(now)  # the policy's time runs from here (`adapt.steplog.POLICY_S`)
            if self._recording:
                self._queues = {
                    "running": [s.id for s in view.running],
                    "waiting": [s.id for s in view.waiting],
                }
            plan = self.adapt_policy.on_step(view)
            deferred = self._apply(plan)
        except Exception:
            self._policy_error()
            fallback = True
            log.exception("policy %s failed; this step runs as vLLM FCFS", self.adapt_policy.name)
            self._fall_back(original)
        self._policy_s = time.monotonic() - now
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self._restore(original, deferred)  # admission order again, whatever the plan's order
            for request in self._held:  # after whatever vLLM left waiting, in their old order
                self.waiting.add_request(request)
            self._held = []
        self._after_schedule(now, output.num_scheduled_tokens)
        self._step_starts.append((now, output.total_num_scheduled_tokens > 0))
        if self.metrics is not None:
            self._record_step(now, self._policy_s, gap, fallback, len(deferred))
        if self._recording:
            self._record_decision(now, output)
        if self.monitor is not None:
            self._log_step(now, output)
        return output

    def shutdown(self) -> None:
        """vLLM's shutdown, after the prediction workers and the embedding process stop (a thread
        still inside a model at interpreter exit can abort the process) and the logs' buffers are
        written out (a server stopped under load would otherwise lose its last second of request
        and step records)."""
        self._stop_predictions()
        if self.monitor is not None:
            if self.monitor.decisions is not None:
                while self._undelivered:  # steps whose output never came: logged as such
                    self.monitor.decision(self._undelivered.popleft())
            self._flush_logs()
        super().shutdown()

    def _stop_predictions(self) -> None:
        """Stop every prediction worker, serving or swapped out, and the embedding process: the
        workers first (none takes another batch), then the child (a batch in flight in it ends at
        once), then join the workers. The child is closed wherever a worker started one, even if
        the policy serving now has no worker (swapped from sagesched to fcfs): it would outlive
        the engine in a longer-lived process, still holding MiniLM."""
        from predictors.embedding import close_child_process, compute_in_this_process

        queues = [*self.prediction_queues, *self._retired_queues]
        for queue in queues:
            queue.stop()
        if self._embedding_child:
            close_child_process()
        for queue in queues:
            queue.close()
        if self._embedding_child:
            compute_in_this_process()

    def _prediction_queue(self, function: BatchFunction) -> PredictionQueue:
        """A background worker for one of the policy's model calls (`Policy.use_predictions`),
        bounded by `ADAPT_PREDICTION_QUEUE` waiting submissions (default 256). With
        `ADAPT_EMBEDDING_PROCESS=1`, prompt embeddings, the costly part of those calls, run in a
        child process at the lowest CPU priority: in this process's worker thread they hold the GIL
        this engine loop needs. Off by default: sharing a CPU engine's cores it slowed vLLM more
        than the thread (`predictors.embedding_process` has the figures; it pays with cores of its
        own, `ADAPT_EMBEDDING_CPUS`), and on a GPU node it embeds on CPU where the thread would use
        the GPU."""
        if os.environ.get("ADAPT_EMBEDDING_PROCESS") == "1":
            from predictors.embedding import compute_in_child_process

            compute_in_child_process()
            self._embedding_child = True
        bound = int(os.environ.get("ADAPT_PREDICTION_QUEUE", "256"))
        queue = BackgroundWorker(function, max_pending=bound, warm_up_now=self._starting)
        # A policy swapped in gets the requests in flight with their arrival times; its model
        # starts on them now (the replay's queues open at the swap's step as well).
        queue.opened_s = time.monotonic()
        if self._recording:
            queue.handed_over = []  # the decision log records which step got each result
        self.prediction_queues.append(queue)
        return queue

    def _record_step(
        self, now: float, policy_s: float, gap: float | None, fallback: bool, deferred: int
    ) -> None:
        try:
            self.metrics.step(policy_s, gap, fallback)  # type: ignore[union-attr]
            self.metrics.deferred(deferred)  # type: ignore[union-attr]
            if self.metrics.due(now):  # type: ignore[union-attr]
                self._publish_metrics(now)
        except Exception:
            log.exception("metrics: could not record a step")

    def _publish_metrics(self, now: float) -> None:
        """The gauges (every `SchedulerMetrics.publish_interval_s`), and the online prediction
        quality, the predictions' summary and the policy's state into the status file."""
        predictions = self.prediction_summary()
        quality = self.metrics.publish(  # type: ignore[union-attr]
            now,
            policy=self.adapt_policy,
            waiting=self._waiting_view,
            running=sum(r.request_id in self._states for r in self.running),  # not those leaving now
            kv_usage=float(self.kv_cache_manager.usage),
            live=self.live,
            predictions=predictions,
        )
        if self.live is not None:
            self.live.report_quality(quality, predictions, self.adapt_policy.describe())

    def prediction_summary(self) -> dict[str, Any] | None:
        """What the serving policy's off-step model calls did (None: it makes none)."""
        if not self.prediction_queues:
            return None
        return PredictionStats.combined([queue.stats for queue in self.prediction_queues]).summary()

    def _record_decision(self, now: float, output: Any) -> None:
        """This step in `adapt.conformance`'s format: what arrived and left since the last one,
        what vLLM scheduled and preempted, and (filled in by `update_from_output`) when its
        output reached the scheduler."""
        record = {
            "index": int(self.current_step) - 1,
            "t": now,
            "arrived": self._arrived_since,
            "scheduled": dict(output.num_scheduled_tokens),
            "preempted": sorted(output.preempted_req_ids),
            "freed": sorted(self._freed_since),
            "finished": self._finished_since,
            **({"aborted": self._aborted_since} if self._aborted_since else {}),
            **({"prompt_texts": self._texts_since} if self._texts_since else {}),
            **({"answer_blocks": self._answer_blocks_since} if self._answer_blocks_since else {}),
            **({"prefix_cache_reset": self._cache_reset} if self._cache_reset else {}),
            **({"prefix_cache_reset_t": self._cache_reset_t} if self._cache_reset == "preempting" else {}),
            **({"streaming_sessions": self._sessions_since} if self._sessions_since else {}),
            "delivered_t": None,
            "predicted": [key for queue in self.prediction_queues for key in queue.handed_over or ()],
            **self._queues,
        }
        for queue in self.prediction_queues:
            queue.handed_over = []
        versions = self._live_versions()
        if versions != self._logged_versions:  # on the first record, then on each component swap
            record["components"] = self._logged_versions = versions
        if self._spec_to_log:  # the first record, and the first after a whole-policy swap
            record["policy"] = self._policy_spec
            self._spec_to_log = False
        if self.decisions is not None:
            self.decisions.append(record)
        self._undelivered.append(record)
        self._arrived_since, self._freed_since, self._finished_since = [], [], {}
        self._answer_blocks_since, self._cache_reset, self._sessions_since = {}, None, []
        self._aborted_since, self._texts_since = {}, {}

    def _live_versions(self) -> dict[str, str]:
        """The component versions serving (`attribute -> NAME@vN`), as a policy spec pins them;
        empty when the engine does not follow the registry."""
        if self.live is None:
            return {}
        return {
            attribute: f"{slot.name}@v{self.live.applied[attribute]}"
            for attribute, slot in self.live.slots.items()
            if self.live.applied[attribute] is not None
        }

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        if self._engine_async:
            super()._update_after_schedule(scheduler_output)
        else:
            Scheduler._update_after_schedule(self, scheduler_output)

    def _update_request_with_output(self, request: Any, new_token_ids: list[int], *args: Any, **kwargs: Any):
        if self._engine_async:
            return super()._update_request_with_output(request, new_token_ids, *args, **kwargs)
        return Scheduler._update_request_with_output(self, request, new_token_ids)

    def _apply_mechanics(self) -> None:
        """The serving policy's token budget is this step's (vLLM reads it in `schedule`), so a
        policy swapped in live brings its budget along; `_check` made sure it is within vLLM's."""
        budget = self.adapt_policy.token_budget
        self.max_num_scheduled_tokens = int(self.engine_token_budget if budget is None else budget)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        """vLLM's update, plus a finished (abort) output for each request the policy dropped:
        `finish_requests` is made for aborts the client started, so without this the client of
        a dropped request would wait for it forever."""
        self._output_at = time.monotonic()  # one moment for the whole output, as replay stamps it
        self._note_step_output(self._output_at)
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            self._deliver(scheduler_output)
        finally:
            self._output_at = None
        if self._sessions:  # a session whose input ran out leaves the batch, neither freed nor preempted
            self._running_ids.difference_update([i for i in self._sessions if self._paused(i)])
            if self._idle():
                self._flush_logs()
                if self.metrics is not None:
                    self._publish_metrics(time.monotonic())
        if self._drops_to_report:
            for request in self._drops_to_report:
                finished = EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                )
                if request.client_index in outputs:
                    outputs[request.client_index].outputs.append(finished)
                else:
                    outputs[request.client_index] = EngineCoreOutputs(outputs=[finished])
            self._drops_to_report = []
        return outputs

    def _note_step_output(self, now: float) -> None:
        """The policy's mean step time (`EngineView.mean_batch_time_s`), as the replay engine keeps
        it (`_note_batch_times`): a step that ran tokens counts from its start until its output
        came, taken in now. The gap to the next `schedule()` would count the idle time before it
        (vLLM's engine core waits for requests without scheduling) and vLLM's empty steps (every
        request deferred), which a policy that plans in steps (SLAI, JITServe) must not see as
        long or as free steps."""
        if not self._step_starts:
            return
        started, ran_tokens = self._step_starts.popleft()
        if ran_tokens:
            alpha, step_s = EngineConfig.batch_time_ema, now - started
            self._mean_batch_s = (
                step_s if self._mean_batch_s == 0 else (1 - alpha) * self._mean_batch_s + alpha * step_s
            )

    def _deliver(self, scheduler_output: Any) -> None:
        """A step's sampled tokens reached the scheduler: the policy sees them from now on (the
        replay engine's `_deliver`), stamped with this output's moment. Requests the output
        finished took theirs in `_free_request`, before their policy's `on_finish`."""
        now = self._output_at
        if self._undelivered:
            record = self._undelivered.popleft()
            record["delivered_t"] = now
            if self.monitor is not None and self.monitor.decisions is not None:
                self.monitor.decision(record)
                if self._idle():  # no step comes to flush it
                    self.monitor.decisions.flush()
        for request_id in scheduler_output.num_scheduled_tokens:
            request, state = self.requests.get(request_id), self._states.get(request_id)
            if request is not None and state is not None:
                self._take_output(request, state, now)

    @staticmethod
    def _take_output(request: Any, state: RequestState, now: float) -> None:
        generated = int(request.num_output_tokens)
        if generated > state.tokens_generated:
            state.last_token_s = now
            if state.first_token_s is None:
                state.first_token_s = now
            if state.phase != "preempted":
                state.phase = "decode"
            if state.slo.kind == "latency":  # as the replay's recorder counts them
                due = state.token_due_s
                state.tokens_on_time += sum(now <= due(i) for i in range(state.tokens_generated, generated))
        state.tokens_generated = generated

    def _log_step(self, now: float, output: Any) -> None:
        """Step-log row of the previous step, whose duration is known now (the gap to this
        schedule call), then remember this step's features (`adapt.steplog` columns)."""
        try:
            if self._last_step is not None:  # its duration includes the intake of what arrived since
                start, features = self._last_step
                self.monitor.step(start, now - start, {**features, ARRIVALS: self._arrivals})
            self._arrivals = 0
            work = []
            for request_id, n in output.num_scheduled_tokens.items():
                request = self.requests.get(request_id)
                if request is None:
                    continue
                cached = request.num_computed_tokens - n  # vLLM advanced it inside schedule()
                is_decode = n == 1 and cached >= request.num_prompt_tokens
                work.append((n, cached, is_decode, cached + n >= request.num_tokens))
            features = {**step_batch(work).as_row(), POLICY_S: self._policy_s}
            self._last_step = (now, features) if features["tokens"] else None
        except Exception:
            log.exception("step log: could not record a step")

    def _resumed_waiting(self, request_id: str) -> bool:
        """A session that waits with its next input, not as the policy's (a preempted one is)."""
        return request_id in self._sessions and request_id not in self._waiting_states

    def _resumed_session(self, request_id: str) -> bool:
        """A streaming-input session vLLM resumed with its next input (ahead of the waiting queue):
        no new admission for the policy, which sees its grown prompt now."""
        state = self._states.get(request_id)
        if request_id not in self._sessions or state is None or state.phase not in ("prefill", "decode"):
            return False
        self._refresh_session(state, self.requests[request_id])
        return True

    @staticmethod
    def _refresh_session(state: RequestState, request: Any) -> None:
        """A session's next input joined its prompt (with the answers kept before it): the state
        takes vLLM's counts, and prefills again."""
        if state.prompt_tokens != request.num_prompt_tokens:
            state.phase = "prefill"
        state.prompt_tokens = request.num_prompt_tokens
        state.max_tokens = request.max_tokens or 0
        state.tokens_generated = request.num_output_tokens
        state.tokens_computed = request.num_computed_tokens

    def _sync(self) -> None:
        """Copy vLLM's computed-token counters into the policy's view (tokens and phases move when
        vLLM delivers a step's output, `_deliver`), and a streaming-input session's grown prompt."""
        for request in self.running:
            state = self._states.get(request.request_id)
            if state is not None:
                state.tokens_computed = request.num_computed_tokens
        if self._sessions:  # streaming-input sessions come back with more prompt
            for request in self.running:
                state = self._states.get(request.request_id)
                if state is not None and request.request_id in self._sessions:
                    self._refresh_session(state, request)

    def _view(self, now: float) -> EngineView:
        running = [self._states[r.request_id] for r in self.running if r.request_id in self._states]
        return EngineView(
            now=now,
            waiting=self._waiting_view,
            running=running,
            kv_usage=float(self.kv_cache_manager.usage),
            token_budget=int(self.max_num_scheduled_tokens),
            max_running=self.admission_cap,
            mean_batch_time_s=self._mean_batch_s,
            step_index=int(getattr(self, "current_step", 0)),
            kv_free_blocks=int(self.kv_cache_manager.block_pool.get_num_free_blocks()),
            kv_block_size=int(self.block_size),
        )

    def _apply(self, plan: Plan) -> list[Any]:
        """Apply drops, preemptions, running order/deferral and admission order; returns the
        running requests taken out for this step."""
        for state in plan.drop:  # checked before anything changes: the step then runs as FCFS
            if state.id in self.requests and state.id not in self._waiting_states:
                raise running_drop(self.adapt_policy.name, state.id)
        if plan.drop:
            self._drop({s.id for s in plan.drop if s.id in self.requests})
        self._preempt_order = []
        for state in plan.preempt:
            request = self.requests.get(state.id)
            if request is not None and request in self.running:
                self.running.remove(request)
                self._preempt_request(request, time.monotonic())
                self._preempt_order.append(state.id)
        self._policy_preempts = len(self._preempt_order)
        by_id = {r.request_id: r for r in self.running}
        if plan.running_order is not None:
            order = [s.id for s in plan.running_order]
        else:
            skip = {s.id for s in plan.defer}
            order = [r.request_id for r in self.running if r.request_id not in skip]
        chosen = [by_id[i] for i in dict.fromkeys(order) if i in by_id]
        chosen_ids = {r.request_id for r in chosen}
        if self._recording:
            self._queues["order"] = [r.request_id for r in chosen]
        # vLLM evicts from the end of `chosen`: that is the order its preemptions happen in.
        self._preempt_order += [r.request_id for r in reversed(chosen)]
        deferred = [r for r in self.running if r.request_id not in chosen_ids]
        room = self.admission_cap - len(self.running)  # deferred requests hold their slots
        self.running = chosen
        # vLLM admits from its waiting queue only while fewer than this many run (and not at all
        # in a step that preempts): with the batch full, the queue needs no holding out -- which
        # costs O(waiting) each step, ~3% of a saturated CPU engine's time at 700 waiting.
        full = len(chosen) >= self.admission_cap
        if not self.waiting or full:
            return deferred
        # What the plan preempted this step sits it out, as in the replay engine: vLLM would
        # otherwise re-admit it in the same schedule() and the policy would never hear of either.
        preempted_now = self._preempt_order[: self._policy_preempts]
        admissible = {r.request_id for r in self.waiting}.difference(preempted_now)
        # A streaming-input session back with its next input is resumed ahead of the plan, as vLLM
        # 0.32 does from its queue of KV-holding requests; older vLLMs put it in this queue.
        front = [r for r in self.waiting if self._resumed_waiting(r.request_id)] if self._sessions else []
        for state in plan.admit or ():
            if len(front) >= room:
                break
            if state.id in admissible:
                admissible.discard(state.id)  # a plan that lists a request twice admits it once
                front.append(self.requests[state.id])
        # Only what the plan lists may be admitted, as in the replay engine: the rest of the queue
        # sits out this step (put back after it), but for requests the policy cannot plan.
        front_ids = {r.request_id for r in front}
        front_ids.update(self._unplanned_kept(admissible - front_ids, room - len(front)))
        self._held = [r for r in self.waiting if r.request_id not in front_ids]
        if self._held:
            self.waiting.remove_requests(self._held)
        if front:
            self.waiting.remove_requests(front)
            self.waiting.prepend_requests(reversed(front))  # extendleft reverses: keep plan order
        return deferred

    def _drop(self, request_ids: set[str]) -> None:
        """Abort the waiting requests the plan dropped, each once however often it lists them
        (`update_from_output` reports them to their clients). `_dropped_ids` holds them only while
        `finish_requests` frees them, for `_free_request` to log them as dropped: an id given for
        a request that had already left would otherwise stay, and mark a later request reusing it."""
        if not request_ids:
            return
        if self.metrics is not None:  # counted first: the last drop may publish (idle engine)
            self.metrics.dropped("admission_control", len(request_ids))
        self._dropped_ids = request_ids
        try:
            self._drops_to_report += self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        finally:
            self._dropped_ids = set()

    def _unplanned_kept(self, admissible: set[str], room: int) -> list[str]:
        """The waiting requests the policy cannot plan (`_unplanned`) that stay queued, in FCFS
        order after the plan's: otherwise nothing would ever admit them. At most `room` of them:
        vLLM checks its cap against `running`, which lacks this step's deferred requests, and
        would admit past `max_num_seqs`. None the plan preempted this step (not `admissible`)."""
        if room <= 0 or not self._unplanned:
            return []
        unplanned = self._unplanned.intersection(admissible)
        return [r.request_id for r in self.waiting if r.request_id in unplanned][:room]

    def _fall_back(self, original: list[Any]) -> None:
        """The policy raised: this step runs as vLLM FCFS, from the running requests as they were,
        less those the plan preempted before it raised. vLLM's `_preempt_request` queued those:
        left in `running` too, vLLM would schedule them twice and count a phantom slot. They sit
        this step out, as a plan's victims do (and as vLLM's own do), so `_after_schedule` tells
        the policy of their preemption rather than vLLM re-admitting them unnoticed."""
        self.running = [r for r in original if r.status == RequestStatus.RUNNING]
        victims = set(self._preempt_order[: self._policy_preempts])
        held = [r for r in self.waiting if r.request_id in victims] if victims else []
        if held:
            self.waiting.remove_requests(held)
            self._held += held

    def _restore(self, original: list[Any], deferred: list[Any]) -> None:
        """Put deferred requests back, keeping admission order for the ones that stayed."""
        current = {id(r) for r in self.running}
        deferred_ids = {id(r) for r in deferred}
        kept = [
            r
            for r in original
            if id(r) in current or (id(r) in deferred_ids and r.status == RequestStatus.RUNNING)
        ]
        kept_ids = {id(r) for r in kept}
        self.running = kept + [r for r in self.running if id(r) not in kept_ids]

    def _after_schedule(self, now: float, scheduled: dict[str, int]) -> None:
        """Report admissions and vLLM's own preemptions to the policy. An admitted request's
        computed tokens are its prefix-cache hits when its policy hears of it, as in the replay:
        vLLM has already counted this step's tokens in (`_update_after_schedule`)."""
        running_now = {r.request_id for r in self.running}
        admitted = [r.request_id for r in self.running if r.request_id not in self._running_ids]
        if self._sessions:  # a session back with its next input was admitted once already
            admitted = [i for i in admitted if not self._resumed_session(i)]
        for request_id in admitted:  # in admission order, as the replay engine calls on_admit
            state = self._states.get(request_id)
            self._waiting_states.pop(request_id, None)
            if state is not None:
                state.phase = "prefill"
                computed = self.requests[request_id].num_computed_tokens
                state.tokens_computed = computed - scheduled.get(request_id, 0)  # its hits
                self._call("on_admit", state, now)
        left = self._running_ids - running_now
        rank = {request_id: n for n, request_id in enumerate(self._preempt_order)}
        preempted = 0
        for request_id in sorted(left, key=lambda i: rank.get(i, len(rank))):  # as they happened
            request = self.requests.get(request_id)
            state = self._states.get(request_id)
            if state is not None and request is not None and request.status == RequestStatus.PREEMPTED:
                self._preempted(state, now)
                preempted += 1
        self._running_ids = running_now
        if self.metrics is not None:
            self.metrics.admitted(len(admitted))
            self.metrics.preempted("policy", min(preempted, self._policy_preempts))
            self.metrics.preempted("kv_pressure", max(0, preempted - self._policy_preempts))
        self._policy_preempts = 0

    def _preempted(self, state: RequestState, now: float) -> None:
        """vLLM preempted this request (recompute): it waits again, and its policy is told. A
        policy whose `on_preempt` raised may never list it again (the adapter admits only what a
        plan lists): like one whose `on_arrival` raised, FCFS admits it (`_unplanned`)."""
        self._waiting_states[state.id] = state
        state.phase = "preempted"
        state.tokens_computed = 0
        state.num_preemptions += 1
        if not self._call("on_preempt", state, now):
            self._unplanned.add(state.id)


def block_keys(block_hashes: Sequence[Any]) -> list[str]:
    """Blocks' content as vLLM's prefix cache keys it (its block hashes, each covering the whole
    sequence up to its block's end), short enough for a log line: 8 bytes of each in hex. On
    arrival a request has one per full prompt block, and by its end one per full block of prompt
    and answer. A replay given them (`Request.prompt_blocks`, `Request.answer_blocks`) finds the
    hits vLLM finds."""
    return [bytes(block_hash)[:8].hex() for block_hash in block_hashes]
