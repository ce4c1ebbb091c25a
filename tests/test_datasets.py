import json
import logging
import subprocess
import sys
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


def test_reading_code_rows_does_not_import_the_sandbox():
    # the tests are parsed by gspo.rewards.code_tests; the sandbox is for the reward alone
    code = ("import sys\nfrom gspo.config import DataConfig\n"
            "from gspo.tasks.datasets import load_rows\n"
            f"rows = load_rows({str(DATA / 'code_mini.jsonl')!r}, DataConfig(task='code'))\n"
            "print(len(rows) > 0, 'gspo.sandbox' in sys.modules,\n"
            "      'gspo.rewards.code' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False", "False"], out.stderr[-2000:]


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
    # a missing field is said once (it used to read "field 'cases' (tests): field 'cases' ...")
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "p"}])
    with pytest.raises(DatasetError, match="row 1: field 'cases' \\(tests\\) is missing; the row "
                                           "has prompt \\(set data.tests_field\\)"):
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
    (["data.task=code", "data.path=/no/such.jsonl"], "data.path '/no/such.jsonl' not found"),
    (["data.task=math", "data.path=my data.jsonl"], "neither an existing file or directory nor "
                                                    "a hub dataset id like openai/gsm8k"),
    (["data.path=examples/data/math_mini.jsonl"], "data.task is 'arithmetic'"),
    (["data.task=poetry"], "data.task must be one of arithmetic | math | code, got 'poetry'"),
    (["data.format_weight=1.0"], "data.format_weight must be in [0, 1)"),
    (["data.on_bad_row=ignore"], "data.on_bad_row must be one of fail | skip, got 'ignore'"),
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


def test_a_reward_module_that_exits_at_import_is_an_import_error(tmp_path):
    (tmp_path / "script.py").write_text("import sys\nsys.exit('bye')\n")
    with pytest.raises(ConfigError) as e:  # not SystemExit, which ended gspo without a word
        load_reward(f"{tmp_path}/script.py:f")
    assert str(e.value) == (f"data.reward '{tmp_path}/script.py:f': cannot import "
                            f"'{tmp_path}/script.py' (SystemExit: bye); a reward module must not "
                            f"exit when imported (put a script's code under if __name__ == "
                            f"'__main__':)")


def test_a_reward_module_not_on_the_path_says_to_name_its_file(tmp_path, monkeypatch):
    (tmp_path / "gspo_cwd_reward.py").write_text("def f(completion, **_):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)  # as `gspo train` runs: the working directory is not on the path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(ConfigError, match=r"No module named 'gspo_cwd_reward'\); "
                                          r"gspo_cwd_reward.py is in the current directory, which "
                                          r"is not on the import path: write "
                                          r"data.reward=gspo_cwd_reward.py:f, or set PYTHONPATH=."):
        load_reward("gspo_cwd_reward:f")
    assert load_reward("gspo_cwd_reward.py:f")("x") == 1.0  # the fix it names works
    with pytest.raises(ConfigError, match=r"No module named 'gspo_elsewhere'\); name the file "
                                          r"instead, data.reward=path/to/file.py:g, or add its "
                                          r"directory to PYTHONPATH"):
        load_reward("gspo_elsewhere.rewards:g")


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


@pytest.mark.parametrize("lines, message, kept", [
    ("a,1,\nb,2,\n", "row 1: 1 more value than the header's columns (prompt, answer): remove "
                     "the trailing comma", ["c"]),
    ("a,1\nb,2,x,y\n", "row 2: 2 more values than the header's columns (prompt, answer): quote "
                       "a value that holds a comma", ["a", "c"]),
])
def test_a_csv_row_with_more_values_than_the_header_is_a_bad_row(tmp_path, lines, message, kept):
    # DictReader files the extra values under the key None, which later broke the run record
    path = tmp_path / "m.csv"
    path.write_text("prompt,answer\n" + lines + "c,3\n")
    with pytest.raises(DatasetError) as e:
        load_rows(path, data(task="math"))
    assert f"{path} {message}" in str(e.value)
    assert [r["prompt"] for r in load_rows(path, data(task="math", on_bad_row="skip"))] == kept


@pytest.mark.parametrize("name, content", [
    ("m.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n'),
    ("m.json", '[{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]'),
    ("m.csv", "prompt,answer\na,1\nb,2\n"),
])
def test_a_utf8_byte_order_mark_is_read_past(tmp_path, name, content):
    # Windows editors and Excel's "CSV UTF-8" begin the file with one; row 1 was refused
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + content.encode())
    rows = load_rows(path, data(task="math"))
    assert [(r["prompt"], r["answer"]) for r in rows] == [("a", "1"), ("b", "2")]


@pytest.mark.parametrize("name, content, message", [
    ("t.json", b'[{"prompt": "a", "answer": "1"}, {"prompt": ', r"t.json: not valid JSON"),
    ("u.json", b'[{"prompt": "\xff"}]', r"u.json: not UTF-8 text \(byte 0xff at offset 13\)"),
    # read as JSONL, a pretty-printed object gave one 'not valid JSON' per line
    ("o.json", b'{\n  "prompt": "a",\n  "answer": "1"\n}\n',
     r"o.json: one JSON object spread over several lines; a .json data file holds an array"),
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


# ---------------------------------------------------------------------------------------------
# hub datasets, dataset repositories on disk, rows and rewards from Python


def _gsm8k_repo(path: Path) -> Path:
    """A directory laid out as the hub's openai/gsm8k: two subsets, each with two splits."""
    raw = [json.loads(line) for line in (DATA / "gsm8k_mini.jsonl").read_text().splitlines()]
    readme = ["---", "configs:"]
    for subset, rows in (("main", raw), ("socratic", raw[:2])):
        readme.append(f"- config_name: {subset}\n  data_files:")
        for split, part in (("train", rows[:-1]), ("test", rows[-1:])):
            (path / subset).mkdir(parents=True, exist_ok=True)
            write_jsonl(path / subset / f"{split}.jsonl", part)
            readme.append(f"  - split: {split}\n    path: {subset}/{split}.jsonl")
    (path / "README.md").write_text("\n".join(readme + ["---", ""]))
    return path


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def test_a_dataset_repository_on_disk_is_read_by_subset_and_split(tmp_path, datasets_cache):
    repo = _gsm8k_repo(tmp_path / "gsm8k")
    d = data(task="math", prompt_field="question", subset="main")
    file_rows = load_rows(DATA / "gsm8k_mini.jsonl", data(task="math", prompt_field="question"))
    assert load_rows(repo, d) == file_rows[:-1]
    assert load_rows(repo, d, split="test") == file_rows[-1:]
    assert len(load_rows(repo, data(task="math", prompt_field="question", subset="socratic"))) == 1
    with pytest.raises(DatasetError, match="'nope' not found. Available: \\['main', 'socratic'\\]"):
        load_rows(repo, data(task="math", prompt_field="question", subset="nope"))
    with pytest.raises(DatasetError, match="Unknown split \"validation\""):
        load_rows(repo, d, split="validation")


def test_eval_split_reads_the_held_out_split_of_the_same_dataset(tmp_path, datasets_cache):
    repo = str(_gsm8k_repo(tmp_path / "gsm8k"))
    train, held_out, _, _ = build_task(data(task="math", prompt_field="question", subset="main",
                                            path=repo, eval_path=repo, eval_split="test"))
    assert (len(train), len(held_out)) == (7, 1)
    last = json.loads((DATA / "gsm8k_mini.jsonl").read_text().splitlines()[-1])
    assert held_out[0]["answer"] == last["answer"]  # the test split: the file's last row


def test_a_subset_of_a_plain_file_is_an_error_saying_to_drop_it():
    with pytest.raises(DatasetError, match="data.subset='main' names a configuration of a hub "
                                           "dataset, but .* is a file .*; drop data.subset"):
        load_rows(DATA / "gsm8k_mini.jsonl", data(task="math", prompt_field="question",
                                                 subset="main"))


def test_a_hub_id_offline_fails_at_once_naming_the_way_out(monkeypatch):
    import time

    from huggingface_hub import constants
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # refused at once
    t0 = time.monotonic()
    with pytest.raises(DatasetError, match="'no-such-org/no-such-set' is not a local file or "
                                           "directory, and as a hub dataset id it cannot be "
                                           "fetched: the hub at http://127.0.0.1:9 cannot be "
                                           "reached"):
        load_rows("no-such-org/no-such-set", data(task="math"))
    assert time.monotonic() - t0 < 10  # no retries with back-off


def test_a_hub_id_in_offline_mode_looks_in_the_cache_and_says_so(tmp_path):
    code = ("from gspo.config import DataConfig\nfrom gspo.tasks.datasets import load_rows\n"
            "load_rows('no-such-org/no-such-set', DataConfig(task='math'))\n")
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                           "HF_DATASETS_CACHE": str(tmp_path)})
    assert out.returncode != 0
    assert "DatasetError: dataset 'no-such-org/no-such-set'" in out.stderr
    assert "(HF_HUB_OFFLINE is set)" in out.stderr


def test_a_string_that_is_neither_a_path_nor_a_hub_id_names_both():
    with pytest.raises(DatasetError, match="'my data.jsonl' not found \\(nor is it a hub dataset "
                                           "id like openai/gsm8k\\)"):
        load_rows("my data.jsonl", data(task="math"))


def test_python_rows_are_mapped_and_checked_as_file_rows():
    raw = [json.loads(line) for line in (DATA / "gsm8k_mini.jsonl").read_text().splitlines()]
    d = data(task="math", prompt_field="question", n_eval=2)
    import datasets
    from_file = build_task(data(task="math", prompt_field="question", n_eval=2,
                                path=str(DATA / "gsm8k_mini.jsonl")))[:2]
    assert build_task(d, train_data=raw)[:2] == from_file
    assert build_task(d, train_data=datasets.Dataset.from_list(raw))[:2] == from_file
    with pytest.raises(DatasetError, match="train_data row 2: field 'answer' \\(answer\\) is "
                                           "missing"):
        build_task(d, train_data=[raw[0], {"question": "q"}, raw[2]])
    train, held_out, _, _ = build_task(data(task="math", prompt_field="question"),
                                       train_data=raw[:5], eval_data=raw[5:])
    assert (len(train), len(held_out)) == (5, 3)


@pytest.mark.parametrize("given, message", [
    (dict(train_data="train.jsonl"), "train_data must be a list of dicts or a datasets.Dataset, "
                                     "got str 'train.jsonl' \\(for a file or hub id set data.path"),
    (dict(train_data={"train": []}), "got a DatasetDict \\(pass one split"),
    (dict(train_data=3), "got int"),
    (dict(train_data=[{"question": "q", "answer": "1"}], path=str(DATA / "gsm8k_mini.jsonl")),
     "both train_data and data.path are given; pass one"),
    (dict(), "set data.path=FILE .* or from Python pass train\\(..., train_data=rows\\)"),
    (dict(task="arithmetic", train_data=[{"prompt": "1+1"}]), "read with data.task=math or code"),
    (dict(reward_fn=3, path=str(DATA / "gsm8k_mini.jsonl")), "reward_fn must be a callable"),
    (dict(reward_fn=len, reward="math", path=str(DATA / "gsm8k_mini.jsonl")),
     "a reward_fn is given and data.reward='math' too; pass one"),
])
def test_python_objects_that_cannot_be_used_are_one_clear_error(given, message):
    given = {"task": "math", **given}
    objects = {k: given.pop(k) for k in ("train_data", "reward_fn") if k in given}
    d = data(prompt_field="question", n_eval=1, **given)
    with pytest.raises(ConfigError, match=message):
        build_task(d, **objects)


def test_a_python_reward_replaces_the_tasks_and_a_list_of_them_is_summed():
    d = data(task="math", prompt_field="question", n_eval=1, path=str(DATA / "gsm8k_mini.jsonl"))

    def short(completion, **_):
        return float(len(completion) < 5)

    def has_answer(completion, answer, **_):
        return float(answer.split("####")[-1].strip() in completion)

    _, _, reward, _ = build_task(d, reward_fn=short)
    assert reward is short
    _, _, reward, _ = build_task(d, reward_fn=[short, has_answer])
    assert reward("27", answer="... #### 27") == 2.0 and reward("a long 3", answer="#### 27") == 0.0
