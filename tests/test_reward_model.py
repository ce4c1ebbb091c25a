"""Reward models (data.reward=model:PATH, gspo.rewards.model): the scores are the classifier's
own, batching changes nothing, a sum with a rule reward adds up as documented, a run trains with
one, a resume refuses another, and a wrong checkpoint is one ConfigError line."""

import io
import math
from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForSequenceClassification, GPT2Config,
                          GPT2ForSequenceClassification, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3ForSequenceClassification)

from gspo import metrics as M
from gspo.cli import main
from gspo.config import load_config
from gspo.data import RewardSum, score
from gspo.dryrun import dry_run
from gspo.errors import ConfigError, TrainingError
from gspo.logger import read_metrics
from gspo.models import IM_END, IM_START, build_tokenizer
from gspo.rewards import close_reward, parse_reward_spec
from gspo.rewards.model import RewardModel
from gspo.tasks import build_reward
from gspo.trainer import train

PROMPTS = ["12+7=", "3+4=", "88+1="]
COMPLETIONS = ["19", "7 is the answer, surely", "", "89", "x", "1234567"]


def save_checkpoint(path: Path, *, seed: int = 0, num_labels: int = 1, causal: bool = False,
                    chat_template: bool = True, gpt2: bool = False) -> Path:
    """A tiny random Qwen3 classifier (or causal LM; or a GPT-2 classifier) and gspo's
    character tokenizer, saved as a user's checkpoint would be: the config names no padding
    token (the reward must set it for the classifier to find each row's last token) and the
    tokenizer pads on the left (GPT-2's learned absolute positions would then shift; Qwen3's
    rotary ones are relative, so they cannot tell)."""
    tok = build_tokenizer()
    tok.padding_side = "left"
    if not chat_template:
        tok.chat_template = None
    torch.manual_seed(seed)
    if gpt2:
        model = GPT2ForSequenceClassification(GPT2Config(
            vocab_size=len(tok), n_positions=256, n_embd=32, n_layer=1, n_head=2,
            num_labels=num_labels, pad_token_id=None))
    else:
        config = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             intermediate_size=64, num_labels=num_labels, pad_token_id=None,
                             eos_token_id=tok.eos_token_id)
        model = Qwen3ForCausalLM(config) if causal else Qwen3ForSequenceClassification(config)
    if not causal:  # scores of order 1, so that texts differ by more than rounding
        torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("rm") / "rm")


@pytest.fixture(scope="module")
def plain_rm_dir(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("rm") / "plain", chat_template=False)


def rows_for(completions):
    return [{"prompt": PROMPTS[i % len(PROMPTS)], "answer": "19"} for i in range(len(completions))]


def by_hand(path: Path, texts: list[str]) -> list[float]:
    """The classifier run on each text alone in float64: the score head applied to the last
    token's hidden state, no padding, no pooling code of transformers'."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).double().eval()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])  # (1, T)
            hidden = model.model(input_ids=ids).last_hidden_state[0, -1]  # (H,)
            out.append(float(hidden @ model.score.weight[0]))
    return out


@pytest.mark.parametrize("template", [True, False])
def test_scores_are_the_classifiers_logit_on_prompt_and_completion(rm_dir, plain_rm_dir,
                                                                   template):
    path = rm_dir if template else plain_rm_dir
    reward = RewardModel(str(path), batch_size=4, system_prompt="Add." if template else "")
    rows = rows_for(COMPLETIONS)
    rewards, failures, _ = score(reward, COMPLETIONS, rows)
    if template:  # the whole conversation in the Qwen chat format, as TRL renders it
        texts = [f"{IM_START}system\nAdd.{IM_END}\n{IM_START}user\n{r['prompt']}{IM_END}\n"
                 f"{IM_START}assistant\n{c}{IM_END}\n" for c, r in zip(COMPLETIONS, rows)]
    else:  # no chat template: prompt and completion joined, as TRL does for text prompts
        texts = [r["prompt"] + c for c, r in zip(COMPLETIONS, rows)]
    assert failures == 0
    assert rewards == pytest.approx(by_hand(path, texts), abs=1e-4)
    assert len(set(round(r, 3) for r in rewards)) == len(rewards)  # the texts are told apart


@pytest.fixture(scope="module")
def gpt2_rm_dir(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("rm") / "gpt2", gpt2=True)


@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])
def test_batches_of_any_size_give_the_scores_of_one_at_a_time(rm_dir, gpt2_rm_dir, arch):
    path = str(rm_dir if arch == "qwen3" else gpt2_rm_dir)
    rows = rows_for(COMPLETIONS)
    one_by_one = score(RewardModel(path, batch_size=1), COMPLETIONS, rows)[0]
    for size in (2, 4, len(COMPLETIONS)):  # batches mixing short and long texts: padding
        batched, failures, first = score(RewardModel(path, batch_size=size), COMPLETIONS, rows)
        assert failures == 0, first
        assert batched == pytest.approx(one_by_one, abs=1e-5), size


def test_a_sum_with_a_rule_reward_adds_the_weighted_parts(rm_dir):
    rows = rows_for(COMPLETIONS)
    model_only = score(RewardModel(str(rm_dir)), COMPLETIONS, rows)[0]
    exact = [float(c == "19") for c in COMPLETIONS]  # the arithmetic task's exact match
    for spec, weight in ((f"arithmetic+model:{rm_dir}", 1.0),
                         (f"arithmetic + 0.5*model:{rm_dir}", 0.5),
                         (f"arithmetic+-2*model:{rm_dir}", -2.0)):
        reward = build_reward(load_config(overrides=[f"data.reward={spec}"]).data)
        assert isinstance(reward, RewardSum) and reward.__name__ == spec
        rewards, failures, _ = score(reward, COMPLETIONS, rows)
        assert failures == 0
        assert rewards == pytest.approx([e + weight * m for e, m in zip(exact, model_only)],
                                        abs=1e-5)
        close_reward(reward)
    # from Python, a list holding a reward model is the same sum
    from gspo.tasks import user_reward
    from gspo.tasks.arithmetic import exact_match_reward
    reward = user_reward([exact_match_reward, RewardModel(str(rm_dir))], load_config().data)
    assert score(reward, COMPLETIONS, rows)[0] == pytest.approx(
        [e + m for e, m in zip(exact, model_only)], abs=1e-5)


def test_the_spec_reads_parts_and_weights():
    assert parse_reward_spec("math") == [(1.0, "math")]
    assert parse_reward_spec("math+0.25*model:/a/b+-1*f.py:g") == [
        (1.0, "math"), (0.25, "model:/a/b"), (-1.0, "f.py:g")]
    with pytest.raises(ConfigError, match="empty part"):
        parse_reward_spec("math+")


class _Batched:
    batch_size = 2

    def __init__(self, fail_on=None, answer=None):
        self.fail_on, self.answer, self.calls = fail_on, answer, []

    def batch(self, completions, rows):
        self.calls.append(list(completions))
        if self.fail_on in completions:
            raise RuntimeError("CUDA out of memory\nsecond line")
        return self.answer(completions) if self.answer else [float(len(c)) for c in completions]


def test_a_batch_that_raises_fails_each_of_its_completions_and_only_those():
    reward = _Batched(fail_on="boom")
    rewards, failures, first = score(reward, ["a", "bb", "boom", "c", "dd"], [{"prompt": "p"}] * 5)
    assert reward.calls == [["a", "bb"], ["boom", "c"], ["dd"]]  # batch_size at a time
    assert rewards == [1.0, 2.0, 0.0, 0.0, 2.0] and failures == 2
    assert first == ("RewardBatchError: _Batched raised on a batch of 2 completions: "
                     "RuntimeError: CUDA out of memory")


@pytest.mark.parametrize("answer, failures, says", [
    (lambda cs: [1.0], 2, "RewardBatchError: _Batched returned 1 rewards for a batch of 2"),
    (lambda cs: [1.0, float("nan")], 1, "ValueError: reward nan is not a finite number"),
])
def test_a_batch_that_answers_wrongly_is_counted(answer, failures, says):
    rewards, n, first = score(_Batched(answer=answer), ["a", "b"], [{"prompt": "p"}] * 2)
    assert n == failures and first.startswith(says), first


def test_a_batch_past_the_timeout_fails_its_completions():
    import time

    def slow(completions):
        time.sleep(30)

    rewards, failures, first = score(_Batched(answer=slow), ["a", "b", "c"],
                                     [{"prompt": "p"}] * 3, timeout=0.2)
    assert rewards == [0.0] * 3 and failures == 3 and first.startswith("TimeoutError")


def test_a_run_trains_with_a_reward_model_and_a_resume_refuses_another(tmp_path, rm_dir,
                                                                        tiny_overrides):
    run = tmp_path / "run"
    base = tiny_overrides + [f"data.reward=arithmetic+model:{rm_dir}", "data.reward_batch_size=5"]
    train(load_config(overrides=base), run)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row[M.REWARD_FAILURES] == 0 and math.isfinite(row[M.REWARD_MEAN])
        assert row[M.REWARD_STD] > 0  # the model's scores, not the exact match's zeros
    more = [o for o in base if not o.startswith("train.steps")] + ["train.steps=3"]
    other = save_checkpoint(tmp_path / "other", seed=1)
    with pytest.raises(TrainingError, match=r"cannot change the reward to "
                                            r"data.reward=arithmetic\+model:.*other"):
        train(load_config(overrides=more[:-2] + [f"data.reward=arithmetic+model:{other}",
                                                 "train.steps=3"]), run, resume=True)
    # the same path holding other weights: the checkpoint's fingerprint tells them apart
    moved = tmp_path / "moved"
    rm_dir.rename(moved)
    try:
        save_checkpoint(rm_dir, seed=2)
        with pytest.raises(TrainingError, match=f"the reward model {rm_dir} is not the one the "
                                                f"run was trained with"):
            train(load_config(overrides=more), run, resume=True)
    finally:
        import shutil
        shutil.rmtree(rm_dir)
        moved.rename(rm_dir)


def test_the_dry_run_checks_a_reward_model_without_reading_its_weights(rm_dir, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("the dry run read the reward model's weights")

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", no_weights)
    out = io.StringIO()
    figures = dry_run(load_config(overrides=[f"data.reward=model:{rm_dir}"]), out=out)
    assert figures["reward"] is None
    assert f"model:{rm_dir}: Qwen3ForSequenceClassification" in out.getvalue()
    assert "no weights read" in out.getvalue()
    out = io.StringIO()  # with a rule reward, the rule part is still called on the sample
    figures = dry_run(load_config(overrides=[f"data.reward=arithmetic+model:{rm_dir}"]), out=out)
    assert figures["reward"] == 1.0
    assert "exact_match_reward on the first training row with a worked solution: 1; model:" in (
        out.getvalue())


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    weightless = save_checkpoint(root / "weightless")
    (weightless / "model.safetensors").unlink()
    return {"causal": save_checkpoint(root / "causal", causal=True),
            "two_labels": save_checkpoint(root / "two", num_labels=2),
            "weightless": weightless}


@pytest.mark.parametrize("case, says", [
    ("missing", "data.reward model:{path}: '{path}' not found; give the directory"),
    ("causal", "it holds a Qwen3ForCausalLM, not a sequence classifier"),
    ("two_labels", "its classifier head has 2 labels (num_labels=2)"),
    ("weightless", "has no weights (model.safetensors"),
])
def test_a_checkpoint_that_is_no_reward_model_is_one_error_line_in_the_dry_run(
        case, says, bad_dirs, tmp_path, capsys):
    path = bad_dirs.get(case, tmp_path / "no" / "such")
    code = main(["train", "--dry-run", f"data.reward=math+model:{path}", "data.task=math",
                 f"data.path={Path(__file__).parents[1] / 'examples/data/math_mini.jsonl'}",
                 "data.n_eval=2", "warmup.steps=0", "rollout.prompts_per_step=8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("gspo: error: ")
    assert says.format(path=path) in err[-1], err[-1]
    assert "Traceback" not in "\n".join(err)


def test_a_bad_reward_device_is_refused_with_the_config(rm_dir):
    with pytest.raises(ConfigError, match="data.reward_device must be cpu, cuda, cuda:N or auto"):
        load_config(overrides=[f"data.reward=model:{rm_dir}", "data.reward_device=gpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_reward_model_on_a_missing_gpu_is_a_dry_run_warning_and_a_run_error(rm_dir):
    cfg = load_config(overrides=[f"data.reward=model:{rm_dir}", "data.reward_device=cuda"])
    out = io.StringIO()
    dry_run(cfg, out=out)
    assert ("warning: checked on this machine: data.reward_device=cuda (a CUDA device) not "
            "available here; needed at run time") in out.getvalue()
    with pytest.raises(ConfigError, match="data.reward_device=cuda but this torch .* sees no "
                                          "CUDA device; use data.reward_device=cpu"):
        score(build_reward(cfg.data), ["1"], [{"prompt": "1+0=", "answer": "1"}])
