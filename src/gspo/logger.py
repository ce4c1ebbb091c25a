"""Metrics: one JSON row per step in `run_dir/metrics.jsonl`, plus TensorBoard when available.

Each row is `{"step": k, "<name>": value, ...}`, flushed as it is written so a crash loses at
most the row being written. Values are plain JSON numbers; tensors and numpy scalars are
converted, and non-finite values (NaN, +-inf) are written as `null` so every line stays valid
JSON (strict parsers reject the `NaN` that Python's json emits by default). TensorBoard gets
the raw float, NaN included.

A disabled logger (non-zero ranks) does nothing, so the trainer never writes `if rank == 0`.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

log = logging.getLogger(__name__)
_said_tensorboard_missing = False


class MetricsLogger:
    """Append-only metrics writer for one run; see the module docstring for the format.

    `resume_from_step=None` starts a fresh metrics.jsonl (a run dir describes one run);
    `resume_from_step=k` keeps the existing rows with step <= k and appends after them, so a
    resumed run ends with the same file an uninterrupted run would have written.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        enabled: bool = True,
        tensorboard: bool = True,
        resume_from_step: int | None = None,
    ):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is None:
            self._file = open(self.path, "w")
        else:
            _truncate_after(self.path, resume_from_step)
            self._file = open(self.path, "a")
        if tensorboard:
            self._tb = _summary_writer(self.path.parent / TENSORBOARD_DIR, resume_from_step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write one row for `step` (to the file and TensorBoard)."""
        if self._file is None:
            return
        if "step" in metrics:
            raise ValueError("metrics must not contain a 'step' key; pass the step separately")
        values = {name: _to_number(name, v) for name, v in metrics.items()}
        row = {"step": int(step), **{k: _json_safe(v) for k, v in values.items()}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, v in values.items():
                self._tb.add_scalar(name, v, int(step))

    def close(self) -> None:
        """Flush and close the file and the TensorBoard writer; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a metrics.jsonl (given the file or its run dir); non-finite values are None.

    A torn last line (a crash mid-write) is skipped; a bad line elsewhere is an error.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file: {path}")
    lines = path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not valid JSON") from None
    return rows


def _truncate_after(path: Path, step: int) -> None:
    """Rewrite `path` atomically keeping only rows with step <= `step` (no file: create one)."""
    rows = read_metrics(path) if path.is_file() else []
    kept = "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows if r["step"] <= step)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(kept)
    os.replace(tmp, path)


def _summary_writer(log_dir: Path, resume_from_step: int | None):
    """A TensorBoard SummaryWriter, or None (said once, at info level) if tensorboard is absent.

    On resume, purge_step drops events a crashed run wrote past the checkpoint.
    """
    global _said_tensorboard_missing
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if not _said_tensorboard_missing:
            log.info("tensorboard is not installed; writing metrics.jsonl only")
            _said_tensorboard_missing = True
        return None
    purge = None if resume_from_step is None else resume_from_step + 1
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge)


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
