"""`gspo plot RUN_DIR [RUN_DIR ...]`: PNG charts of metrics.jsonl, several runs overlaid.

One PNG per metric (named after the key, "/" -> "_") plus `summary.png`, a grid of them all.
Each run is a line labelled by its dir name. A metric is drawn from the rows that have it (so
sparse rows such as `eval/accuracy` join up); null (non-finite) values are skipped; a metric no
run has is left out. Uses matplotlib's Figure API directly (Agg), never pyplot's global state.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gspo import metrics as M
from gspo.logger import METRICS_FILE, read_metrics

DEFAULT_KEYS: tuple[str, ...] = tuple(M.TITLES)
TITLES = M.TITLES
Series = dict[str, tuple[list[float], list[float]]]  # run label -> (steps, values)


def plot_runs(
    run_dirs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike | None = None,
    keys: Sequence[str] = DEFAULT_KEYS,
) -> list[Path]:
    """Write one PNG per metric in `keys` plus summary.png; return the paths written.

    Default `out_dir`: `<run>/plots` for one run, `./plots` for several. Raises ValueError for
    a run dir without metrics.jsonl, or when none of `keys` appears in any run.
    """
    run_dirs = [Path(d) for d in run_dirs]
    runs = dict(zip(_labels(run_dirs), (_load_run(d) for d in run_dirs)))
    series = {key: _series(runs, key) for key in keys}
    series = {key: s for key, s in series.items() if s}
    if not series:
        raise ValueError(f"none of the metrics {list(keys)} appear in {[str(d) for d in run_dirs]}")
    out = Path(out_dir) if out_dir is not None else _default_out_dir(run_dirs)
    out.mkdir(parents=True, exist_ok=True)
    paths = [_save_metric_png(out, key, s) for key, s in series.items()]
    paths.append(_save_summary_png(out, series))
    return paths


def _load_run(run_dir: Path) -> list[dict]:
    """The run's metric rows; ValueError naming the dir when it has no metrics.jsonl, or the
    line and the fix when a line other than the last cannot be read."""
    if run_dir.is_file():  # e.g. the run's metrics.jsonl itself
        raise ValueError(f"{run_dir} is a file; pass the run directory that holds its "
                         f"{METRICS_FILE}, e.g. gspo plot {run_dir.parent}")
    if not run_dir.is_dir():
        raise ValueError(f"run dir does not exist: {run_dir}")
    if not (run_dir / METRICS_FILE).is_file():
        raise ValueError(f"no {METRICS_FILE} in run dir {run_dir}")
    try:
        return read_metrics(run_dir)
    except ValueError as e:  # a torn or edited line: say where a whole copy is
        copies = sorted(run_dir.glob(f"checkpoints/step_*/{METRICS_FILE}"))
        fix = (f"; delete or fix that line, or copy back {copies[-1]}, the latest checkpoint's "
               f"copy of the rows up to its step" if copies else "; delete or fix that line")
        raise ValueError(f"{e}{fix}") from None


def _labels(run_dirs: list[Path]) -> list[str]:
    """Dir names as legend labels, with as many parents added as it takes to tell a run from
    the others (the runs are keyed by label: two runs under one label would be drawn as one)."""
    paths = [d.resolve().parts for d in run_dirs]

    def label(p: tuple[str, ...]) -> str:
        depth = next((n for n in range(1, len(p)) if sum(q[-n:] == p[-n:] for q in paths) == 1),
                     1)  # 1: the same run given twice
        return "/".join(p[-depth:])
    return [label(p) for p in paths]


def _series(runs: dict[str, list[dict]], key: str) -> Series:
    """(steps, values) for `key` in every run that has at least one finite value of it."""
    series = {}
    for label, rows in runs.items():
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            steps, values = zip(*points)
            series[label] = (list(steps), list(values))
    return series


def _default_out_dir(run_dirs: list[Path]) -> Path:
    """`<run>/plots` for a single run; `./plots` when comparing runs."""
    return run_dirs[0] / "plots" if len(run_dirs) == 1 else Path("plots")


def _draw(ax, key: str, series: Series) -> None:
    """One metric on one axes: a line per run, markers when points are sparse."""
    for label, (steps, values) in series.items():
        ax.plot(steps, values, label=label, marker="o" if len(steps) <= 30 else None, ms=3)
    ax.set_title(TITLES.get(key, key))
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _save_metric_png(out: Path, key: str, series: Series) -> Path:
    """Write `<out>/<key with / as _>.png` for one metric."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), layout="constrained")
    _draw(fig.add_subplot(), key, series)
    path = out / f"{key.replace('/', '_')}.png"
    fig.savefig(path, dpi=100)
    return path


def _save_summary_png(out: Path, series: dict[str, Series]) -> Path:
    """Write `<out>/summary.png`, every plotted metric in a grid of up to three columns."""
    from matplotlib.figure import Figure

    ncols = min(3, len(series))
    nrows = math.ceil(len(series) / ncols)
    fig = Figure(figsize=(5 * ncols, 3.5 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (key, s) in zip(axes, series.items()):
        _draw(ax, key, s)
    for ax in axes[len(series) :]:
        ax.set_visible(False)
    path = out / "summary.png"
    fig.savefig(path, dpi=100)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry for `gspo plot`: print written paths; 0 on success, 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="gspo plot", description="Plot metrics.jsonl of one or more runs as PNG charts."
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run directories to overlay")
    parser.add_argument(
        "--out", type=Path, default=None,
        help="output dir (default: RUN/plots for one run, ./plots for several)",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed usage; report its code, don't exit
        return int(e.code or 0)
    try:
        paths = plot_runs(args.runs, args.out)
    except (ValueError, OSError) as e:
        print(f"gspo: error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
