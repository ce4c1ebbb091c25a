"""Tests for gspo.logger: JSONL rows, value conversion, disabled ranks, resume (the trackers
it also feeds are tested in test_trackers.py)."""

import json

import numpy as np
import pytest
import torch

from gspo.logger import MetricsLogger, read_metrics


def test_rows_round_trip_with_step_first(tmp_path):
    with MetricsLogger(tmp_path) as ml:
        ml.log(1, {"reward/mean": 0.5, "n": 3})
        ml.log(2, {"reward/mean": 0.75})
    assert read_metrics(tmp_path) == [{"step": 1, "reward/mean": 0.5, "n": 3},
                                      {"step": 2, "reward/mean": 0.75}]
    first_line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    assert list(json.loads(first_line)) == ["step", "reward/mean", "n"]


def test_rows_are_flushed_before_close(tmp_path):
    ml = MetricsLogger(tmp_path)
    ml.log(1, {"x": 1.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 1.0}]
    ml.close()
    ml.close()


def test_tensors_and_numpy_become_plain_numbers(tmp_path):
    with MetricsLogger(tmp_path) as ml:
        ml.log(torch.tensor(3), {
            "t0": torch.tensor(0.25), "t1": torch.tensor([2.0]), "np": np.float32(0.5),
            "np_int": np.int64(4), "arr": np.array(1.5), "flag": True,
        })
    assert read_metrics(tmp_path) == [
        {"step": 3, "t0": 0.25, "t1": 2.0, "np": 0.5, "np_int": 4, "arr": 1.5, "flag": 1}
    ]


def test_non_scalar_or_non_number_metric_is_an_error(tmp_path):
    with MetricsLogger(tmp_path) as ml:
        with pytest.raises(ValueError, match="'v' has 2 elements"):
            ml.log(1, {"v": torch.tensor([1.0, 2.0])})
        with pytest.raises(TypeError, match="'s'"):
            ml.log(1, {"s": "high"})
        with pytest.raises(ValueError, match="step"):
            ml.log(1, {"step": 1})


def test_non_finite_values_are_null_in_valid_json(tmp_path):
    with MetricsLogger(tmp_path) as ml:
        ml.log(1, {"nan": float("nan"), "inf": torch.tensor(float("inf")), "ok": 1.0})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    assert "NaN" not in line and "Infinity" not in line
    # parse_constant fires only on NaN/Infinity tokens, i.e. invalid strict JSON.
    row = json.loads(line, parse_constant=lambda c: pytest.fail(f"invalid JSON token {c}"))
    assert row == {"step": 1, "nan": None, "inf": None, "ok": 1.0}


def test_disabled_logger_writes_nothing(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, enabled=False) as ml:
        ml.log(1, {"x": 1.0})
    assert not run.exists()


def test_resume_keeps_rows_up_to_step_and_matches_uninterrupted_run(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    with MetricsLogger(full) as ml:
        for step in range(1, 7):
            ml.log(step, {"x": step / 10})
    with MetricsLogger(resumed) as ml:  # crashes after step 5, ckpt at 3
        for step in range(1, 6):
            ml.log(step, {"x": step / 10})
    with open(resumed / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "x"')  # torn last line
    with MetricsLogger(resumed, resume_from_step=3) as ml:
        assert [r["step"] for r in read_metrics(resumed)] == [1, 2, 3]
        for step in range(4, 7):
            ml.log(step, {"x": step / 10})
    assert (resumed / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()


def test_fresh_logger_starts_a_new_file(tmp_path):
    with MetricsLogger(tmp_path) as ml:
        ml.log(1, {"x": 1.0})
    with MetricsLogger(tmp_path) as ml:
        ml.log(1, {"x": 2.0})
    assert read_metrics(tmp_path) == [{"step": 1, "x": 2.0}]


def test_read_metrics_rejects_a_bad_middle_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "elsewhere")
