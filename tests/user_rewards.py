"""Reward functions the tests pass as data.reward=tests/user_rewards.py:NAME."""

import os


def needs_a_missing_package(completion: str, **_) -> float:
    import gspo_no_such_package  # noqa: F401  (what a reward with an uninstalled dependency does)
    return 1.0


def constant(completion: str, **_) -> float:
    return 0.5


def fails_after_step_1(completion: str, **_) -> float:
    """Scores normally for the first 16 calls (one tiny step), then always raises."""
    n = int(os.environ.get("GSPO_TEST_CALLS", "0")) + 1
    os.environ["GSPO_TEST_CALLS"] = str(n)
    if n > 16:
        raise RuntimeError("the scoring service went away")
    return float(len(completion) % 2)


def exits(completion: str, **_) -> float:
    raise SystemExit(3)  # a reward that calls sys.exit: a failure, not the end of the run


def absurd(completion: str, **_) -> float:
    return 1e30


def sleeps(completion: str, **_) -> float:
    import time
    time.sleep(60)
    return 1.0


def text(completion: str, **_) -> str:
    return "1"  # a number as text: a bug (a parsed label never converted), not a reward


def even_answers_constant(completion: str, answer: str = "", **_) -> float:
    """1 for every response to a prompt whose answer is even (its group constant, rewards all
    equal), else a score that varies with the response (rollout.filter_groups' tests)."""
    return 1.0 if int(answer) % 2 == 0 else float(sum(map(ord, completion)) % 5)


def even_answers_constant_logged(completion: str, answer: str = "", **_) -> float:
    """even_answers_constant, each value appended to $GSPO_TEST_REWARD_LOG.<rank>."""
    value = even_answers_constant(completion, answer)
    with open(f"{os.environ['GSPO_TEST_REWARD_LOG']}.{os.environ.get('RANK', '0')}", "a") as f:
        f.write(f"{value}\n")
    return value
