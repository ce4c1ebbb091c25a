import dataclasses
import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gspo import Callback
from gspo import metrics as M
from gspo.checkpoint import latest_checkpoint
from gspo.config import load_config
from gspo.logger import read_metrics
from gspo.errors import TrainingError
from gspo.preflight import build_model
from gspo.signals import Interrupted
from gspo.trainer import train

REQUIRED_KEYS = ["step", M.REWARD_MEAN, M.REWARD_STD, M.LOSS, M.CLIP_FRAC, M.CLIP_FRAC_LOW,
                 M.CLIP_FRAC_HIGH, M.RATIO_MEAN, M.KL_OLD, M.ENTROPY, M.GRAD_NORM,
                 M.RESPONSE_LEN, M.TIME_ROLLOUT, M.TIME_UPDATE,
                 M.TOKENS_PER_S]
def digit_fraction(completion, **_):
    """A dense reward a random tiny model can earn: the share of digits in its answer."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


@pytest.fixture
def dense_reward(monkeypatch):
    """Swap the task's exact-match reward for one that gives non-zero advantages, so RL
    steps really move the weights."""
    import gspo.preflight as preflight

    real = preflight.build_task

    def build_task(d, *python_objects):
        train_rows, eval_rows, _, solution = real(d, *python_objects)
        return train_rows, eval_rows, digit_fraction, solution

    monkeypatch.setattr(preflight, "build_task", build_task)


def test_two_step_run_trains_and_logs_every_metric(tmp_path, tiny_overrides, dense_reward):
    cfg = load_config(overrides=tiny_overrides)
    initial = build_model(cfg)[0].state_dict()  # same seed -> the weights train() starts from
    summary = train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert M.EVAL_ACCURACY in rows[0] and M.LOSS not in rows[0]  # step 0: evaluation only
    for row in rows[1:]:
        for key in REQUIRED_KEYS + [M.EVAL_ACCURACY]:
            assert key in row, key
        assert math.isfinite(row["loss"])
    assert all(r["grad_norm"] > 0 for r in rows[1:])
    final = AutoModelForCausalLM.from_pretrained(latest_checkpoint(tmp_path / "run"))
    changed = [k for k, v in final.state_dict().items() if not torch.equal(v, initial[k])]
    assert changed, "no parameter changed"
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert summary.final_accuracy == rows[-1][M.EVAL_ACCURACY]


def test_checkpoint_loads_with_plain_transformers(tmp_path, tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + ["train.steps=1"])
    train(cfg, tmp_path / "run")
    ckpt = latest_checkpoint(tmp_path / "run")
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = tok("12+34=", return_tensors="pt").input_ids
    ours, tokenizer = build_model(cfg)
    ours.load_state_dict(model.state_dict())
    assert tok("12+34=").input_ids == tokenizer("12+34=").input_ids
    torch.testing.assert_close(model(ids).logits, ours(ids).logits)


def _strip_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
            for r in rows]


@pytest.mark.parametrize("algorithm", [["algorithm=gspo"], ["algorithm=grpo"],
                                       ["algorithm=gspo", "algorithm.beta=0.5"]])  # + pi_ref
def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path, tiny_overrides, algorithm,
                                                         dense_reward):
    base = tiny_overrides + algorithm + ["train.steps=4", "train.eval_every=2",
                                         "train.save_every=2"]
    train(load_config(overrides=base), tmp_path / "full")
    # the same run stopped after step 2, then resumed to step 4
    train(load_config(overrides=base + ["train.steps=2"]), tmp_path / "cut")
    train(load_config(overrides=base), tmp_path / "cut", resume=True)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert all(r["grad_norm"] > 0 for r in full[1:])  # the RL steps really updated the model
    assert _strip_timing(full) == _strip_timing(cut)
    a = AutoModelForCausalLM.from_pretrained(latest_checkpoint(tmp_path / "full")).state_dict()
    b = AutoModelForCausalLM.from_pretrained(latest_checkpoint(tmp_path / "cut")).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


class SigtermAfterStep(Callback):
    """SIGTERM to this process at the end of RL step `step` (index): its evaluation, next, is
    abandoned within a batch."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, run, step, metrics):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("steps", [4, 2])  # an evaluation mid-run, and the final one
def test_an_evaluation_a_sigterm_abandoned_is_made_by_the_resume(tmp_path, tiny_overrides,
                                                                  dense_reward, steps):
    """Stopped in the evaluation after step 2, the resumed run evaluates step 2 and logs its
    row once, with it: the metrics equal an uninterrupted run's (without the resume, step 2's
    row had no eval/* and a final evaluation was never made)."""
    base = tiny_overrides + [f"train.steps={steps}", "train.eval_every=2", "train.save_every=0"]
    summary = train(load_config(overrides=base), tmp_path / "full")
    with pytest.raises(Interrupted, match="after 2 of .* RL steps \\(its evaluation abandoned"):
        train(load_config(overrides=base), tmp_path / "cut", callbacks=[SigtermAfterStep(1)])
    resumed = train(load_config(overrides=base), tmp_path / "cut", resume=True)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert M.EVAL_ACCURACY in cut[2]
    assert _strip_timing(full) == _strip_timing(cut)
    assert resumed.final_accuracy == summary.final_accuracy


def test_a_checkpoint_a_killed_resave_moved_aside_is_what_the_resume_finds(tmp_path,
                                                                          tiny_overrides):
    """A re-save of a step renames the finished checkpoint to .old-step_N-PID before it renames
    the new one into place; a kill between the two left the run's only checkpoint hidden from
    --resume ("no finished checkpoint found there")."""
    run = tmp_path / "run"
    train(load_config(overrides=tiny_overrides + ["train.steps=0"]), run)
    ckpts = run / "checkpoints"
    (ckpts / "step_000000").rename(ckpts / ".old-step_000000-12345")  # killed there
    train(load_config(overrides=tiny_overrides + ["train.steps=1"]), run, resume=True)
    assert [r["step"] for r in read_metrics(run)] == [0, 1]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000000", "step_000001"]


def test_run_dir_with_checkpoints_is_never_overwritten(tmp_path, tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + ["train.steps=1"])
    train(cfg, tmp_path / "run")
    before = latest_checkpoint(tmp_path / "run")
    with pytest.raises(TrainingError, match="--resume"):
        train(cfg, tmp_path / "run")
    assert latest_checkpoint(tmp_path / "run") == before and before.is_dir()


def test_nan_loss_stops_with_a_clear_error_and_keeps_checkpoints(tmp_path, tiny_overrides,
                                                                monkeypatch):
    cfg = load_config(overrides=tiny_overrides + ["train.steps=3"])
    import gspo.objectives as objectives

    real = objectives.OBJECTIVES["gspo"]
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] > 4 else loss), metrics  # step 2 onwards

    monkeypatch.setitem(objectives.OBJECTIVES, "gspo", dataclasses.replace(real, fn=poisoned))
    with pytest.raises(TrainingError, match="non-finite loss"):
        train(cfg, tmp_path / "run")
    assert latest_checkpoint(tmp_path / "run").name == "step_000001"


def test_weights_an_absurd_lr_broke_stop_the_run_naming_the_lr(tmp_path, tiny_overrides):
    """optim.lr=1e30: the first update makes the weights overflow, and the next forward's
    log-probs are NaN; the run stops with a TrainingError naming the lr, not the objective's
    ValueError (a traceback in the CLI). The same for a warm-up at warmup.lr=1e30."""
    varied = lambda completion, **_: float(len(completion) % 3)  # noqa: E731
    cfg = load_config(overrides=tiny_overrides + ["train.steps=2", "warmup.steps=0",
                                                  "optim.lr=1e30", "train.eval_every=0"])
    with pytest.raises(TrainingError, match=r"contains NaN at RL step \d: the policy's weights "
                                            r"are no longer finite; lower optim.lr \(now 1e\+30\)"):
        train(cfg, tmp_path / "rl", reward_fn=varied)
    cfg = load_config(overrides=tiny_overrides + ["warmup.steps=3", "warmup.lr=1e30"])
    with pytest.raises(TrainingError, match=r"the warm-up's loss is nan after 3 steps: .* lower "
                                            r"warmup.lr \(now 1e\+30\)"):
        train(cfg, tmp_path / "warm")


def test_missing_model_path_is_a_clear_error(tmp_path, tiny_overrides):
    from gspo.models import ModelLoadError

    cfg = load_config(overrides=tiny_overrides + [f"model.name_or_path={tmp_path}/no-such-model"])
    with pytest.raises(ModelLoadError, match="no-such-model"):
        train(cfg, tmp_path / "run")


def test_a_saved_run_trains_from_a_local_model_path(tmp_path, tiny_overrides):
    train(load_config(overrides=tiny_overrides + ["train.steps=1"]), tmp_path / "a")
    ckpt = latest_checkpoint(tmp_path / "a")
    cfg = load_config(overrides=tiny_overrides + [f"model.name_or_path={ckpt}", "warmup.steps=0",
                                                  "train.steps=1"])
    summary = train(cfg, tmp_path / "b")
    assert summary.steps == 1 and latest_checkpoint(tmp_path / "b") is not None


REWARDS = Path(__file__).with_name("user_rewards.py")


def test_a_reward_failing_on_every_completion_of_the_first_step_stops_the_run(tmp_path,
                                                                            tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + [f"data.reward={REWARDS}:needs_a_missing_package"])
    with pytest.raises(TrainingError, match=r"the reward .*user_rewards.py:needs_a_missing_package "
                                            r"failed on 16 of 16 completions of the "
                                            r"first RL step \(first error: ModuleNotFoundError: "
                                            r"No module named 'gspo_no_such_package'\)"):
        train(cfg, tmp_path / "run")
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0]  # no step trained on it


def test_a_reward_failing_on_most_of_a_window_stops_the_run(tmp_path, tiny_overrides, monkeypatch):
    monkeypatch.setenv("GSPO_TEST_CALLS", "0")
    cfg = load_config(overrides=tiny_overrides + [
        f"data.reward={REWARDS}:fails_after_step_1", "train.steps=20", "train.eval_every=0",
        "train.save_every=0"])
    # step 1 scores, steps 2.. fail: after 10 steps 144 of 160 failed (> 0.5)
    with pytest.raises(TrainingError, match=r"failed on 144 of 160 completions of the last 10 RL "
                                            r"steps \(first error: RuntimeError: the scoring"):
        train(cfg, tmp_path / "run")
    assert max(r["step"] for r in read_metrics(tmp_path / "run")) == 9


def test_rewards_all_equal_for_five_steps_warn_that_nothing_is_learned(tmp_path, tiny_overrides,
                                                                      caplog):
    cfg = load_config(overrides=tiny_overrides + [f"data.reward={REWARDS}:constant",
                                                  "train.steps=6", "train.eval_every=0"])
    with caplog.at_level("WARNING", logger="gspo.step"):
        train(cfg, tmp_path / "run")
    said = [r.message for r in caplog.records if "was the same" in r.message]
    assert said == ["every reward of RL steps 1-5 was the same: the group advantages are 0 and "
                    "the policy does not learn; check the reward function and the data"]


def test_a_prompt_longer_than_the_context_fails_or_is_skipped_before_any_allocation(tmp_path,
                                                                                  tiny_overrides):
    # a 5 MB one-line prompt used to reach a 32 GB attention allocation
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    rows.insert(3, {"prompt": "7" * 5_000_000, "answer": "1"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    args = tiny_overrides + ["data.task=math", f"data.path={data}", "data.n_eval=4",
                             "warmup.steps=0", "data.eval_path=" + str(data).replace("d.jsonl", "e.jsonl"),
                             "data.reward=tests/dist_update_worker.py:digit_fraction"]
    with pytest.raises(TrainingError, match=r"1 training prompt\(s\) do not fit the model's "
                                            r"context of 512 tokens with rollout.max_new_tokens=4; "
                                            r"the first \(5000\d+ tokens\) starts '7777"):
        train(load_config(overrides=args), tmp_path / "fail")
    summary = train(load_config(overrides=args + ["data.on_bad_row=skip"]), tmp_path / "skip")
    assert summary.steps == 2


def test_a_run_with_grpos_clip_range_on_gspo_says_so(tmp_path, tiny_overrides, caplog):
    cfg = load_config(overrides=tiny_overrides + ["algorithm.eps_high=0.28", "train.steps=1",
                                                  "train.eval_every=0"])
    with caplog.at_level("WARNING", logger="gspo.trainer"):
        train(cfg, tmp_path / "run")
    assert [r.message.split(":")[0] for r in caplog.records if "clip range" in r.message] == [
        "algorithm.eps_high=0.28 is 700x gspo's own clip range (0.0004)"]
