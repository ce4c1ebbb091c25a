import random
import subprocess
import sys
from pathlib import Path

import pytest

import gspo
from gspo.config import ConfigError, DataConfig
from gspo.tasks import build_reward, build_task
from gspo.tasks.arithmetic import exact_match_reward, extract_answer, make_splits
from gspo.tasks.datasets import map_rows, python_rows

ROOT = Path(__file__).resolve().parents[1]


def test_splits_are_seeded_disjoint_and_correct():
    train, held_out = make_splits(500, 50, digits=2, operations="+-", seed=3)
    assert (train, held_out) == make_splits(500, 50, digits=2, operations="+-", seed=3)
    assert len(train) == 500 and len(held_out) == 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for row in train + held_out:
        expr = row["prompt"].rstrip("=")
        assert int(row["answer"]) == eval(expr)  # an independent evaluator of the expression


def test_exact_match_reward():
    assert exact_match_reward("132", answer="132") == 1.0
    assert exact_match_reward("  132\n", answer="132") == 1.0
    assert exact_match_reward("-7", answer="-7") == 1.0
    assert exact_match_reward("131", answer="132") == 0.0
    assert exact_match_reward("13 2", answer="132") == 0.0


def test_malformed_answers_score_zero_without_raising():
    for bad in ["", "abc", "132abc", "1+1", "=", None, "\x00", "9" * 10_000 + "x"]:
        assert exact_match_reward(bad, answer="132") == 0.0
    assert extract_answer("x") is None


def test_a_math_answer_list_without_an_answer_is_a_malformed_row():
    # an empty list scored every sample 0 in a run, and the dry run's sample answer raised
    rows = [{"prompt": "a", "answer": []}, {"prompt": "b", "answer": ["1", " "]},
            {"prompt": "c", "answer": ["2", "two"]}]
    bad: list[str] = []
    kept = map_rows(python_rows(rows, "rows"), "rows", DataConfig(task="math"), "math", bad)
    assert [r["answer"] for r in kept] == [["2", "two"]]
    assert bad == ["rows row 1: field 'answer' (answer): an empty list; give the answer, or a "
                   "list of its accepted forms",
                   "rows row 2: field 'answer' (answer): answer 2 of the list is empty; give "
                   "each accepted form, or drop the empty one"]


# ---------------------------------------------------------------------------------------------
# the registry: a task added from outside, through the public API only


def reverse_rows(d) -> tuple[list[dict], list[dict]]:
    """Seeded, disjoint (train, held-out) 'reverse a word' problems over the tiny vocabulary."""
    rng = random.Random(d.seed)
    words: list[str] = []
    while len(words) < d.n_train + d.n_eval:
        word = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 5)))
        if word not in words:
            words.append(word)
    rows = [{"prompt": f"reverse {w}:", "answer": w[::-1]} for w in words]
    return rows[d.n_eval:], rows[:d.n_eval]


def reversed_exactly(completion: str, answer: str, **_) -> float:
    return float(completion.strip() == answer)


@pytest.fixture
def reverse_task():
    spec = gspo.register_task(gspo.TaskSpec(
        "reverse", "generated words, the answer the word reversed",
        make_reward=lambda d: reversed_exactly, make_rows=reverse_rows,
        solution=lambda row: row["answer"]))
    yield spec
    del gspo.TASKS["reverse"]


@pytest.fixture
def upper_task():
    """A task read from data.path, its field under its own name (no data.target_field)."""
    def parse(value, raw, d):
        if not isinstance(value, str):
            raise ValueError("must be text")
        return value.upper()

    def matches(completion, target, **_):
        return float(completion == target)

    gspo.register_task(gspo.TaskSpec("upper", "the target in capitals",
                                     make_reward=lambda d: matches, field="target", parse=parse))
    yield
    del gspo.TASKS["upper"]


def test_a_registered_task_is_built_and_scored(reverse_task):
    cfg = gspo.load_config(overrides=["data.task=reverse", "data.n_train=20", "data.n_eval=4"])
    train_rows, held_out, reward, solution = build_task(cfg.data)
    assert (len(train_rows), len(held_out)) == (20, 4)
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in held_out}
    answers = [solution(row) for row in held_out] + ["not it"]
    rewards, failures, _ = gspo.score(reward, answers, held_out + held_out[:1])
    assert rewards == [1.0] * 4 + [0.0] and failures == 0


def test_a_registered_task_trains_warms_up_and_evaluates(reverse_task, tmp_path, tiny_overrides):
    cfg = gspo.load_config(overrides=tiny_overrides + ["data.task=reverse", "train.steps=1",
                                                       "train.save_every=0"])
    summary = gspo.train(cfg, tmp_path / "run")  # 3 warm-up steps on its solutions, 1 RL step
    rows = gspo.read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1] and summary.steps == 1
    assert 0.0 <= rows[-1]["reward/mean"] <= 1.0 and "eval/accuracy" in rows[-1]


def test_the_config_knows_registered_tasks_and_still_refuses_unknown_ones(reverse_task):
    with pytest.raises(ConfigError, match="data.task must be one of arithmetic \\| math \\| "
                                          "code \\| reverse, got 'poetry'"):
        gspo.load_config(overrides=["data.task=poetry"])
    with pytest.raises(ConfigError, match="data.task must be one of arithmetic \\| math \\| "
                                          "code \\| reverse, got 'poetry'"):
        build_task(DataConfig(task="poetry"))  # a DataConfig built in Python, never checked
    with pytest.raises(ConfigError, match="data.task is 'reverse'; set data.task=math or "
                                          "data.task=code to train on a file"):
        gspo.load_config(overrides=["data.task=reverse", "data.path=x.jsonl"])
    d = gspo.load_config(overrides=["data.reward=reverse"]).data  # its reward on another task
    assert build_reward(d) is reversed_exactly


def test_a_registered_task_read_from_rows_parses_its_own_field(upper_task):
    d = DataConfig(task="upper", n_eval=1)
    train_rows, held_out, reward, _ = build_task(d, train_data=[
        {"prompt": "p1", "target": "ab", "note": 1}, {"prompt": "p2", "target": "cd"}])
    rows = sorted(train_rows + held_out, key=lambda row: row["prompt"])
    assert rows == [{"note": 1, "prompt": "p1", "target": "AB"}, {"prompt": "p2", "target": "CD"}]
    assert gspo.score(reward, ["AB", "cd"], rows)[0] == [1.0, 0.0]
    # no data.target_field exists, so the error does not say to set one
    with pytest.raises(ConfigError, match="train_data row 2: field 'target' \\(target\\) is "
                                          "missing; the row has prompt \\(data.on_bad_row"):
        build_task(d, train_data=[{"prompt": "p1", "target": "ab"}, {"prompt": "p2"}])
    with pytest.raises(ConfigError, match="row 1: field 'target' \\(target\\): must be text"):
        build_task(d, train_data=[{"prompt": "p1", "target": 3}, {"prompt": "p2", "target": "x"}])


def test_register_task_refuses_a_taken_name_or_one_with_a_colon(reverse_task):
    def spec(name):
        return gspo.TaskSpec(name, "", make_reward=lambda d: reversed_exactly)

    with pytest.raises(ValueError, match="task 'reverse' is already registered"):
        gspo.register_task(spec("reverse"))
    with pytest.raises(ValueError, match="without ':'"):
        gspo.register_task(spec("my:task"))
    assert list(gspo.TASKS) == ["arithmetic", "math", "code", "reverse"]


def test_validating_the_config_reads_the_registry_without_torch():
    code = ("import sys\nfrom gspo.config import DataConfig, _check_data\n"
            "_check_data(DataConfig(task='code', path='examples/data/code_mini.jsonl'))\n"
            "print(*(m in sys.modules for m in ('gspo.tasks', 'torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.stdout.split() == ["True", "False", "False"], out.stderr[-2000:]
