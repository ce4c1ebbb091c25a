"""`gspo train` end to end on the math and code fixtures with the tiny model: the rewards of a
random model are ~0, so these check that the runs complete and log, not that they learn."""

from pathlib import Path

import pytest

from gspo import metrics as M
from gspo.config import ConfigError, load_config
from gspo.logger import read_metrics
from gspo.trainer import train

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


def test_train_on_the_math_fixture_with_a_warm_up_from_its_solutions(tmp_path, tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + [
        "data.task=math", f"data.path={DATA / 'math_mini.jsonl'}", "data.n_eval=4",
        "data.solution_field=solution", "warmup.steps=1", "warmup.batch_size=4", "train.steps=1"])
    summary = train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1] and summary.steps == 1
    assert 0.0 <= rows[1][M.REWARD_MEAN] <= 1.0 and rows[1][M.REWARD_FAILURES] == 0
    assert M.EVAL_ACCURACY in rows[1]


def test_train_on_the_code_fixture(tmp_path, tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + [
        "data.task=code", f"data.path={DATA / 'code_mini.jsonl'}", "data.n_eval=2",
        "data.code_timeout=2", "warmup.steps=0", "train.steps=1", "train.eval_k=1",
        "rollout.prompts_per_step=2", "rollout.group_size=2"])
    train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1][M.REWARD_FAILURES] == 0 and M.EVAL_ACCURACY in rows[1]


def test_warm_up_without_solutions_is_a_config_error(tmp_path, tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + [
        "data.task=math", f"data.path={DATA / 'math_mini.jsonl'}", "data.n_eval=4"])
    with pytest.raises(ConfigError, match="set warmup.steps=0"):
        train(cfg, tmp_path / "run")


def test_a_sandbox_that_cannot_run_programs_stops_the_run_at_start(tmp_path, tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + [
        "data.task=code", f"data.path={DATA / 'code_mini.jsonl'}", "data.n_eval=2",
        "warmup.steps=0", "data.code_python=/no/such/python3"])
    with pytest.raises(ConfigError, match="the code sandbox cannot run programs with "
                                          "/no/such/python3: .*set data.code_python"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before any step or evaluation


def test_held_out_accuracy_scores_correctness_without_the_format_bonus(tmp_path, tiny_overrides,
                                                                        monkeypatch):
    """data.format_weight is a training reward: a boxed wrong answer scores the bonus in
    training and 0 in the held-out evaluation, as `gspo eval` scores it."""
    from gspo import trainer

    cfg = load_config(overrides=tiny_overrides + [
        "data.task=math", f"data.path={DATA / 'math_mini.jsonl'}", "data.n_eval=4",
        "data.format_weight=0.5", "warmup.steps=0", "train.eval_k=1"])
    run = trainer.prepare(cfg, tmp_path / "run", resume=False)
    try:
        wrong, right = "so \\boxed{7}", "so \\boxed{6}"
        assert run.reward_fn(wrong, answer="6") == 0.5 and run.reward_fn(right, answer="6") == 1.5
        assert run.eval_reward_fn(wrong, answer="6") == 0.0
        assert run.eval_reward_fn(right, answer="6") == 1.0
        scored = []
        real = trainer.evaluate
        monkeypatch.setattr(trainer, "evaluate",
                            lambda engine, tok, rows, reward_fn, *a, **kw:
                            scored.append(reward_fn) or real(engine, tok, rows, reward_fn, *a, **kw))
        trainer.run_eval(run)
        assert scored == [run.eval_reward_fn]
    finally:
        trainer.close_run(run)
