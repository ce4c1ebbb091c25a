import json
import time
from pathlib import Path

import pytest

from gspo.data import score
from gspo.rewards.math import MathReward, MathVerifyTimeout, answer_window, reference_text

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


@pytest.fixture(scope="module")
def reward():
    r = MathReward(timeout=5.0)
    yield r
    r.close()


@pytest.mark.parametrize("completion, answer", [
    ("so the answer is \\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{2}{4}}", "0.5"),
    ("The answer is 42.", "42"),
    ("We get \\boxed{1,000} in total.", "Adding up ... #### 1,000"),  # a GSM8K reference
    ("Therefore $x = \\boxed{6}$", "Adding 7 gives $3x = 18$, so $x = \\boxed{6}$."),  # MATH
    ("\\boxed{(x+1)^2}", "x^2+2x+1"),
    ("\\boxed{\\sqrt{50}}", "5\\sqrt{2}"),
    ("the image is \\boxed{(-3, 4)}", "(-3,4)"),
    ("\\boxed{\\pi}", "\\pi"),
])
def test_equivalent_forms_score_one(reward, completion, answer):
    assert reward(completion, answer=answer) == 1.0


@pytest.mark.parametrize("completion, answer", [
    ("\\boxed{41}", "42"),
    ("\\boxed{x^2+2x}", "x^2+2x+1"),
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("the answer is 7", "#### 8"),
])
def test_wrong_answers_score_zero(reward, completion, answer):
    assert reward(completion, answer=answer) == 0.0


@pytest.mark.parametrize("garbage", ["", "   ", "}{\\boxed{", "\\boxed{}", "\x00\x01\x02",
                                     "$$$$", "\\frac{", None, 42])
def test_garbage_scores_zero_without_raising(reward, garbage):
    assert reward(garbage, answer="42") == 0.0


def test_a_1mb_completion_is_scored_quickly(reward):
    pad = "lorem ipsum " * (1_000_000 // 12)
    start = time.monotonic()
    assert reward(pad + "so \\boxed{42}", answer="42") == 1.0
    assert reward(pad, answer="42") == 0.0
    assert reward("\\boxed{42}" + pad, answer="42") == 1.0  # the last \boxed, not the tail
    assert time.monotonic() - start < 5.0


def test_a_pathological_completion_cannot_stall_past_the_timeout():
    slow = MathReward(timeout=30.0)
    assert slow.is_correct("\\boxed{1}", "1")  # start and warm up the helper, untimed
    slow.timeout = 0.3
    start = time.monotonic()
    with pytest.raises(MathVerifyTimeout, match="timeout=0.3 s"):
        slow("\\boxed{9^{9^{9^{9}}}}", answer="1")
    assert time.monotonic() - start < 2.0
    assert slow.timeouts == 1  # the helper was killed...
    slow.timeout = 5.0
    assert slow("\\boxed{7}", answer="7") == 1.0  # ...and a fresh one answers the next call
    slow.close()


def test_math_verifys_own_time_limit_is_counted_not_silent():
    # 9^9^9^9 parses at once, and math-verify's comparison gives up at its own 1 s limit
    # (timeout 3 s / 3), returning False as for a wrong answer: the helper reports it and lives
    slow = MathReward(timeout=3.0)
    assert slow.is_correct("\\boxed{1}", "1") and slow.timeouts == 0
    pid = slow._helper.proc.pid
    with pytest.raises(MathVerifyTimeout):
        slow("\\boxed{9^{9^{9^{9}}}}", answer="1")
    assert slow.timeouts == 1 and slow._helper.proc.pid == pid
    assert slow("\\boxed{2}", answer="3") == 0.0 and slow.timeouts == 1  # wrong is not late
    # gspo's scoring counts it as a failed call (reward/failures), scored 0; another accepted
    # answer that matches wins over a time-out
    rewards, failures, first = score(slow, ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{4}"],
                                     [{"answer": "1"}, {"answer": ["9^{9^{9^{9}}}", "4"]}])
    assert rewards == [0.0, 1.0] and failures == 1 and first.startswith("MathVerifyTimeout")
    assert not slow.is_correct("\\boxed{9^{9^{9^{9}}}}", "1")  # is_correct: a plain False
    slow.close()


def test_format_weight_rewards_a_boxed_answer(reward, monkeypatch):
    monkeypatch.setattr(reward, "format_weight", 0.1)
    assert reward("\\boxed{42}", answer="42") == pytest.approx(1.1)
    assert reward("the answer is 42", answer="42") == pytest.approx(1.0)
    assert reward("\\boxed{41}", answer="42") == pytest.approx(0.1)


def test_fixture_solutions_score_one(reward):
    for name, solution_key in (("math_mini.jsonl", "solution"), ("gsm8k_mini.jsonl", "answer")):
        rows = [json.loads(line) for line in (DATA / name).read_text().splitlines()]
        assert [reward(r[solution_key], answer=r["answer"]) for r in rows] == [1.0] * len(rows)


def test_answer_window_and_reference_text():
    long = "a" * 10_000 + "\\boxed{3} tail"
    assert answer_window(long, 100).startswith("\\boxed{3}")
    assert answer_window("b" * 10_000, 100) == "b" * 100
    assert reference_text("Step... #### 1,234") == "$1234$"
    assert reference_text("\\frac{1}{2}") == "$\\frac{1}{2}$"
    assert reference_text("so \\boxed{5}") == "so \\boxed{5}"
    assert reference_text(1e-05) == "$0.00001$" and reference_text("#### 2e3") == "$2000$"


@pytest.mark.parametrize("completion, answer", [
    ("\\boxed{0.00001}", 1e-05),          # a JSON number 0.00001 reads as the float 1e-05
    ("\\boxed{100000000000000000000}", 1e20),
    ("\\boxed{0.00015}", "1.5E-4"),
])
def test_a_float_reference_in_exponent_notation_is_its_number_not_eulers_e(reward, completion,
                                                                           answer):
    # str(1e-05) is '1e-05', which math-verify parsed as E - 5: every sample scored 0
    assert reward(completion, answer=str(answer)) == 1.0
    assert reward("\\boxed{e - 5}", answer=str(answer)) == 0.0


def test_a_list_of_answers_accepts_any_of_them():
    # a dataset listing several accepted forms used to be stringified: "['6', 'x']" never matched
    reward = MathReward()
    try:
        assert reward("so it is \\boxed{6}", answer=["6", "x"]) == 1.0
        assert reward("so it is \\boxed{x}", answer=["6", "x"]) == 1.0
        assert reward("so it is \\boxed{7}", answer=["6", "x"]) == 0.0
    finally:
        reward.close()
