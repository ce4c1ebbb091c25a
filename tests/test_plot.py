"""Tests for gspo.plot: PNGs per metric and a summary, overlaid runs, CLI exit codes."""

import json

import pytest

from gspo.plot import DEFAULT_KEYS, main, plot_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_run(path, n_steps=12, with_eval=True, drop=()):
    """A run dir whose metrics.jsonl has every default key (eval every 4th step)."""
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, n_steps + 1):
            row = {"step": step, "reward/mean": step / n_steps, "clip/frac": 0.1,
                   "kl/old": None if step == 3 else 1e-3 * step, "entropy": 2.0 - 0.1 * step,
                   "response/len_mean": 20 + step}
            if with_eval and step % 4 == 0:
                row["eval/accuracy"] = 0.2 + 0.05 * step
            for key in drop:
                row.pop(key, None)
            f.write(json.dumps(row) + "\n")
    return path


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5_000, path  # axes, lines and text, not an empty canvas


def test_two_runs_write_valid_pngs_per_metric_and_summary(tmp_path):
    a = fake_run(tmp_path / "gspo")
    b = fake_run(tmp_path / "grpo", with_eval=False)
    paths = plot_runs([a, b], out_dir=tmp_path / "out")
    names = sorted(p.name for p in paths)
    expected = sorted(k.replace("/", "_") + ".png" for k in DEFAULT_KEYS) + ["summary.png"]
    assert names == sorted(expected)
    for path in paths:
        assert path.parent == tmp_path / "out"
        assert_png(path)


def test_single_run_defaults_to_its_plots_dir_and_skips_missing_metric(tmp_path):
    run = fake_run(tmp_path / "run", drop=("entropy",))
    paths = plot_runs([run], keys=("reward/mean", "entropy"))
    assert {p.parent for p in paths} == {run / "plots"}
    assert sorted(p.name for p in paths) == ["reward_mean.png", "summary.png"]


def test_run_without_metrics_is_a_value_error_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        plot_runs([tmp_path / "empty"])


def test_cli_prints_paths_and_returns_zero(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out.split()
    assert str(tmp_path / "out" / "summary.png") in printed


def test_cli_missing_run_dir_returns_two_with_one_error_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing" in err[0]


def test_cli_given_the_metrics_file_names_its_run_dir(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    assert main([str(run / "metrics.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"is a file; pass the run directory that holds "
                                             f"its metrics.jsonl, e.g. gspo plot {run}")


def test_cli_without_runs_returns_two(capsys):
    assert main([]) == 2


def test_runs_whose_dir_and_parent_names_match_are_each_drawn(tmp_path, monkeypatch):
    # sweeps laid out as <sweep>/<algorithm>/<seed>: two runs named exp/seed0 were one legend
    # label, and one run silently replaced the other in every chart
    import gspo.plot

    drawn = {}
    draw = gspo.plot._draw
    monkeypatch.setattr(gspo.plot, "_draw", lambda ax, key, series: (
        drawn.setdefault(key, series), draw(ax, key, series)))
    a = fake_run(tmp_path / "sweep_a" / "exp" / "seed0", n_steps=4)
    b = fake_run(tmp_path / "sweep_b" / "exp" / "seed0", n_steps=8)
    plot_runs([a, b], out_dir=tmp_path / "out", keys=("reward/mean",))
    assert drawn["reward/mean"] == {
        "sweep_a/exp/seed0": ([1, 2, 3, 4], [0.25, 0.5, 0.75, 1.0]),
        "sweep_b/exp/seed0": ([1, 2, 3, 4, 5, 6, 7, 8], [s / 8 for s in range(1, 9)])}
