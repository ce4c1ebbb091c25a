import json
import logging
from pathlib import Path

import pytest

from gspo.config import ConfigError, DataConfig, load_config
from gspo.data import encode_prompts, score
from gspo.rewards import load_reward
from gspo.tasks import build_task
from gspo.tasks.datasets import DatasetError, load_rows

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


def data(**kw) -> DataConfig:
    return DataConfig(**kw)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------
# formats


def test_jsonl_parquet_and_a_datasets_directory_give_the_same_math_rows(tmp_path):
    import datasets

    d = data(task="math", solution_field="solution")
    rows = load_rows(DATA / "math_mini.jsonl", d)
    assert len(rows) == 12 and set(rows[0]) == {"prompt", "answer", "solution"}
    assert load_rows(DATA / "math_mini.parquet", d) == rows
    raw = [json.loads(line) for line in (DATA / "math_mini.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(raw).save_to_disk(str(tmp_path / "ds"))
    assert load_rows(tmp_path / "ds", d) == rows
    datasets.DatasetDict({"test": datasets.Dataset.from_list(raw)}).save_to_disk(
        str(tmp_path / "dd"))
    assert load_rows(tmp_path / "dd", data(task="math", solution_field="solution",
                                           split="test")) == rows
    with pytest.raises(DatasetError, match="no split 'train' \\(has test\\)"):
        load_rows(tmp_path / "dd", d)


def test_csv_tests_as_json_text_equal_the_jsonl_ones():
    d = data(task="code", solution_field="solution")
    rows = load_rows(DATA / "code_mini.jsonl", d)
    assert load_rows(DATA / "code_mini.csv", d) == rows
    kinds = {t["kind"] for r in rows for t in r["tests"]}
    assert kinds == {"stdin", "call"}
    two_sum = next(r for r in rows if "twoSum" in r["prompt"])
    assert two_sum["tests"][0] == {"kind": "call", "fn_name": "twoSum",
                                   "args": [[2, 7, 11, 15], 9], "expected": [0, 1]}


def test_gsm8k_field_mapping_template_and_chat_template(tok):
    d = data(task="math", prompt_field="question", solution_field="answer",
             prompt_template="{prompt} Put the answer in \\boxed{}.")
    rows = load_rows(DATA / "gsm8k_mini.jsonl", d)
    assert rows[0]["answer"].endswith("#### 27")
    assert rows[0]["prompt"].startswith("Mia has") and rows[0]["prompt"].endswith("\\boxed{}.")
    (ids,) = encode_prompts(tok, rows[:1], system_prompt="Be brief.")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nMia")
    assert text.endswith("<|im_start|>assistant\n")


def test_other_fields_reach_the_reward_but_completion_does_not(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "answer": "1", "level": 3,
                                               "completion": "clash"}])
    (row,) = load_rows(path, data(task="math"))
    assert row == {"prompt": "p", "answer": "1", "level": 3}


def test_max_rows_caps_each_file():
    assert len(load_rows(DATA / "math_mini.jsonl", data(task="math", max_rows=5))) == 5


# ---------------------------------------------------------------------------------------------
# malformed rows


@pytest.mark.parametrize("bad_line, message", [
    ('{"prompt": "p"}', "row 2: field 'answer' (answer) is missing; the row has prompt"),
    ('{"prompt": "p", "answer": "  "}', "row 2: field 'answer' (answer) is empty"),
    ('{"prompt": 3, "answer": "1"}', "row 2: field 'prompt' (prompt) must be text"),
    ('{"prompt": "p", "answer": ', "row 2: not valid JSON"),
    ('[1, 2]', "row 2: a row must be a mapping"),
])
def test_a_malformed_row_names_file_row_and_field(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "m.jsonl", ['{"prompt": "ok", "answer": "1"}', bad_line])
    with pytest.raises(DatasetError) as e:
        load_rows(path, data(task="math"))
    assert str(path) in str(e.value) and message in str(e.value)


def test_malformed_tests_name_the_tests_field(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "p", "cases": "[not json"}])
    with pytest.raises(DatasetError, match="row 1: field 'cases' \\(tests\\): tests are a "
                                           "string but not JSON"):
        load_rows(path, data(task="code", tests_field="cases"))


def test_skip_mode_counts_logs_and_leaves_bad_rows_out(tmp_path, caplog):
    path = write_jsonl(tmp_path / "m.jsonl", ['{"prompt": "a", "answer": "1"}', '{"prompt": "b"}',
                                              'oops', '{"prompt": "c", "answer": "3"}'])
    with caplog.at_level(logging.WARNING):
        rows = load_rows(path, data(task="math", on_bad_row="skip"))
    assert [r["prompt"] for r in rows] == ["a", "c"]
    assert "skipped 2 malformed row(s)" in caplog.text and "row 2" in caplog.text


def test_a_file_without_usable_rows_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", ['{"q": 1}'])
    with pytest.raises(DatasetError, match="no usable rows \\(1 malformed"):
        load_rows(path, data(task="math", on_bad_row="skip"))


def test_missing_files_and_unknown_formats(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_rows(tmp_path / "nope.jsonl", data(task="math"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DatasetError, match="unknown data format '.txt'"):
        load_rows(tmp_path / "x.txt", data(task="math"))


# ---------------------------------------------------------------------------------------------
# build_task, config checks, custom rewards


def test_held_out_split_is_seeded_and_disjoint():
    d = data(task="math", path=str(DATA / "math_mini.jsonl"), n_eval=4)
    train, held_out, _, _ = build_task(d)
    assert len(train) == 8 and len(held_out) == 4
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert build_task(d)[:2] == (train, held_out)
    with pytest.raises(DatasetError, match="data.n_eval=12 would hold out every one"):
        build_task(data(task="math", path=str(DATA / "math_mini.jsonl"), n_eval=12))
    train, held_out, _, _ = build_task(data(task="math", path=str(DATA / "math_mini.jsonl"),
                                            eval_path=str(DATA / "math_mini.parquet")))
    assert len(train) == 12 and len(held_out) == 12  # eval_path: nothing held out of path


def test_warm_up_without_solutions_says_to_set_warmup_steps_0():
    d = data(task="math", path=str(DATA / "math_mini.jsonl"), n_eval=2)
    train, _, _, solution = build_task(d)
    with pytest.raises(ConfigError, match="warmup.steps=0"):
        solution(train[0])
    d.solution_field = "solution"
    train, _, _, solution = build_task(d)
    assert solution(train[0]) == train[0]["solution"]


@pytest.mark.parametrize("overrides, message", [
    (["data.task=math"], "set data.path=FILE"),
    (["data.task=code", "data.path=/no/such.jsonl"], "data.path '/no/such.jsonl' not found"),
    (["data.path=examples/data/math_mini.jsonl"], "data.task is 'arithmetic'"),
    (["data.task=poetry"], "available: arithmetic, math, code"),
    (["data.format_weight=1.0"], "data.format_weight must be in [0, 1)"),
    (["data.on_bad_row=ignore"], "choose fail or skip"),
    (["data.reward=my_reward"], "'module:function'"),
    (["data.prompt_template=no placeholder"], "must contain {prompt}"),
])
def test_config_checks_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert message in str(e.value)


def test_a_custom_reward_from_a_file_is_used_and_a_raising_one_counts_zero(tmp_path, caplog):
    (tmp_path / "my_reward.py").write_text(
        "def length(completion, answer, **_):\n    return float(len(completion) == int(answer))\n"
        "def broken(completion, **_):\n    raise RuntimeError('boom')\n")
    d = data(task="math", path=str(DATA / "math_mini.jsonl"), n_eval=2,
             reward=f"{tmp_path}/my_reward.py:length")
    _, _, reward, _ = build_task(d)
    assert reward("abc", answer="3") == 1.0
    broken = load_reward(f"{tmp_path}/my_reward.py:broken")
    with caplog.at_level(logging.WARNING):
        rewards, failures, first = score(broken, ["x", "y"], [{"prompt": "p"}] * 2)
    assert rewards == [0.0, 0.0] and failures == 2 and "boom" in caplog.text
    assert first == "RuntimeError: boom"


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "must look like 'module:function'"),
    ("gspo_no_such_module:f", "cannot import 'gspo_no_such_module'"),
    ("gspo.tasks.arithmetic:nope", "has no attribute 'nope'"),
    ("gspo.rewards.math:_STARTUP_S", "not a callable"),
    ("/no/such/file.py:f", "not found"),
])
def test_load_reward_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_reward(spec)


def test_load_reward_finds_module_functions():
    from gspo.tasks.arithmetic import exact_match_reward

    assert load_reward("gspo.tasks.arithmetic:exact_match_reward") is exact_match_reward


# ---------------------------------------------------------------------------------------------
# files that do not decode


def test_a_non_utf8_jsonl_line_is_a_bad_row_fail_or_skip(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "b\xff", "answer": "2"}\n'
                     b'{"prompt": "c", "answer": "3"}\n')
    with pytest.raises(DatasetError, match=r"m.jsonl row 2: not UTF-8 text: byte 0xff at column 14"):
        load_rows(path, data(task="math"))
    with caplog.at_level(logging.WARNING):
        rows = load_rows(path, data(task="math", on_bad_row="skip"))
    assert [r["prompt"] for r in rows] == ["a", "c"]


def test_a_non_utf8_csv_row_is_a_bad_row(tmp_path):
    path = tmp_path / "m.csv"
    path.write_bytes(b"prompt,answer\na,1\nb\xfe,2\nc,3\n")
    with pytest.raises(DatasetError, match=r"m.csv row 2: not UTF-8 text"):
        load_rows(path, data(task="math"))
    assert [r["prompt"] for r in load_rows(path, data(task="math", on_bad_row="skip"))] == ["a", "c"]


@pytest.mark.parametrize("name, content, message", [
    ("t.json", b'[{"prompt": "a", "answer": "1"}, {"prompt": ', r"t.json: not valid JSON"),
    ("u.json", b'[{"prompt": "\xff"}]', r"u.json: not UTF-8 text \(byte 0xff at offset 13\)"),
    ("c.parquet", b"PAR1 this is not parquet", r"c.parquet: not a readable Parquet file"),
])
def test_an_unreadable_file_is_one_error_naming_it(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DatasetError, match=message):
        load_rows(path, data(task="math"))


def test_a_list_of_answers_stays_a_list(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "p", "answer": [6, " x "]}])
    assert load_rows(path, data(task="math"))[0]["answer"] == ["6", "x"]
