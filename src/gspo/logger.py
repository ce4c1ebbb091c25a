"""Metrics: one JSON row per step in `run_dir/metrics.jsonl`, plus the trackers asked for.

Each row is `{"step": k, "<name>": value, ...}`, flushed as it is written so a crash loses at
most the row being written. Values are plain JSON numbers; tensors and numpy scalars are
converted, and non-finite values (NaN, +-inf) are written as `null` so every line stays valid
JSON (strict parsers reject the `NaN` that Python's json emits by default). The trackers of
`report_to` (gspo.trackers: tensorboard, wandb, trackio, mlflow) get the raw float, NaN included.

A disabled logger (non-zero ranks) does nothing, so the trainer never writes `if rank == 0`.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
from pathlib import Path
from typing import Any

from gspo.errors import TrainingError, first_line
from gspo.trackers import open_trackers

METRICS_FILE = "metrics.jsonl"
log = logging.getLogger(__name__)


class MetricsLogger:
    """Append-only metrics writer for one run; see the module docstring for the format.

    `resume_from_step=None` starts a fresh metrics.jsonl (a run dir describes one run);
    `resume_from_step=k` keeps the existing rows with step <= k and appends after them, so a
    resumed run ends with the same file an uninterrupted run would have written. `history`:
    the copy of metrics.jsonl a checkpoint holds (gspo.trainer.save), which is what agrees with
    the checkpoint: a deleted file, a torn line or a lost row is repaired from it, with a
    warning; without one, a torn last line (a crash mid-write) and rows after `k` are dropped,
    with a warning, and a line that cannot be read among the rows kept refuses the resume
    (TrainingError naming the line: see `check_resumable`).

    `report_to` names trackers (gspo.trackers.TRACKERS) that get every row too, with `config`
    (the resolved config as a nested dict) as their run's config, under `project`.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        enabled: bool = True,
        resume_from_step: int | None = None,
        report_to: list[str] = (),
        config: dict | None = None,
        project: str = "gspo",
        history: str | os.PathLike | None = None,
    ):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self._file = None
        self._trackers = []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None:  # before the trackers: it may refuse the resume
            _truncate_after(self.path, resume_from_step, history)
        self._trackers = open_trackers(list(report_to), self.path.parent, project, config or {},
                                       resume_from_step)
        self._file = open(self.path, "w" if resume_from_step is None else "a")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write one row for `step` (to the file and the trackers)."""
        if self._file is None:
            return
        if "step" in metrics:
            raise ValueError("metrics must not contain a 'step' key; pass the step separately")
        values = {name: _to_number(name, v) for name, v in metrics.items()}
        row = {"step": int(step), **{k: _json_safe(v) for k, v in values.items()}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        for tracker in self._trackers:
            tracker.log(int(step), values)

    def close(self, exit_code: int = 0) -> None:
        """Flush and close the file and the trackers, whose runs end with `exit_code`, the
        status the process exits with (0: finished; see Tracker.close); safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:  # each one, whatever another's close raises (a network
            try:                  # error at wandb's final sync): said, not raised over the
                tracker.close(exit_code)  # run's own status or error
            except Exception as e:
                log.warning("closing %s failed (%s: %s); metrics.jsonl holds every row",
                            type(tracker).__name__, type(e).__name__, first_line(e))

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # an error's status as gspo.cli exits with it (a GspoError's own, 128 + a signal's)
        self.close(0 if exc is None else getattr(exc, "exit_code", 1))


def progress(it, desc: str, enabled: bool):
    """`it` behind a tqdm bar on stderr where enabled (rank 0 with train.progress), else as is."""
    if not enabled:
        return it
    from tqdm.auto import tqdm
    return tqdm(it, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a metrics.jsonl (given the file or its run dir); non-finite values are None.

    A torn last line (a crash mid-write) is skipped; a bad line elsewhere is a ValueError naming
    the file and the line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file: {path}")
    rows, bad = _readable_rows(path)
    last = len(path.read_bytes().decode("utf-8", errors="replace").rstrip().splitlines())
    middle = [n for n in bad if n != last]
    if middle:
        raise ValueError(f"{path}:{middle[0]}: not a metrics row (a torn or edited line"
                         f"{f', {len(middle) - 1} more after it' if len(middle) > 1 else ''})")
    return rows


def _truncate_after(path: Path, step: int, history: str | os.PathLike | None = None) -> None:
    """Rewrite `path` atomically keeping only rows with step <= `step` (no file: create one),
    repaired from `history` (see MetricsLogger)."""
    rows = _resume_rows(path, step, Path(history) if history is not None else None)
    from gspo.checkpoint import write_text_atomic  # torch: only where a resume rewrites rows
    write_text_atomic(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))


def _resume_rows(path: Path, step: int, history: Path | None) -> list[dict]:
    """The rows of steps <= `step` a resume keeps: the checkpoint's copy where there is one
    (warning when the run's file disagrees), else the run's readable rows (warning about the
    others)."""
    rows, bad = _readable_rows(path) if path.is_file() else ([], [])
    kept = [r for r in rows if r["step"] <= step]
    check_resumable(path, step, history)
    if history is not None and history.is_file():
        saved = [r for r in _readable_rows(history)[0] if r["step"] <= step]
        if saved != kept:
            lost = sorted({r["step"] for r in saved} - {r["step"] for r in kept})
            what = ("is missing" if not path.is_file() else
                    f"lacks the rows of steps {_spans(lost)}" if lost else "differs from it")
            log.warning("%s %s: restored from the copy checkpoint %s holds (%d rows)", path,
                        what, history.parent.name, len(saved))
        return saved
    if not path.is_file() and step > 0:
        log.warning("%s is missing and the checkpoint holds no copy of it: the metrics of "
                    "steps 0-%d are lost; the resumed run logs from step %d", path, step, step + 1)
    elif bad:
        log.warning("%s: line(s) %s could not be read (torn or edited) and are dropped; the "
                    "checkpoint holds no copy to restore them from", path, _spans(bad))
    return kept


def check_resumable(path: Path, step: int, history: Path | None) -> None:
    """Refuse (TrainingError) a resume from `step` that would lose a row of metrics file
    `path`: a line that cannot be read among the rows of steps <= `step` (a readable row of
    such a step follows it), where `history`, the checkpoint's copy, is missing to restore it.
    A torn last line, or one among rows after `step`, goes with those rows anyway."""
    if (history is not None and history.is_file()) or not path.is_file():
        return
    rows, bad = _readable_rows(path, numbered=True)
    lost = [n for n in bad if any(line > n and row["step"] <= step for line, row in rows)]
    if lost:
        raise TrainingError(
            f"{path}:{lost[0]}: not a metrics row (a torn or edited line"
            f"{f', {len(lost) - 1} more after it' if len(lost) > 1 else ''}), and the "
            f"checkpoint of step {step} holds no copy of the file to restore it from; delete or "
            f"fix that line, then resume again")


def _readable_rows(path: Path, numbered: bool = False) -> tuple[list, list[int]]:
    """(the rows of `path` that parse as JSON objects with a step, as (line number, row) where
    `numbered`, the numbers of the other non-empty lines)."""
    rows, bad = [], []
    text = path.read_bytes().decode("utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append((number, row) if numbered else row)
        else:
            bad.append(number)
    return rows, bad


def _spans(numbers: list[int]) -> str:
    """'1-3, 7' for [1, 2, 3, 7]."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _to_number(name: str, value: Any) -> float | int:
    """Python number from a number, a one-element tensor or array, or a numpy scalar."""
    if hasattr(value, "item"):  # torch tensor, numpy array or numpy scalar
        if _numel(value) != 1:
            raise ValueError(f"metric {name!r} has {_numel(value)} elements; log a scalar")
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {name!r} is a {type(value).__name__}, not a number")


def _numel(value: Any) -> int:
    """Element count of a tensor (numel) or numpy array (size)."""
    return value.numel() if hasattr(value, "numel") else int(value.size)


def _json_safe(value: float | int) -> float | int | None:
    """None for NaN/inf, which JSON cannot represent; the value otherwise."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
