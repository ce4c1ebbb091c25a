"""Callbacks: how code outside the trainer observes a run, as TRL's `TrainerCallback` does.

    class Clock(Callback):
        def on_phase_end(self, run, step, phase, seconds):
            print(step, phase, seconds)

    train(cfg, "runs/demo", callbacks=[Clock()])

The trainer calls each hook of each callback in order, in the trainer's thread (on every rank
under torchrun: a callback that writes should check `run.dist.is_main`). Hooks observe; they
return nothing and change nothing the run depends on, so a run with callbacks is the run
without them. The phases of an RL step, in order: "rollout" (sampling and rewards; with
rollout.max_staleness >= 1 the trainer's wait for the sampler), "old_logp" (pi_old and pi_ref)
and "update" (the minibatch updates and the weights' push to the engine). Benchmarks time,
count FLOPs and measure memory through these hooks.
"""

from __future__ import annotations

PHASES = ("rollout", "old_logp", "update")


class Callback:
    """Override the hooks you need; every one does nothing by default. `run` is the
    gspo.run.Run being trained (its cfg, model, engine, dist, ...); `step` counts from 0."""

    def on_train_begin(self, run) -> None:
        """The run is built (a resume's checkpoint restored) and warmed up; no RL step yet."""

    def on_step_begin(self, run, step: int) -> None:
        """RL step `step` starts."""

    def on_phase_begin(self, run, step: int, phase: str) -> None:
        """A phase of the step (PHASES) starts."""

    def on_phase_end(self, run, step: int, phase: str, seconds: float) -> None:
        """The phase ended after `seconds` of wall time."""

    def on_step_end(self, run, step: int, metrics: dict[str, float]) -> None:
        """RL step `step` is applied; metrics: its row of metrics.jsonl (without evaluation)."""

    def on_evaluate(self, run, step: int, metrics: dict[str, float]) -> None:
        """A held-out evaluation after `step` RL steps (0: before the first)."""

    def on_save(self, run, step: int) -> None:
        """A checkpoint of the state after `step` RL steps is written."""

    def on_train_end(self, run, summary) -> None:
        """train.steps are done (not called when the run stops early or fails)."""


class Callbacks(Callback):
    """A list of callbacks behind one Callback: each hook calls every one's, in order."""

    def __init__(self, callbacks=()):
        self.callbacks = list(callbacks or ())
        for c in self.callbacks:
            if not isinstance(c, Callback):
                raise TypeError(f"callbacks must be gspo.Callback instances, got "
                                f"{type(c).__name__}")

    def _each(name: str):
        def hook(self, *args):
            for c in self.callbacks:
                getattr(c, name)(*args)
        hook.__name__ = name
        return hook

    on_train_begin = _each("on_train_begin")
    on_step_begin = _each("on_step_begin")
    on_phase_begin = _each("on_phase_begin")
    on_phase_end = _each("on_phase_end")
    on_step_end = _each("on_step_end")
    on_evaluate = _each("on_evaluate")
    on_save = _each("on_save")
    on_train_end = _each("on_train_end")
    del _each
