"""Registry and hot swap against a real sqlite-backed MLflow in a temp dir."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlflow.exceptions import MlflowException, RestException

from adapt.component import HEADER, MANIFEST, ComponentError, read_component, sha256_file
from adapt.hotswap import Slot
from adapt.registry import ChampionMoved, Registry, RegistryError, StoreLocked
from predictors.cost_model import FittedCostModel
from predictors.semantic_history import SemanticHistory
from serving_hooks.policies.config import PolicyConfig
from tests.replay_helpers import step_log

pytestmark = pytest.mark.slow


@pytest.fixture
def reg(tmp_path) -> Registry:
    return Registry(f"sqlite:///{tmp_path / 'mlflow.db'}", cache_dir=tmp_path / "cache")


def artifact_dir(reg: Registry, name: str, version: int) -> Path:
    """Where the store keeps a version's component files (to tamper with them in tests)."""
    mv = reg.client.get_model_version(name, str(version))
    model = reg.client.get_logged_model(mv.model_id or mv.source.removeprefix("models:/"))
    root = Path(model.artifact_location.removeprefix("file://"))
    return next(root.rglob("component.json")).parent


def test_policy_config_round_trip_promote_rollback(reg):
    v1 = reg.log(PolicyConfig("fcfs"), metrics={"ttlt_mean": 3.0})
    v2 = reg.log(PolicyConfig("sarathi", {"token_budget": 256}), metrics={"ttlt_mean": 2.0})
    assert (v1, v2) == (1, 2)
    reg.promote("policy-config", v1)
    reg.promote("policy-config", v2)
    loaded = reg.load("policy-config")
    assert isinstance(loaded, PolicyConfig)
    assert (loaded.policy, loaded.params) == ("sarathi", {"token_budget": 256})
    assert loaded.build().token_budget == 256
    assert reg.resolve("policy-config", "previous") == v1
    assert reg.rollback("policy-config") == v1
    assert reg.load("policy-config").policy == "fcfs"
    with pytest.raises(RegistryError, match="no previous champion"):
        reg.rollback("policy-config")
    infos = {v.version: v for v in reg.versions("policy-config")}
    assert infos[1].aliases == ("champion",) and infos[2].metrics["ttlt_mean"] == 2.0
    assert infos[2].tags["adapt.component"] == "policy-config"
    assert len(infos[2].tags["adapt.manifest_sha256"]) == 64


def test_numeric_component_round_trip_and_pyfunc(reg):
    model = FittedCostModel(kv_capacity=1234).fit(step_log(noise=0.02))
    metrics = model.evaluate(step_log(seed=1, noise=0.02))
    assert metrics["mape"] < 0.05
    version = reg.log(model, metrics=metrics)
    reg.promote("cost-model", version)
    loaded = reg.load("cost-model", version=version)
    assert loaded.kv_capacity_tokens() == 1234
    probe = step_log(seed=2, n=10)
    assert np.allclose(loaded.predict(probe), model.predict(probe))
    import mlflow

    pyfunc = mlflow.pyfunc.load_model("models:/cost-model@champion")
    assert np.allclose(pyfunc.predict(probe), model.predict(probe))


def test_pyfunc_gives_a_predict_of_several_inputs_one_column_each(reg):
    """semantic-history's `predict(prompt_tokens, texts)` was handed the whole DataFrame as
    `prompt_tokens`. Requests without text are predicted by prompt length: no MiniLM here."""
    import mlflow
    import pandas as pd

    history = SemanticHistory(window=50, fallback_neighbors=2)
    history.observe([10, 20, 40, 80], [100, 200, 400, 800], np.zeros((4, 384), np.float32), [False] * 4)
    reg.promote("semantic-history", reg.log(history))
    pyfunc = mlflow.pyfunc.load_model("models:/semantic-history@champion")
    got = pyfunc.predict(pd.DataFrame({"prompt_tokens": [12, 70], "texts": [None, None]}))
    expected = history.predict([12, 70], [None, None])
    supports = [d.support.tolist() for d in got]
    assert supports == [d.support.tolist() for d in expected] == [[100.0, 200.0], [400.0, 800.0]]
    with pytest.raises(ValueError, match=r"predict takes prompt_tokens, texts; .*\(missing: texts\)"):
        pyfunc.predict(pd.DataFrame({"prompt_tokens": [12]}))


def test_cost_model_recovers_a_known_linear_model():
    data = step_log(n=2000)
    model = FittedCostModel().fit(data)
    assert model.evaluate(step_log(seed=5))["mape"] < 1e-6
    assert model.coef_[0] == pytest.approx(0.004, rel=1e-6)


def test_slot_follows_alias_within_two_poll_intervals(reg):
    v1 = reg.log(PolicyConfig("fcfs"))
    v2 = reg.log(PolicyConfig("spf"))
    reg.promote("policy-config", v1)
    with Slot(reg, "policy-config", interval_s=0.2) as slot:
        assert slot.version == v1 and slot.get().policy == "fcfs"
        reg.promote("policy-config", v2)
        moved = time.monotonic()  # the alias moves as the promotion ends
        while slot.version != v2 and time.monotonic() - moved < 2.0:
            time.sleep(0.01)
        assert slot.version == v2 and slot.get().policy == "spf"
        assert time.monotonic() - moved <= 2 * 0.2 + 0.3  # two intervals plus load time
        assert slot.previous[1] == v1
        assert slot.swaps == 2 and slot.failed_swaps == 0


def test_on_swap_is_called_once_per_version_that_goes_live_and_cannot_stop_a_swap(reg):
    """An engine that applies versions between its steps learns from `on_swap` that one is loaded
    (its status says so while it idles); a listener that raises leaves the swap in place."""
    v1, v2, v3 = (reg.log(PolicyConfig(name)) for name in ("fcfs", "spf", "edf"))
    reg.promote("policy-config", v1)
    calls: list[int | None] = []
    slot = Slot(reg, "policy-config", interval_s=60, on_swap=lambda: calls.append(slot.version))
    slot.start()
    try:
        assert calls == [v1]  # the first load
        assert slot.swap_now() is False and calls == [v1]  # nothing moved
        reg.promote("policy-config", v2)
        assert slot.swap_now() is True and calls == [v1, v2]

        def broken() -> None:
            raise OSError("status file not writable")

        slot.on_swap = broken
        reg.promote("policy-config", v3)
        assert slot.swap_now() is True and slot.version == v3 and slot.registry_errors == 0
    finally:
        slot.stop()


def _serving_then_promote_bad(reg, bad_version) -> Slot:
    slot = Slot(reg, "policy-config", interval_s=60).start()
    reg.promote("policy-config", bad_version)
    assert slot.swap_now() is False
    return slot


def test_corrupted_artifact_is_refused_and_old_version_keeps_serving(reg):
    good = reg.log(PolicyConfig("fcfs"))
    bad = reg.log(PolicyConfig("spf"))
    reg.promote("policy-config", good)
    header = artifact_dir(reg, "policy-config", bad) / "component.json"
    header.write_text(header.read_text().replace('"spf"', '"edf"'))
    slot = _serving_then_promote_bad(reg, bad)
    assert slot.version == good and slot.get().policy == "fcfs"
    assert slot.failed_swaps == 1 and "checksum mismatch" in slot.events[-1].detail
    assert slot.swap_now() is False and slot.failed_swaps == 1  # not retried until the alias moves


def test_artifact_that_would_need_pickle_is_refused(reg):
    good = reg.log(PolicyConfig("fcfs"))
    bad = reg.log(PolicyConfig("spf"))
    reg.promote("policy-config", good)
    (artifact_dir(reg, "policy-config", bad) / "model.pkl").write_bytes(b"\x80\x04K\x01.")
    slot = _serving_then_promote_bad(reg, bad)
    assert slot.version == good
    assert "would need code to load" in slot.events[-1].detail


def test_component_failing_validation_is_refused(reg):
    good = reg.log(PolicyConfig("fcfs"))
    bad = reg.log(PolicyConfig("no-such-policy"))
    reg.promote("policy-config", good)
    slot = _serving_then_promote_bad(reg, bad)
    assert slot.version == good and slot.get().policy == "fcfs"
    assert "unknown 'no-such-policy'" in slot.events[-1].detail


def test_unsafe_state_cannot_even_be_saved(tmp_path):
    class Pickly(PolicyConfig):
        def save_state(self, directory):
            (directory / "state.pkl").write_bytes(b"x")

    with pytest.raises(ComponentError, match="unsafe formats"):
        Pickly().save(tmp_path / "c")


def rewrite_header(directory: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    """Change a saved component's header as another version of the code might have written it,
    and record the header's new checksum, so that only what it says is under test."""
    header = json.loads((directory / HEADER).read_text())
    change(header)
    (directory / HEADER).write_text(json.dumps(header))
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest[HEADER] = sha256_file(directory / HEADER)
    (directory / MANIFEST).write_text(json.dumps(manifest))


def test_schema_version_mismatch_is_refused(tmp_path):
    directory = PolicyConfig("fcfs").save(tmp_path / "c")
    assert read_component(directory).policy == "fcfs"
    rewrite_header(directory, lambda header: header.update(schema_version=99))
    with pytest.raises(ComponentError, match="schema version 99"):
        read_component(directory)


@pytest.mark.parametrize(("version", "shown"), [("1", "'1'"), (1.0, "1.0"), (True, "True")])
def test_a_schema_version_that_is_no_integer_is_refused_showing_its_value(tmp_path, version, shown):
    directory = PolicyConfig("fcfs").save(tmp_path / "c")
    rewrite_header(directory, lambda header: header.update(schema_version=version))
    with pytest.raises(ComponentError, match=f"schema version {re.escape(shown)} is not the supported 1"):
        read_component(directory)


def test_a_header_without_a_schema_version_is_refused(tmp_path):
    directory = PolicyConfig("fcfs").save(tmp_path / "c")
    rewrite_header(directory, lambda header: header.pop("schema_version"))
    with pytest.raises(ComponentError, match="policy-config header has no schema_version"):
        read_component(directory)


def test_a_header_with_parameters_the_class_does_not_take_is_refused_naming_them(tmp_path):
    directory = PolicyConfig("fcfs").save(tmp_path / "c")
    rewrite_header(directory, lambda header: header["params"].update(order="spf", budget=3))
    with pytest.raises(
        ComponentError, match=r"unknown parameter\(s\) budget, order; PolicyConfig takes params, policy"
    ):
        read_component(directory)


def test_an_older_header_without_a_newer_parameter_loads_with_its_default(tmp_path):
    directory = PolicyConfig("sarathi", {"token_budget": 256}).save(tmp_path / "c")
    rewrite_header(directory, lambda header: header["params"].pop("params"))
    loaded = read_component(directory)
    assert (loaded.policy, loaded.params) == ("sarathi", None)


def test_numpy_parameters_load_back_as_the_numbers_they_were(tmp_path):
    model = FittedCostModel(kv_capacity=np.int64(50_000)).fit(step_log())
    loaded = read_component(model.save(tmp_path / "cost"))
    assert loaded.kv_capacity == 50_000 and type(loaded.kv_capacity) is int  # not '50000'
    config = PolicyConfig("sarathi", {"token_budget": np.int64(256)})
    assert read_component(config.save(tmp_path / "config")).params == {"token_budget": 256}


def test_a_parameter_json_cannot_hold_is_refused_by_name_before_anything_is_written(tmp_path):
    config = PolicyConfig("sarathi", {"token_budget": object()})
    with pytest.raises(ComponentError, match=r"policy-config: parameter params=\{'token_budget': <object"):
        config.save(tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_a_save_records_its_own_time_not_that_of_the_version_loaded(tmp_path):
    loaded = read_component(PolicyConfig("fcfs").save(tmp_path / "v1"))
    loaded.metadata["saved_at"] = 1.0  # a version saved long ago
    header = json.loads((loaded.save(tmp_path / "v2") / HEADER).read_text())
    assert header["metadata"]["saved_at"] > 1.0


def test_registry_unreachable_slot_keeps_serving_and_recovers(reg, tmp_path):
    v1 = reg.log(PolicyConfig("fcfs"))
    v2 = reg.log(PolicyConfig("spf"))
    reg.promote("policy-config", v1)
    db = tmp_path / "mlflow.db"
    with Slot(reg, "policy-config", interval_s=0.1, max_backoff_s=0.4) as slot:
        assert slot.version == v1
        # Overwrite the database in place (open connections see it too), then restore it.
        saved = db.read_bytes()
        db.write_bytes(b"this is not a database" * 512)
        time.sleep(1.0)
        assert slot.registry_errors >= 1
        assert slot.get().policy == "fcfs" and slot.version == v1
        db.write_bytes(saved)
        reg.promote("policy-config", v2)
        deadline = time.monotonic() + 5
        while slot.version != v2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert slot.version == v2


def test_readers_never_see_none_or_errors_during_50_swaps(reg):
    versions = [reg.log(PolicyConfig("fcfs")), reg.log(PolicyConfig("spf"))]
    reg.promote("policy-config", versions[0])
    slot = Slot(reg, "policy-config", interval_s=60).start()
    stop = threading.Event()
    problems: list[str] = []
    reads = [0] * 8

    def reader(index: int) -> None:
        while not stop.is_set():
            try:
                component, version = slot.snapshot()
                if component is None or version is None:
                    problems.append("saw None")
                elif component.policy != ("fcfs" if version == versions[0] else "spf"):
                    problems.append(f"mismatched snapshot {version} {component.policy}")
                reads[index] += 1
                time.sleep(0.0002)  # a scheduler step does other work between reads
            except Exception as exc:  # pragma: no cover - the assertion below reports it
                problems.append(repr(exc))

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for i in range(50):
        reg.promote("policy-config", versions[(i + 1) % 2])
        assert slot.swap_now() is True
    stop.set()
    for thread in threads:
        thread.join()
    assert problems == []
    assert slot.swaps == 51 and all(count > 0 for count in reads)


def test_two_processes_initialising_the_store_together(tmp_path):
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path / 'race.db'}"
    code = (
        "from adapt.registry import Registry; from serving_hooks.policies.config import PolicyConfig;"
        f"r = Registry({uri!r}, cache_dir={str(tmp_path / 'c')!r}); print(r.log(PolicyConfig('fcfs')))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1].decode()[-2000:] for o in outputs]
    assert sorted(int(o[0].decode().split()[-1]) for o in outputs) == [1, 2]


def test_models_cli_list_show_promote_rollback(tmp_path, capsys, monkeypatch):
    from adapt.cli import main

    uri = f"sqlite:///{tmp_path / 'cli.db'}"
    reg = Registry(uri, cache_dir=tmp_path / "c")
    reg.log(PolicyConfig("spf"), metrics={"ttlt_mean": 2.5})
    reg.log(PolicyConfig("fcfs"))
    assert main(["--tracking-uri", uri, "models", "promote", "policy-config", "1"]) == 0
    assert main(["--tracking-uri", uri, "models", "promote", "policy-config", "2"]) == 0
    capsys.readouterr()
    assert main(["--tracking-uri", uri, "models", "list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("policy-config"))
    assert row.split()[1:4] == ["2", "2", "1"]  # versions, champion, previous
    assert main(["--tracking-uri", uri, "models", "rollback", "policy-config"]) == 0
    assert reg.resolve("policy-config") == 1
    assert main(["--tracking-uri", uri, "models", "show", "policy-config"]) == 0
    assert "ttlt_mean: 2.5" in capsys.readouterr().out
    assert main(["--tracking-uri", uri, "models", "promote", "policy-config", "9"]) == 2
    assert "no version 9" in capsys.readouterr().err


def test_replay_with_a_registered_fitted_cost_model(tmp_path, monkeypatch):
    """Calibration loop: step log from one engine -> cost-model -> registry -> replay uses it."""
    import json

    from adapt.cli import main
    from adapt.replay.cost import roofline
    from adapt.replay.engine import EngineConfig, ReplayEngine
    from adapt.requests import Request
    from serving_hooks.policies import make_policy

    uri = f"sqlite:///{tmp_path / 'cm.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    rng = np.random.default_rng(0)
    requests = [
        Request(f"r{i}", i * 0.05, int(rng.integers(50, 1500)), int(rng.integers(5, 200))) for i in range(300)
    ]
    engine = ReplayEngine(
        make_policy("fcfs"), roofline("llama-2-7b", "a100-80g"), EngineConfig(record_steps=True)
    )
    reference = engine.run(requests).metrics()
    steps = engine.recorder.step_log()
    model = FittedCostModel(kv_capacity=roofline("llama-2-7b", "a100-80g").kv_capacity_tokens()).fit(steps)
    assert model.evaluate(steps)["median_ape"] < 0.10  # a linear fit of the piecewise roofline
    reg = Registry(uri, cache_dir=tmp_path / "c")
    reg.promote("cost-model", reg.log(model))
    trace = tmp_path / "t.csv"
    trace.write_text(
        "arrived_at,num_prefill_tokens,num_decode_tokens\n"
        + "\n".join(f"{r.arrival_s},{r.prompt_tokens},{r.output_tokens}" for r in requests)
    )
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "replay",
                "--trace",
                str(trace),
                "--model",
                "llama-2-7b",
                "--policies",
                "fcfs",
                "--no-mlflow",
                "--quiet",
                "--cost-model",
                "champion",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    fitted = json.loads(out.read_text())
    assert fitted["workload"]["cost_model"] == "cost-model v1"
    assert fitted["policies"]["fcfs"]["ttlt_mean"] == pytest.approx(reference["ttlt_mean"], rel=0.15)


def test_default_cache_lives_beside_an_embedded_store(tmp_path):
    """Deleting mlruns/ must delete the downloaded versions too (they are content-addressed, so a
    shared temp-dir cache grows with every fresh store)."""
    registry = Registry(f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    version = registry.log(PolicyConfig("fcfs"))
    registry.load("policy-config", version=version)
    assert registry.cache_dir == tmp_path / "store" / "model-cache"
    assert list((registry.cache_dir / "policy-config").iterdir())


def test_a_corrupt_store_copy_is_not_cached_so_repairing_the_store_fixes_the_load(reg):
    version = reg.log(PolicyConfig("sarathi", {"token_budget": 256}))
    header = artifact_dir(reg, "policy-config", version) / "component.json"
    intact = header.read_bytes()
    header.write_bytes(intact.replace(b"256", b"257"))
    with pytest.raises(ComponentError, match=r"the store's copy .* fails verification, not cached"):
        reg.load("policy-config", version=version)
    assert not list(reg.cache_dir.rglob("component.json"))
    header.write_bytes(intact)  # the store is repaired: no cache to delete by hand
    assert reg.load("policy-config", version=version).params["token_budget"] == 256


def test_a_cache_entry_damaged_later_is_downloaded_again(reg):
    version = reg.log(PolicyConfig("sarathi", {"token_budget": 256}))
    cached, _ = reg.download("policy-config", version)
    header = cached / "component.json"
    header.write_text(header.read_text().replace("256", "257"))
    assert reg.load("policy-config", version=version).params["token_budget"] == 256
    assert "256" in (cached / "component.json").read_text()


def test_a_slot_reconnects_when_its_store_file_is_replaced(reg, tmp_path):
    """A restore from backup replaces the sqlite file (a new inode); MLflow's pooled connections
    kept reading the old, deleted file, so the slot never saw the restored store's champion."""
    v1 = reg.log(PolicyConfig("fcfs"))
    v2 = reg.log(PolicyConfig("spf"))
    reg.promote("policy-config", v1)
    slot = Slot(reg, "policy-config", interval_s=60)
    assert slot.swap_now() and slot.version == v1
    backup = tmp_path / "backup.db"
    backup.write_bytes((tmp_path / "mlflow.db").read_bytes())
    Registry(f"sqlite:///{backup}", cache_dir=tmp_path / "cache").promote("policy-config", v2)
    backup.replace(tmp_path / "mlflow.db")  # restore: champion v2 in the file now in place
    assert slot.swap_now() and slot.version == v2 and slot.get().policy == "spf"
    assert slot.status()["reconnects"] == 1
    assert slot.swap_now() is False and slot.reconnects == 1  # ordinary polls do not reconnect
    reg.promote("policy-config", v1)  # writes through the new connection
    assert slot.swap_now() and slot.version == v1 and slot.reconnects == 1


def test_store_lock_is_per_store_and_released(tmp_path):
    uri = f"sqlite:///{tmp_path / 's.db'}"
    first, second = Registry(uri, cache_dir=tmp_path / "c"), Registry(uri, cache_dir=tmp_path / "c")
    with first.store_lock("retrain"):
        locked = r"s\.db\.retrain\.lock: another retrain holds this store"
        with pytest.raises(StoreLocked, match=locked), second.store_lock("retrain"):
            pass
        with second.store_lock("other-job"):  # locks are per purpose
            pass
    with second.store_lock("retrain"):
        pass


def test_server_store_lock_is_a_registered_model_with_stale_takeover(tmp_path):
    """The form `store_lock` takes on a server-backed store (any MLflow store runs it): creating a
    registered model is the test-and-set, so a second holder is refused; a stale one is taken over;
    the lock never shows among the components."""
    uri = f"sqlite:///{tmp_path / 's.db'}"
    first, second = Registry(uri, cache_dir=tmp_path / "c"), Registry(uri, cache_dir=tmp_path / "c")
    with first._model_lock("retrain", stale_after_s=3600):
        with pytest.raises(StoreLocked, match="another retrain holds"), second._model_lock("retrain", 3600):
            pass
        assert first.names() == []
        takeover = second._model_lock("retrain", stale_after_s=0.0)  # the first one looks dead
        with takeover, pytest.raises(StoreLocked), first._model_lock("retrain", stale_after_s=3600):
            pass
    with second._model_lock("retrain", stale_after_s=3600):  # released, by whoever held it last
        pass


@pytest.mark.parametrize(
    "error",
    [
        MlflowException("API request to http://mlflow:5000/... failed with exception ConnectionError"),
        RestException({"error_code": "PERMISSION_DENIED", "message": "Permission denied"}),  # a 403
    ],
    ids=["server-down", "forbidden"],
)
def test_a_server_store_lock_that_cannot_be_asked_is_an_error_not_another_holder(
    tmp_path, monkeypatch, error
):
    # Any MLflow error used to read as a lock held: a retrain exited as locked, a promotion waited 30 s.
    reg = Registry(f"sqlite:///{tmp_path / 's.db'}", cache_dir=tmp_path / "c")

    def fail(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(reg.client, "create_registered_model", fail)
    refused = pytest.raises(RegistryError, match="cannot take the retrain lock")
    with refused as raised, reg._model_lock("retrain", stale_after_s=3600):
        pass
    assert not isinstance(raised.value, StoreLocked) and raised.value.__cause__ is error


def test_a_server_store_lock_held_is_not_taken_over_when_its_holder_cannot_be_read(tmp_path, monkeypatch):
    # An error reading the holder used to count as "released meanwhile", so as stale: a live lock
    # was deleted to be taken over.
    uri = f"sqlite:///{tmp_path / 's.db'}"
    first, second = Registry(uri, cache_dir=tmp_path / "c"), Registry(uri, cache_dir=tmp_path / "c")
    with first._model_lock("retrain", stale_after_s=3600):
        held = first.client.get_registered_model("adapt-lock.retrain").tags

        def down(*args: Any, **kwargs: Any) -> None:
            raise MlflowException(
                "API request to http://mlflow:5000/... failed with exception ConnectionError"
            )

        monkeypatch.setattr(second.client, "get_registered_model", down)
        refused = pytest.raises(RegistryError, match=r"cannot read the lock adapt-lock\.retrain")
        with refused, second._model_lock("retrain", stale_after_s=3600):
            pass
        assert first.client.get_registered_model("adapt-lock.retrain").tags == held


def test_a_rest_stores_already_exists_is_a_held_server_store_lock(tmp_path, monkeypatch):
    """A REST store's client raises the server's "already exists" as a RestException built from
    its JSON: the same error code as a sqlite store's, so it still reads as another holder."""
    reg = Registry(f"sqlite:///{tmp_path / 's.db'}", cache_dir=tmp_path / "c")
    reg.client.create_registered_model(
        "adapt-lock.retrain", tags={"holder": "h:1", "since": str(time.time())}
    )

    def exists(*args: Any, **kwargs: Any) -> None:
        raise RestException({"error_code": "RESOURCE_ALREADY_EXISTS", "message": "already exists"})

    monkeypatch.setattr(reg.client, "create_registered_model", exists)
    held = pytest.raises(StoreLocked, match=r"another retrain holds this store \(h:1\)")
    with held, reg._model_lock("retrain", stale_after_s=3600):
        pass


def test_a_slot_holds_the_registered_metrics_of_the_version_it_serves(reg):
    """What a server compares its online measurements with (the drift alarm, serving_hooks.quality)."""
    v1 = reg.log(PolicyConfig("fcfs"), metrics={"coverage_at_0": 0.91, "coverage_at_50": 0.93})
    v2 = reg.log(PolicyConfig("spf"))
    reg.promote("policy-config", v1)
    slot = Slot(reg, "policy-config", interval_s=60)
    assert slot.held_out == {} and slot.last_swap_s is None
    slot.swap_now()
    assert slot.held_out == {"coverage_at_0": 0.91, "coverage_at_50": 0.93}
    assert reg.version_metrics("policy-config", v1) == slot.held_out
    first_swap = slot.last_swap_s
    assert first_swap is not None and abs(time.time() - first_swap) < 60
    reg.promote("policy-config", v2)
    slot.swap_now()
    assert slot.version == v2 and slot.held_out == {} and slot.last_swap_s >= first_swap


def test_a_version_whose_files_are_gone_is_refused_not_retried_as_an_outage(reg):
    # An artifact store pruned by hand, a lost bucket object: loading it fails the same way every
    # time. The slot used to take that for an unreachable registry and retry it forever.
    import shutil

    good = reg.log(PolicyConfig("fcfs"))
    gone = reg.log(PolicyConfig("spf"))
    reg.promote("policy-config", good)
    shutil.rmtree(artifact_dir(reg, "policy-config", gone))
    slot = _serving_then_promote_bad(reg, gone)
    assert slot.version == good and slot.failed_swaps == 1
    assert "no component files" in slot.events[-1].detail


def test_rollback_passes_over_a_deleted_version(reg):
    for policy in ("fcfs", "spf", "edf"):
        reg.promote("policy-config", reg.log(PolicyConfig(policy)))
    reg.client.delete_model_version("policy-config", "2")  # it also takes the `previous` alias
    assert reg.rollback("policy-config") == 1  # every rollback raised MLflow's "not found"
    assert reg.load("policy-config").policy == "fcfs"


def test_a_rollback_expecting_a_champion_or_target_that_changed_moves_nothing(reg):
    """The champion, and the version it goes back to, are read again under the aliases lock: a
    caller that decided on v3 -> v2 does nothing once either changed (`pipelines.watch`)."""
    for policy in ("fcfs", "spf", "edf"):
        reg.promote("policy-config", reg.log(PolicyConfig(policy)))
    with pytest.raises(ChampionMoved, match="the champion is v3 now, not v2; not rolled back"):
        reg.rollback("policy-config", expect_champion=2, expect_target=1)
    reg.client.delete_model_version("policy-config", "2")  # v3 would now go back to v1
    with pytest.raises(ChampionMoved, match="v3 goes back to v1 now, not v2; not rolled back"):
        reg.rollback("policy-config", expect_champion=3, expect_target=2)
    assert reg.resolve("policy-config") == 3
    assert reg.rollback("policy-config", expect_champion=3, expect_target=1) == 1


def test_promote_waits_for_a_rollback_in_progress_instead_of_undoing_it(reg):
    # Both read the champion history and write it back; overlapping, the later write lost the
    # earlier one (a rollback overlapping a promotion left neither). Now the second one waits
    # for the first to finish: here a holder of the lock that takes 0.5 s.
    import json

    for policy in ("fcfs", "spf"):
        reg.promote("policy-config", reg.log(PolicyConfig(policy)))
    third = reg.log(PolicyConfig("edf"))
    held = threading.Event()

    def hold():
        with reg._aliases_lock("policy-config"):
            held.set()
            time.sleep(0.5)

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(5)
    started = time.monotonic()
    Registry(reg.tracking_uri, cache_dir=reg.cache_dir).promote("policy-config", third)
    assert time.monotonic() - started >= 0.3
    thread.join(5)
    history = json.loads(reg.client.get_registered_model("policy-config").tags["adapt.champion_history"])
    assert reg.resolve("policy-config") == 3 and history == [1, 2, 3]


class _FakeStore:
    """A registry whose alias points at v2 and whose load of v2 does what the test says."""

    def __init__(self, load: Callable[[int], Any]) -> None:
        self._load = load
        self.loads = 0

    def reconnect_if_replaced(self) -> bool:
        return False

    def resolve(self, name: str, alias: str, missing_ok: bool = False) -> int:
        return 2

    def load(self, name: str, version: int) -> Any:
        self.loads += 1
        return self._load(version)

    def version_metrics(self, name: str, version: int) -> dict[str, float]:
        return {}


def _raises(exc: Exception) -> Callable[[int], Any]:
    def load(version: int) -> Any:
        raise exc

    return load


@pytest.mark.parametrize(
    "error", [ImportError("No module named 'torch'"), RuntimeError("state does not fit"), AttributeError("x")]
)
def test_a_version_that_fails_to_load_for_its_own_reasons_is_refused_not_retried_as_an_outage(error):
    # Only ComponentError and a few builtins were refused: a server without torch following
    # neural-length counted "registry unreachable" and downloaded the version again forever.
    store = _FakeStore(_raises(error))
    slot = Slot(store, "neural-length")  # type: ignore[arg-type]
    for _ in range(3):
        assert not slot.swap_now()
    assert store.loads == 1 and slot.failed_swaps == 1 and slot.registry_errors == 0
    assert slot.events[-1].detail == str(error)


@pytest.mark.parametrize("error", [OSError("connection reset"), RegistryError("no such version")])
def test_a_store_that_fails_while_loading_is_retried_not_the_version_refused(error):
    from mlflow.exceptions import MlflowException

    for failure in (error, MlflowException("API request failed")):
        store = _FakeStore(_raises(failure))
        slot = Slot(store, "qrf-length")  # type: ignore[arg-type]
        for _ in range(2):
            with pytest.raises(type(failure)):
                slot.swap_now()  # `_run` counts it a registry error and backs off
        assert store.loads == 2 and slot.failed_swaps == 0


def test_stopping_a_slot_without_waiting_returns_while_its_thread_is_loading():
    # A policy-config switch stops the old policy's slots inside the engine's step; `stop()` joined
    # a thread in the middle of a download for up to 10 s.
    loading, release = threading.Event(), threading.Event()

    def load(version: int) -> Any:
        if version == 2:  # the newly promoted version: a large download
            loading.set()
            release.wait(5)
        return PolicyConfig("fcfs")

    store = _FakeStore(load)
    store.resolve = lambda name, alias, missing_ok=False: 1  # type: ignore[method-assign]
    slot = Slot(store, "policy-config", interval_s=0.01).start()  # type: ignore[arg-type]
    assert slot.version == 1
    store.resolve = lambda name, alias, missing_ok=False: 2  # type: ignore[method-assign]
    assert loading.wait(5)  # the slot's thread is in the middle of loading v2
    started = time.monotonic()
    slot.stop(wait=False)
    assert time.monotonic() - started < 0.5
    release.set()
