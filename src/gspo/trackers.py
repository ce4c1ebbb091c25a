"""Experiment trackers for `train.report_to`: TensorBoard, Weights & Biases, Trackio, MLflow.

metrics.jsonl (gspo.logger) is always written. A tracker runs only when `train.report_to`
names it, never because its package happens to be installed (TRL's `report_to="all"` turns on
every installed integration; gspo does not). Each is a tiny class over its own library with
`log(step, metrics)` and `close(exit_code)`, opened on rank 0 by the MetricsLogger.

As in Hugging Face's Trainer, `train.project` is the project (wandb, Trackio) or experiment
(MLflow) and the run has a name, here the run directory's; the resolved config is the run's
config. `--resume` continues the same tracker run where the library can: the run ids are kept
in `run_dir/trackers.json`. Where each writes, offline by default except wandb's own mode:

    tensorboard  run_dir/tensorboard; a resume purges events past the checkpoint (purge_step)
    wandb        run_dir/wandb unless WANDB_DIR is set; WANDB_MODE=offline, as usual, for no
                 network (`wandb sync` uploads later); resume: the same run id
    trackio      Trackio's local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio);
                 resume: the run of the same project and name
    mlflow       run_dir/mlflow.db (SQLite) unless MLFLOW_TRACKING_URI is set; resume: the same
                 run id. Characters MLflow refuses in a metric name become '_'
                 (eval/pass@1 -> eval/pass_1)

Values go to every library as the raw float, NaN and inf included: each stores them as such
(metrics.jsonl alone writes null). Steps a crashed run logged after its last checkpoint are
logged again on resume; only TensorBoard drops the old ones.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gspo.errors import ConfigError, first_line

log = logging.getLogger(__name__)

TRACKERS_FILE = "trackers.json"
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DB = "mlflow.db"


@dataclass
class RunInfo:
    """What a tracker needs to open (or continue) its run."""
    run_dir: Path
    project: str
    config: dict            # the resolved config, nested as in the YAML file
    resume_from_step: int | None
    run_id: str | None      # this tracker's run id from trackers.json, when resuming

    @property
    def name(self) -> str:
        return self.run_dir.resolve().name


class Tracker(Protocol):
    run_id: str | None  # what a resume needs to find the run again (None: nothing)

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, exit_code: int = 0) -> None:
        """End the run as the process ends: 0 finished, else failed (128 + N: stopped by
        signal N, a checkpoint saved to resume from)."""


class TensorBoard:
    modules = ("torch.utils.tensorboard",)  # what it imports: its package, checked at start
    fix = "check that the run directory can be written"  # what to do when it cannot start

    def __init__(self, run: RunInfo):
        from torch.utils.tensorboard import SummaryWriter

        start = run.resume_from_step
        self.run_id = None
        self._writer = SummaryWriter(log_dir=str(run.run_dir / TENSORBOARD_DIR),
                                     purge_step=None if start is None else start + 1)
        self._writer.add_text("config", json.dumps(run.config, indent=2), start or 0)

    def log(self, step, metrics):
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def close(self, exit_code=0):
        self._writer.close()


class Wandb:
    modules = ("wandb",)
    fix = ("run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to log to the "
           "run directory for a later `wandb sync`")

    def __init__(self, run: RunInfo):
        import wandb

        self._run = wandb.init(project=run.project, name=run.name, config=run.config,
                               id=run.run_id, resume="allow" if run.run_id else None,
                               dir=os.environ.get("WANDB_DIR", str(run.run_dir)))
        self.run_id = self._run.id

    def log(self, step, metrics):
        self._run.log(metrics, step=step)

    def close(self, exit_code=0):
        self._run.finish(exit_code=exit_code)  # non-zero: the run shows as failed


class Trackio:
    modules = ("trackio",)
    fix = "check TRACKIO_DIR (its local store)"

    def __init__(self, run: RunInfo):
        import trackio

        # Trackio finds a run by project and name; "never" makes a new one on a fresh start
        self._run = trackio.init(project=run.project, name=run.name, config=run.config,
                                 resume="allow" if run.run_id else "never")
        self.run_id = self._run.id

    def log(self, step, metrics):
        self._run.log(metrics, step=step)

    def close(self, exit_code=0):
        self._run.finish()


class MLflow:
    modules = ("mlflow", "sqlalchemy", "alembic")  # the last two: its SQLite store
    fix = "check MLFLOW_TRACKING_URI (unset: run_dir/mlflow.db)"
    _BATCH = 100  # MLflow's limit of params (and tags) per log_batch call

    def __init__(self, run: RunInfo):
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from transformers.utils import flatten_dict

        # MLflow 3 refuses its old file store: a SQLite file is its local default
        db = (run.run_dir / MLFLOW_DB).resolve()
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{db}"
        self._client = client = MlflowClient(uri)
        if run.run_id is None:
            experiment = client.get_experiment_by_name(run.project)
            experiment_id = (experiment.experiment_id if experiment
                             else client.create_experiment(run.project))
            self.run_id = client.create_run(experiment_id, run_name=run.name).info.run_id
        else:
            self.run_id = run.run_id
            client.update_run(self.run_id, status="RUNNING")
        # params cannot change once logged: a resume adds only the new ones
        logged = client.get_run(self.run_id).data.params
        params = [(k, v) for k, v in flatten_dict(run.config).items() if k not in logged]
        for i in range(0, len(params), self._BATCH):
            client.log_batch(self.run_id, params=[Param(k, str(v))
                                                  for k, v in params[i:i + self._BATCH]])

    def log(self, step, metrics):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[
            Metric(re.sub(r"[^0-9A-Za-z_\-. :/]", "_", k), v, now, step)
            for k, v in metrics.items()])

    def close(self, exit_code=0):
        status = "FINISHED" if exit_code == 0 else "KILLED" if exit_code > 128 else "FAILED"
        self._client.set_terminated(self.run_id, status=status)


TRACKERS: dict[str, type] = {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio,
                             "mlflow": MLflow}


def require(names: list[str]) -> None:
    """Import each named tracker's library now, so a missing one fails before any training."""
    for name in names:
        try:
            for module in TRACKERS[name].modules:
                importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"train.report_to names {name}, but it cannot be imported ({e}); "
                              f"pip install 'gspo[trackers]' or drop {name} from "
                              f"train.report_to") from None


def open_trackers(names: list[str], run_dir: Path, project: str, config: dict,
                  resume_from_step: int | None) -> list[Tracker]:
    """Open the named trackers, continuing the runs trackers.json records when resuming, and
    record the runs' ids there. A tracker that cannot start (wandb without an API key, a
    tracking server out of reach) is a ConfigError naming it and the fix; the ones opened
    before it are closed."""
    path = run_dir / TRACKERS_FILE
    ids = _read_ids(path) if resume_from_step is not None else {}
    trackers = {}
    for name in names:
        try:
            trackers[name] = TRACKERS[name](RunInfo(run_dir, project, config, resume_from_step,
                                                    ids.get(name)))
        except Exception as e:  # the library's own (wandb: no API key, no network, ...)
            for opened in trackers.values():
                opened.close()
            why = first_line(e)
            raise ConfigError(f"train.report_to={name}: {name} could not start "
                              f"({type(e).__name__}: {why}); {TRACKERS[name].fix}, or drop "
                              f"{name} from train.report_to") from e
    ids.update({name: t.run_id for name, t in trackers.items() if t.run_id})
    if ids:  # atomically: a kill mid-write leaves the old file, not a torn one
        from gspo.checkpoint import write_text_atomic  # torch: only where a tracker has an id
        write_text_atomic(path, json.dumps(ids, indent=2) + "\n")
    return list(trackers.values())


def _read_ids(path: Path) -> dict:
    """The tracker runs trackers.json records, or none (said) where it is unreadable: the
    resume then starts new tracker runs rather than failing."""
    if not path.is_file():
        return {}
    try:
        ids = json.loads(path.read_text())
        if isinstance(ids, dict) and all(isinstance(v, str) for v in ids.values()):
            return ids
        why = "not a mapping of tracker names to run ids"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
    log.warning("%s is unreadable (%s): the resumed run's trackers start new runs instead of "
                "continuing the earlier ones", path, why)
    return {}

