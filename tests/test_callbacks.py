"""Callbacks observe a run: every hook in order, with the values the run logs, and a run with
callbacks is the run without them."""

import gc

import pytest

from gspo import Callback
from gspo.callbacks import PHASES, Callbacks
from gspo.config import load_config
from gspo.logger import read_metrics
from gspo.trainer import train


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def on_train_begin(self, run):
        self.calls.append(("train_begin", run.start_step))

    def on_step_begin(self, run, step):
        self.calls.append(("step_begin", step))

    def on_phase_begin(self, run, step, phase):
        self.calls.append(("phase_begin", step, phase))

    def on_phase_end(self, run, step, phase, seconds):
        assert seconds >= 0
        self.calls.append(("phase_end", step, phase))

    def on_step_end(self, run, step, metrics):
        self.calls.append(("step_end", step, metrics["reward/mean"]))

    def on_evaluate(self, run, step, metrics):
        self.calls.append(("evaluate", step, metrics["eval/accuracy"]))

    def on_save(self, run, step):
        self.calls.append(("save", step))

    def on_train_end(self, run, summary):
        self.calls.append(("train_end", summary.steps))


def _without_times(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
            for r in rows]


def test_every_hook_is_called_in_order_with_what_the_run_logs(tmp_path, tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + ["train.save_every=2"])
    rec = Recorder()
    train(cfg, tmp_path / "run", callbacks=[rec])
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run")}
    phases = lambda s: [c for p in PHASES for c in (("phase_begin", s, p),  # noqa: E731
                                                    ("phase_end", s, p))]
    expected = [("train_begin", 0), ("evaluate", 0, rows[0]["eval/accuracy"])]
    for s in (0, 1):
        expected += [("step_begin", s), *phases(s), ("step_end", s, rows[s + 1]["reward/mean"]),
                     ("evaluate", s + 1, rows[s + 1]["eval/accuracy"])]
    expected += [("save", 2), ("train_end", 2)]
    assert rec.calls == expected


def test_a_run_with_callbacks_is_the_run_without(tmp_path, tiny_overrides):
    cfg = lambda: load_config(overrides=tiny_overrides)  # noqa: E731
    train(cfg(), tmp_path / "plain")
    train(cfg(), tmp_path / "observed", callbacks=[Recorder(), Recorder()])
    assert (_without_times(read_metrics(tmp_path / "plain"))
            == _without_times(read_metrics(tmp_path / "observed")))


def test_a_callback_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match="gspo.Callback instances, got function"):
        Callbacks([lambda run: None])


def test_a_callback_that_keeps_the_run_does_not_keep_it_alive_after_train(tmp_path,
                                                                         tiny_overrides):
    """run -> callbacks -> the callback -> run is a cycle; closing the run drops its callbacks,
    so reference counting frees the model and its process group's state, not a later collection
    (under torchrun, one at interpreter exit can abort the rank)."""
    from test_async_rollouts import runs_alive

    class Keeper(Callback):
        def on_train_begin(self, run):
            self.run = run

    gc.collect()
    before = runs_alive()
    gc.disable()
    try:
        train(load_config(overrides=tiny_overrides), tmp_path, callbacks=[Keeper()])
        assert runs_alive() == before
    finally:
        gc.enable()
