"""A run stopped by SIGTERM / SIGINT leaves a checkpoint and says how to resume; a second signal
exits at once; one run directory has one writer, and a crashed writer's lock never blocks."""

import os
import signal
import subprocess
import sys
import time

import pytest

from gspo.logger import read_metrics

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "data.n_train=200", "data.n_eval=8",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "warmup.steps=2", "warmup.batch_size=8", "train.eval_every=0", "train.save_every=0",
        "train.progress=false", "train.tensorboard=false"]


def start(run_dir, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gspo", "train", "--output-dir", str(run_dir),
                             *TINY, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)


def wait_for(what, timeout: float = 120.0, proc=None):
    t0 = time.monotonic()
    while not what():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the run ended early (exit {proc.returncode}): {proc.stderr.read()[-2000:]}")
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"waited {timeout} s")
        time.sleep(0.2)


def steps_logged(run_dir) -> int:
    try:
        return max((r["step"] for r in read_metrics(run_dir)), default=0)
    except (FileNotFoundError, ValueError):
        return 0


def finish(proc, timeout: float = 120.0) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the run did not exit within {timeout} s of the signal")
    return proc.returncode, err


# SIGINT takes the same path (its first signal is also test_a_second_signal_exits_at_once's)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143),
                                       pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_a_signal_checkpoints_the_last_step_and_says_how_to_resume(tmp_path, sig, code):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "train.steps=100000")
    wait_for(lambda: steps_logged(run_dir) >= 2, proc=proc)
    proc.send_signal(sig)
    rc, err = finish(proc)
    assert rc == code, err[-2000:]
    assert "Traceback" not in err
    done = steps_logged(run_dir)  # the step under way finished, or was abandoned unlogged
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"gspo: stopped by {sig.name} after {done} of 100000 RL steps"), last
    assert f"continue with: gspo train --resume {run_dir}" in last
    assert (run_dir / "checkpoints" / f"step_{done:06d}" / "model.safetensors").is_file()
    # the resume continues from there, each step logged once
    out = subprocess.run([sys.executable, "-m", "gspo", "train", "--resume", str(run_dir),
                          f"train.steps={done + 1}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, done + 2))


# a run whose second update takes a minute: a callback marks its start and sleeps in it
SLOW_UPDATE = """
import pathlib, sys, time
import gspo
class SlowUpdate(gspo.Callback):
    def on_phase_begin(self, run, step, phase):
        if step == 1 and phase == "update":
            pathlib.Path(sys.argv[2]).touch()
            time.sleep(60)
gspo.train(gspo.load_config(None, sys.argv[3:]), sys.argv[1], callbacks=[SlowUpdate()])
"""


def test_a_second_signal_exits_at_once(tmp_path):
    # the first signal lands in an update, which it waits for (a minute here); the second one
    # must not wait. Signalling inside the update is what makes this deterministic: a signal
    # between steps (or in a rollout, which is abandoned) would stop the run at once anyway
    marker = tmp_path / "in_update"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_UPDATE, str(tmp_path / "run"),
                             str(marker), *TINY, "train.steps=3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_for(marker.exists, proc=proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)  # the handler runs (it interrupts the sleep, which then goes on)
    assert proc.poll() is None, "the first signal alone ended the run"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc, err = finish(proc, timeout=30)
    assert rc == -signal.SIGINT and time.monotonic() - t0 < 10, (rc, err[-2000:])
    assert "SIGINT received: stopping after the step under way" in err
    assert "Traceback" not in err


def test_one_writer_per_run_directory_and_a_killed_writer_does_not_block(tmp_path):
    run_dir = tmp_path / "run"
    first = start(run_dir, "train.steps=100000")
    wait_for(lambda: steps_logged(run_dir) >= 1, proc=first)
    config = (run_dir / "config.yaml").read_text()
    second = subprocess.run([sys.executable, "-m", "gspo", "train", "--output-dir", str(run_dir),
                             *TINY, "train.steps=1", "optim.lr=0.5"], capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert f"{run_dir} is in use by another gspo train (pid {first.pid} on " in second.stderr
    assert (run_dir / "config.yaml").read_text() == config  # the running run's files untouched
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate()
    # the lock died with its holder: the directory (no checkpoint yet) takes a new run
    third = subprocess.run([sys.executable, "-m", "gspo", "train", "--output-dir", str(run_dir),
                            *TINY, "train.steps=1"], capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-2000:]
    assert [r["step"] for r in read_metrics(run_dir)] == [1]


# ---- kill -9 at random points, resumed: the same run as one that was never killed

EXACT = TINY[:-4] + ["warmup.steps=20", "train.steps=6", "train.save_every=1", "train.keep_last=2",
                     "train.eval_every=2", "train.eval_k=2", "train.progress=false",
                     "train.tensorboard=false"]


def deterministic(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
            for r in rows]


def launch(run_dir, precision: str = "fp32") -> subprocess.Popen:
    """A fresh start while the directory holds no finished checkpoint, else --resume."""
    ckpts = run_dir / "checkpoints"
    resume = ckpts.is_dir() and any(p.name.startswith("step_") for p in ckpts.iterdir())
    where = ["--resume", str(run_dir)] if resume else ["--output-dir", str(run_dir)]
    return subprocess.Popen([sys.executable, "-m", "gspo", "train", *where, *EXACT,
                             f"train.precision={precision}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


# fp32 is slow-marked (out of CI, `pytest -m slow`): its kills exercise the same machinery as
# bf16-mixed's, and fp32's resume equality is also tested in-process (test_trainer)
@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow),
                                       "bf16-mixed"])
def test_killed_at_random_points_and_resumed_equals_an_uninterrupted_run(tmp_path, precision):
    """Bit for bit, in float32 and in bf16-mixed (float32 master weights and AdamW state in the
    checkpoint, bf16 matmuls recomputed the same way after a resume)."""
    import random

    from safetensors.torch import load_file
    ref = tmp_path / "ref"
    code, err = finish(launch(ref, precision))
    assert code == 0, err[-2000:]
    run, rng = tmp_path / "run", random.Random(0)
    # each kill waits for a point of progress, then a random moment past it: start-up or the
    # warm-up, a rollout, an update, a checkpoint write, an evaluation
    def saved() -> int:  # the newest checkpoint's step (older ones are pruned)
        steps = [int(p.name[5:]) for p in (run / "checkpoints").glob("step_*")]
        return max(steps, default=0)

    points = [lambda: True, lambda: steps_logged(run) >= 1, lambda: steps_logged(run) >= 3,
              lambda: saved() >= 4, lambda: steps_logged(run) >= 5]
    delays = [rng.uniform(3.0, 8.0)] + [rng.uniform(0.0, 1.0) for _ in points[1:]]
    for point, delay in zip(points, delays):
        proc = launch(run, precision)
        t0 = time.monotonic()
        while not point() and proc.poll() is None and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        time.sleep(delay)
        if proc.poll() is not None:
            break  # it finished first: nothing left to interrupt
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    code, err = finish(launch(run, precision))
    assert code == 0, err[-2000:]
    assert deterministic(read_metrics(run)) == deterministic(read_metrics(ref))
    want = load_file(ref / "checkpoints" / "step_000006" / "model.safetensors")
    got = load_file(run / "checkpoints" / "step_000006" / "model.safetensors")
    assert set(got) == set(want) and all(bool((got[k] == want[k]).all()) for k in want)
    assert {str(t.dtype) for t in got.values()} == {"torch.float32"}  # the master weights
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers  # a killed save's temp files are cleaned by the next


def test_under_torchrun_the_forwarded_copy_is_not_a_second_signal(tmp_path):
    # what torchrun does after SLURM signalled the whole job: each rank gets SIGTERM twice
    run_dir = tmp_path / "run"
    proc = start(run_dir, "train.steps=100000",
                 env={**os.environ, "TORCHELASTIC_RUN_ID": "test"})  # as torchrun sets it
    wait_for(lambda: steps_logged(run_dir) >= 1, proc=proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)  # apart, so that the handler has seen the first (signals pending coalesce)
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc)
    assert rc == 143, err[-2000:]  # a checkpointed stop, not the default action's -15
    assert "continue with: gspo train --resume" in err.strip().splitlines()[-1]


# ---- a stop request is honoured within one warm-up step, and within one evaluation batch

def signalled_when_started(run_dir, proc, after: float) -> float:
    """SIGTERM `after` seconds past the run taking its lock; returns when it was sent."""
    wait_for(lambda: (run_dir / ".lock").is_file(), proc=proc)
    time.sleep(after)
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(signal.SIGTERM)
    return time.monotonic()


def trained_weights(run_dir, step: int) -> dict:
    from safetensors.torch import load_file
    return load_file(run_dir / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


def test_a_signal_in_the_warm_up_stops_within_a_step_and_the_resume_continues_it(tmp_path):
    import torch
    run_dir, slow = tmp_path / "run", ["model.hidden_size=64", "warmup.batch_size=64"]
    proc = start(run_dir, *slow, "warmup.steps=1000000", "train.steps=1")
    sent = signalled_when_started(run_dir, proc, after=6.0)
    rc, err = finish(proc, timeout=60)
    assert rc == 143 and time.monotonic() - sent < 20, err[-2000:]  # not the 1e6 steps
    last = err.strip().splitlines()[-1]
    assert "stopped by SIGTERM during the warm-up, after " in last, last
    state = torch.load(run_dir / "checkpoints" / "step_000000" / "trainer_state.pt",
                       weights_only=True)["trainer_state"]
    done = state["warmup_done"]
    # resumed, the warm-up ends as if it had never stopped
    steps = [f"warmup.steps={done + 3}", "train.steps=1"]
    out = subprocess.run([sys.executable, "-m", "gspo", "train", "--resume", str(run_dir),
                          *steps], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ref = tmp_path / "ref"
    code, err = finish(start(ref, *slow, *steps), timeout=300)
    assert code == 0, err[-2000:]
    got, want = trained_weights(run_dir, 1), trained_weights(ref, 1)
    assert all(bool((got[k] == want[k]).all()) for k in want)
    assert deterministic(read_metrics(run_dir)) == deterministic(read_metrics(ref))


def test_a_signal_in_an_evaluation_stops_within_a_batch(tmp_path):
    run_dir = tmp_path / "run"
    # an evaluation of 50000 problems (~800 batches, minutes) right after a 2-step warm-up
    proc = start(run_dir, "data.digits=3", "data.n_eval=50000", "train.eval_every=1",
                 "train.eval_k=2", "rollout.max_new_tokens=16", "train.steps=1")
    sent = signalled_when_started(run_dir, proc, after=8.0)
    rc, err = finish(proc, timeout=60)
    assert rc == 143 and time.monotonic() - sent < 15, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert "(the evaluation before RL abandoned)" in last, last
    assert (run_dir / "checkpoints" / "step_000000" / "model.safetensors").is_file()
    assert not (run_dir / "metrics.jsonl").read_text().strip()  # no half evaluation logged


def test_train_steps_0_checkpoints_the_warm_up_for_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    code, err = finish(start(run_dir, "train.steps=0"))
    assert code == 0, err[-2000:]
    assert (run_dir / "checkpoints" / "step_000000" / "model.safetensors").is_file()
    out = subprocess.run([sys.executable, "-m", "gspo", "train", "--resume", str(run_dir),
                          "train.steps=1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "warm-up" not in out.stderr, out.stderr[-2000:]
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
