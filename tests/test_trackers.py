"""Tests for gspo.trackers (train.report_to): every tracker through its real library, read back
from what the library itself stored and compared with metrics.jsonl.

A tracker whose package is absent is skipped. Runs go through `gspo train` in subprocesses, so
each library's process-wide state (wandb's service, Trackio's store directory, read when it is
imported) stays out of this process; every store lies under the test's tmp directory.
"""

import contextlib
import copy
import signal
import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import TINY_OVERRIDES
from gspo.cli import main
from gspo.logger import MetricsLogger, read_metrics
from gspo.errors import ConfigError
from gspo.signals import Interrupted
from gspo.trackers import TRACKERS, open_trackers

PACKAGES = {"tensorboard": ["tensorboard"], "wandb": ["wandb"], "trackio": ["trackio"],
            "mlflow": ["mlflow", "sqlalchemy", "alembic"]}
INSTALLED = [n for n, packages in PACKAGES.items()
             if all(importlib.util.find_spec(p) for p in packages)]
RUN = "gspo-tracked"
TIMEOUT = 300
# --resume through the CLI; then, to spare a process, a second run in the same stores (another
# project; MLflow: the first run's database) logging NaN and inf
RESUME_THEN_LOG_NAN = """
import os, sys
from gspo.cli import main
from gspo.logger import MetricsLogger
run, nan_run, report_to = sys.argv[1:]
assert main(["train", "--resume", run, "train.steps=3"]) == 0
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{run}/mlflow.db"
with MetricsLogger(nan_run, report_to=report_to.split(","), project="gspo-nan") as ml:
    ml.log(1, {"nan": float("nan"), "inf": float("inf"), "ok": 0.5})
"""


def tracker_env(root: Path) -> dict:
    """This process's environment with every tracker's store under `root`, offline."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(root / "wandb"),
           "WANDB_SILENT": "true", "TRACKIO_DIR": str(root / "trackio")}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def python(*args, env, cwd) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@dataclass
class Tracked:
    root: Path        # the trackers' stores: wandb/, trackio/
    run: Path
    nan_run: Path     # RESUME_THEN_LOG_NAN's second run
    first_ids: dict   # trackers.json after the first start
    rows: list        # metrics.jsonl at the end
    configs: list     # (first step, config) of each start


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> Tracked:
    """A 2-step tiny run reporting to every installed tracker, then resumed for a third step
    (and RESUME_THEN_LOG_NAN's run of one row)."""
    if not INSTALLED:
        pytest.skip("no tracker package installed (pip install 'gspo[trackers]')")
    root = tmp_path_factory.mktemp("trackers")
    (root / "wandb").mkdir()
    env, run, nan_run = tracker_env(root), root / RUN, root / "nan-run"
    python("-m", "gspo", "train", "--output-dir", str(run), *TINY_OVERRIDES,
           f"train.report_to=[{','.join(INSTALLED)}]", env=env, cwd=root)
    first_ids = json.loads((run / "trackers.json").read_text())
    python("-c", RESUME_THEN_LOG_NAN, str(run), str(nan_run), ",".join(INSTALLED), env=env,
           cwd=root)
    resumed = yaml.safe_load((run / "config.yaml").read_text())
    first = copy.deepcopy(resumed)
    first["train"]["steps"] = 2
    return Tracked(root, run, nan_run, first_ids, read_metrics(run), [(0, first), (2, resumed)])


def history(rows: list[dict]) -> dict[str, list[tuple]]:
    """{metric: [(step, value), ...]} of rows like metrics.jsonl's."""
    out = {}
    for row in rows:
        for name, value in row.items():
            if name not in ("step", "timestamp"):  # timestamp: Trackio's own
                out.setdefault(name, []).append((row["step"], value))
    return out


# ---- what each library stored, read with the library's own reader ----------------------------

def tensorboard_events(run: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0,
                                                                        "tensors": 0})
    events.Reload()  # every event file: a resume adds one
    return events


def tensorboard_history(run: Path, root: Path) -> dict[str, list[tuple]]:
    events = tensorboard_events(run)
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def wandb_records(run: Path, root: Path):
    """The protobuf records of the run's offline .wandb files (one per start), oldest first.

    A .wandb file is W&B's 7-byte header, then LevelDB-log framing: 32 KiB blocks of chunks,
    each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    run_id = json.loads((run / "trackers.json").read_text())["wandb"]
    for path in sorted((root / "wandb" / "wandb").glob(f"offline-run-*-{run_id}/*.wandb")):
        data, pos, chunks = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunks += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(chunks)
                yield path, record
                chunks = b""


def wandb_history(run: Path, root: Path) -> dict[str, list[tuple]]:
    out = {}
    for _, r in wandb_records(run, root):
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                name = item.key or "/".join(item.nested_key)
                if not name.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                    out.setdefault(name, []).append((r.history.step.num,
                                                     json.loads(item.value_json)))
    return out


def mlflow_client(root: Path):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{root / RUN / 'mlflow.db'}")  # the tracked run's database


def mlflow_history(run: Path, root: Path) -> dict[str, list[tuple]]:
    client = mlflow_client(root)
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k))
            for k in client.get_run(run_id).data.metrics}


def trackio_storage(root: Path, monkeypatch):
    from trackio import sqlite_storage

    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", root / "trackio")  # read at import
    return sqlite_storage.SQLiteStorage


def test_resume_keeps_each_trackers_run_id(tracked):
    assert [r["step"] for r in tracked.rows] == [0, 1, 2, 3]
    assert set(tracked.first_ids) == set(INSTALLED) - {"tensorboard"}  # it has no run id
    assert json.loads((tracked.run / "trackers.json").read_text()) == tracked.first_ids


def test_tensorboard_holds_every_row_once_and_each_starts_config(tracked):
    pytest.importorskip("tensorboard")
    as_float32 = {k: [(s, float(np.float32(v))) for s, v in points]
                  for k, points in history(tracked.rows).items()}
    assert tensorboard_history(tracked.run, tracked.root) == as_float32
    texts = [(e.step, json.loads(e.tensor_proto.string_val[0]))
             for e in tensorboard_events(tracked.run).Tensors("config/text_summary")]
    assert texts == tracked.configs


def test_wandb_offline_runs_share_one_id_and_hold_every_row_and_the_config(tracked):
    pytest.importorskip("wandb")
    runs = [(path, r.run) for path, r in wandb_records(tracked.run, tracked.root)
            if r.WhichOneof("record_type") == "run"]
    assert len({path for path, _ in runs}) == 2  # the first start and the resume
    assert {(r.run_id, r.display_name, r.project) for _, r in runs} == {
        (tracked.first_ids["wandb"], RUN, "gspo")}  # so `wandb sync` joins them into one run
    configs = [{i.key: json.loads(i.value_json) for i in r.config.update if i.key != "_wandb"}
               for _, r in runs]
    assert configs == [config for _, config in tracked.configs]
    assert wandb_history(tracked.run, tracked.root) == history(tracked.rows)


def test_mlflow_run_is_continued_and_holds_every_row_and_the_config(tracked):
    pytest.importorskip("mlflow")
    client = mlflow_client(tracked.root)
    runs = client.search_runs([client.get_experiment_by_name("gspo").experiment_id])
    assert [(r.info.run_id, r.info.run_name, r.info.status) for r in runs] == [
        (tracked.first_ids["mlflow"], RUN, "FINISHED")]
    renamed = {k.replace("@", "_"): v for k, v in history(tracked.rows).items()}  # pass@k
    assert mlflow_history(tracked.run, tracked.root) == renamed
    first = tracked.configs[0][1]  # MLflow params are immutable: they keep the first start's
    assert runs[0].data.params == {f"{section}.{k}": str(v) for section, fields in first.items()
                                   for k, v in fields.items()}


def test_trackio_run_is_continued_and_holds_every_row_and_the_config(tracked, monkeypatch):
    pytest.importorskip("trackio")
    storage = trackio_storage(tracked.root, monkeypatch)
    assert storage.get_runs("gspo") == [RUN]
    logs = storage.get_logs("gspo", RUN, run_id=tracked.first_ids["trackio"])
    assert history(logs) == history(tracked.rows)
    config = storage.get_run_config("gspo", RUN)
    assert {k: v for k, v in config.items() if not k.startswith("_")} == tracked.configs[-1][1]


def test_every_tracker_stores_nan_and_inf(tracked, monkeypatch):
    """NaN and inf reach each library as floats (metrics.jsonl alone writes null)."""
    run = tracked.nan_run
    assert read_metrics(run) == [{"step": 1, "nan": None, "inf": None, "ok": 0.5}]
    readers = {"tensorboard": tensorboard_history, "wandb": wandb_history,
               "mlflow": mlflow_history,
               "trackio": lambda run, root: history(trackio_storage(root, monkeypatch).get_logs(
                   "gspo-nan", run.name))}
    for name in INSTALLED:
        stored = {k: points[0][1] for k, points in readers[name](run, tracked.root).items()}
        assert math.isnan(stored["nan"]) and stored["ok"] == 0.5, name
        # MLflow's SQL store clamps inf to the largest double
        assert stored["inf"] == (sys.float_info.max if name == "mlflow" else math.inf), name


def test_tensorboard_resume_purges_the_steps_past_the_checkpoint(tmp_path):
    """A run that crashed after logging step 5 resumes from its checkpoint at step 3: TensorBoard
    keeps steps 1-3 of the first writer and 4-6 of the second, each step once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, report_to=["tensorboard"]) as ml:
        for step in range(1, 6):
            ml.log(step, {"x": step})
    with MetricsLogger(tmp_path, report_to=["tensorboard"], resume_from_step=3) as ml:
        for step in range(4, 7):
            ml.log(step, {"x": 10 * step})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [
        (1, 1), (2, 2), (3, 3), (4, 40), (5, 50), (6, 60)]


def test_default_config_writes_metrics_jsonl_and_imports_no_tracker(tmp_path):
    """Nothing turns on because its package is installed: no tracker module is even imported,
    and nothing but the run directory appears (no ./wandb, ./mlflow.db, Trackio store)."""
    modules = ["torch.utils.tensorboard", "tensorboard", "wandb", "trackio", "mlflow"]
    script = ("import json, sys; from gspo import load_config, train\n"
              "train(load_config(overrides=sys.argv[2:]), sys.argv[1])\n"
              f"print(json.dumps([m for m in {modules!r} if m in sys.modules]))\n")
    overrides = [o for o in TINY_OVERRIDES if not o.startswith("train.tensorboard")]
    out = python("-c", script, str(tmp_path / "run"), *overrides, "train.steps=1",
                 "warmup.steps=0", "train.eval_every=0",
                 env=tracker_env(tmp_path / "stores"), cwd=tmp_path)
    assert json.loads(out.stdout.splitlines()[-1]) == []
    assert sorted(os.listdir(tmp_path)) == ["run"]
    assert sorted(os.listdir(tmp_path / "run")) == [".lock", "checkpoints", "config.yaml",
                                                    "metrics.jsonl"]


@pytest.mark.parametrize("name", list(TRACKERS))
def test_a_missing_tracker_package_is_one_line_before_any_training(name, tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setitem(sys.modules, TRACKERS[name].modules[0], None)  # its import raises
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), *TINY_OVERRIDES,
                 f"train.report_to=[{name}]"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"gspo: error: train.report_to names {name}")
    assert "pip install 'gspo[trackers]'" in err
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


def test_an_unknown_tracker_is_one_line_naming_the_choices(tmp_path, capsys):
    assert main(["train", "--output-dir", str(tmp_path / "run"),
                 "train.report_to=[wandb, neptune]"]) == 2
    assert capsys.readouterr().err == ("gspo: error: train.report_to must be one of tensorboard "
                                       "| wandb | trackio | mlflow, got 'neptune'\n")


def test_wandb_without_an_api_key_is_one_line_before_the_warm_up(tmp_path):
    """No key and no WANDB_MODE=offline: wandb refuses to start; the run stops at once with the
    fix, not with wandb's traceback after the warm-up has run."""
    pytest.importorskip("wandb")
    env = {k: v for k, v in tracker_env(tmp_path).items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               WANDB_DIR=str(tmp_path), WANDB_MODE="online")  # no ~/.netrc, no key
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "gspo", "train", "--output-dir", str(run),
                          *TINY_OVERRIDES, "train.report_to=[tensorboard, wandb]"],
                         env=env, cwd=tmp_path, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=TIMEOUT)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "warm-up:" not in out.stderr  # its log line
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("gspo: error: train.report_to=wandb: wandb could not start "
                           "(UsageError: No API key configured"), last
    assert "`wandb login`" in last and "WANDB_MODE=offline" in last
    assert "drop wandb from train.report_to" in last
    assert not (run / "checkpoints").exists() and not (run / "config.yaml").exists()


def test_the_trackers_opened_before_one_that_cannot_start_are_closed(tmp_path, monkeypatch):
    closed = []

    class Opens:
        run_id = None

        def __init__(self, run):
            pass

        def close(self):
            closed.append("opens")

    class Fails:
        fix = "do this"

        def __init__(self, run):
            raise OSError("the server is out of reach")

    monkeypatch.setitem(TRACKERS, "opens", Opens)
    monkeypatch.setitem(TRACKERS, "fails", Fails)
    with pytest.raises(ConfigError, match=r"^train.report_to=fails: fails could not start "
                                          r"\(OSError: the server is out of reach\); do this, "
                                          r"or drop fails from train.report_to$"):
        open_trackers(["opens", "fails"], tmp_path, "gspo", {}, None)
    assert closed == ["opens"]


def test_a_run_that_fails_or_is_stopped_is_not_marked_finished(tmp_path):
    """A run that stops on an error (here optim.lr=inf: NaN weights at RL step 1, after row 0
    was logged) was marked FINISHED in MLflow and exited 0 in wandb, like a run that finished;
    each now gets the status the process exits with (2: MLflow FAILED; a signal's 130 / 143:
    KILLED), and a run that finishes is still FINISHED / 0."""
    names = [n for n in ("wandb", "mlflow") if n in INSTALLED]
    if not names:
        pytest.skip("neither wandb nor mlflow installed")
    (tmp_path / "wandb").mkdir()
    env, run = tracker_env(tmp_path), tmp_path / RUN
    out = subprocess.run([sys.executable, "-m", "gspo", "train", "--output-dir", str(run),
                          *TINY_OVERRIDES, f"train.report_to=[{','.join(names)}]",
                          "optim.lr=inf"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert out.returncode == 2 and "logp contains NaN at RL step 1" in out.stderr, out.stderr
    assert [r["step"] for r in read_metrics(run)] == [0]  # it had logged, then failed
    if "mlflow" in names:
        client = mlflow_client(tmp_path)
        runs = client.search_runs([client.get_experiment_by_name("gspo").experiment_id])
        assert [r.info.status for r in runs] == ["FAILED"]
    if "wandb" in names:
        exits = [r.exit.exit_code for _, r in wandb_records(run, tmp_path)
                 if r.WhichOneof("record_type") == "exit"]
        assert exits == [2]


def closing_tracker(on_close):
    """A tracker class that logs nothing and calls on_close(exit_code) when closed."""
    class Tracker:
        run_id = None

        def __init__(self, run):
            pass

        def log(self, step, metrics):
            pass

        def close(self, exit_code=0):
            on_close(exit_code)
    return Tracker


@pytest.mark.parametrize("error, exit_code", [
    (None, 0), (ConfigError("bad"), 2), (RuntimeError("a bug"), 1),
    (Interrupted("stopped by SIGTERM", signal.SIGTERM), 143)])
def test_the_logger_closes_each_tracker_with_the_exit_status_of_the_run(tmp_path, monkeypatch,
                                                                        error, exit_code):
    closed = []
    monkeypatch.setitem(TRACKERS, "records",
                        closing_tracker(lambda code: closed.append(code)))
    with pytest.raises(type(error)) if error else contextlib.nullcontext():
        with MetricsLogger(tmp_path, report_to=["records"]) as ml:
            ml.log(1, {"x": 1.0})
            if error:
                raise error
    assert closed == [exit_code]


def test_mlflow_marks_a_run_by_its_exit_status(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from gspo.trackers import MLflow, RunInfo

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    statuses = {}
    for exit_code in (0, 1, 143):
        tracker = MLflow(RunInfo(tmp_path, "gspo", {}, None, None))
        tracker.close(exit_code)
        statuses[exit_code] = tracker._client.get_run(tracker.run_id).info.status
    assert statuses == {0: "FINISHED", 1: "FAILED", 143: "KILLED"}


def test_a_tracker_whose_close_raises_leaves_the_others_closed_and_the_runs_error_as_is(
        tmp_path, monkeypatch, caplog):
    closed = []

    def fails(code):
        closed.append("first")
        raise ConnectionError("final sync: the server is out of reach")

    monkeypatch.setitem(TRACKERS, "first", closing_tracker(fails))
    monkeypatch.setitem(TRACKERS, "second", closing_tracker(lambda code: closed.append("second")))
    with pytest.raises(KeyError, match="the run's own"):
        with MetricsLogger(tmp_path, report_to=["first", "second"]) as ml:
            ml.log(1, {"x": 1.0})
            raise KeyError("the run's own")
    assert closed == ["first", "second"]
    assert "closing Tracker failed (ConnectionError: final sync: the server is out of reach)" in caplog.text


@pytest.mark.parametrize("torn", ['{"mlflow": "ab', "", '["x"]', "\xff\xfe"])
def test_a_torn_trackers_json_starts_new_tracker_runs_on_resume(tmp_path, monkeypatch, caplog,
                                                                torn):
    """A kill while trackers.json was written (before it was written atomically) left it torn:
    every --resume then failed with a JSONDecodeError traceback."""
    seen = []

    class Records:
        def __init__(self, run):
            seen.append(run.run_id)
            self.run_id = "new-id"

    monkeypatch.setitem(TRACKERS, "records", Records)
    (tmp_path / "trackers.json").write_text(torn, encoding="latin-1")
    open_trackers(["records"], tmp_path, "gspo", {}, resume_from_step=1)
    assert seen == [None] and "trackers.json is unreadable" in caplog.text
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"records": "new-id"}
    assert [p.name for p in tmp_path.iterdir()] == ["trackers.json"]  # no temporary left
