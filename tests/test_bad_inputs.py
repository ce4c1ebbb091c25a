"""The bad-input catalogue: every config, data, reward, model, run-directory and CLI mistake a
user makes, through `gspo.cli.main` as the shell runs it. Each must end with one
`gspo: error:` line on stderr, a non-zero exit, no traceback (main returns instead of raising),
and, where it touches a finished run, no checkpoint or metrics row of that run lost or changed.

Finer checks of each case (the exact fallbacks, the sizes, the timing) live beside the code
they test; this file keeps the list in one place, so a new case is one line.
"""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from gspo.cli import main
from gspo.runlock import exclusive
from gspo.trainer import train
from gspo.config import load_config
from gspo.logger import read_metrics

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"
USER = Path(__file__).with_name("user_rewards.py")
QUICK = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64", "data.n_train=64", "data.n_eval=4",
         "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
         "warmup.steps=0", "train.steps=1", "train.eval_every=0", "train.progress=false",
         "train.tensorboard=false"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step run with a checkpoint per step, to be copied by each case."""
    run = tmp_path_factory.mktemp("finished") / "run"
    cfg = load_config(overrides=[o for o in QUICK if not o.startswith("train.steps")]
                      + ["train.steps=2", "train.save_every=1", "train.eval_every=1",
                         "train.eval_k=1"])
    train(cfg, run)
    return run


def snapshot(run: Path) -> dict[str, str]:
    """Every file of the run that a mistake must not touch: config, metrics, checkpoints."""
    files = [p for p in sorted(run.rglob("*")) if p.is_file() and "tensorboard" not in p.parts
             and p.name != ".lock"]
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def fails_cleanly(capsys, *argv: str, says: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code != 0, f"exit 0 for {argv}"
    assert "Traceback" not in err
    last = err.splitlines()[-1] if err else ""
    assert last.startswith("gspo: error:"), err[-2000:]
    assert says in last, f"{says!r} not in {last!r}"
    return last


def write_dir(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    for name, content in files.items():
        write(path / name, content)
    return path


def write(path: Path, content: bytes | str) -> Path:
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


# ---- config: one line, before anything is built

@pytest.mark.parametrize("override, says", [
    ("train.stesp=3", "unknown config key 'train.stesp'"),
    ("train.steps=abc", "train.steps"),
    ("rollout.group_size=1", "rollout.group_size"),
    ("optim.betas=[0.9,2]", "optim.betas"),
    ("algorithm=ppo", "ppo"),
    ("rollout.engine=sglang", "rollout.engine"),
    ("data.on_bad_row=ignore", "data.on_bad_row must be one of fail | skip"),
    ("data.reward=my_reward", "'module:function'"),
    ("train.device=tpu", "not a device"),
])
def test_a_bad_override(tmp_path, capsys, override, says):
    fails_cleanly(capsys, "train", "--output-dir", str(tmp_path / "r"), *QUICK, override,
                  says=says)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_the_error_line_is_one_write_so_that_ranks_cannot_run_their_lines_together(
        monkeypatch):
    writes = []  # under torchrun every rank writes to the same stderr

    class Stderr:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stderr())
    assert main(["train", "train.stesp=3"]) == 2
    said = [w for w in writes if "gspo" in w]
    assert len(said) == 1 and said[0].startswith("gspo: error: unknown config key 'train.stesp'")
    assert said[0].endswith("\n") and said[0].count("\n") == 1


def test_a_missing_or_broken_config_file(tmp_path, capsys):
    fails_cleanly(capsys, "train", "--config", str(tmp_path / "nope.yaml"), says="nope.yaml")
    bad = write(tmp_path / "bad.yaml", "train: {steps: 3\nmodel: [")
    fails_cleanly(capsys, "train", "--config", str(bad), says="bad.yaml")


# ---- model

def test_model_paths_that_cannot_be_trained(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no retry loop, whatever the network
    run = str(tmp_path / "r")
    fails_cleanly(capsys, "train", "--output-dir", run, *QUICK,
                  "model.name_or_path=no-such-org/no-such-model", says="no-such-org/no-such-model")
    fails_cleanly(capsys, "train", "--output-dir", run, *QUICK,
                  f"model.name_or_path={tmp_path}/missing-model", says="missing-model")
    # a model directory without tokenizer files, and a non-causal model
    from transformers import BertConfig, BertModel
    from gspo.models import build_tiny_qwen3, build_tokenizer
    no_tok = tmp_path / "no-tokenizer"
    build_tiny_qwen3(build_tokenizer(), hidden_size=32, num_layers=1, num_heads=2,
                     num_kv_heads=1, intermediate_size=64).save_pretrained(no_tok)
    fails_cleanly(capsys, "train", "--output-dir", run, *QUICK, f"model.name_or_path={no_tok}",
                  says="tokenizer")
    bert = tmp_path / "bert"
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, vocab_size=100)).save_pretrained(bert)
    fails_cleanly(capsys, "train", "--output-dir", run, *QUICK, f"model.name_or_path={bert}",
                  says="bert")
    # a model that soft-caps its logits (Gemma 2): gspo's log-probs would not be its policy's
    from transformers import Gemma2Config, Gemma2ForCausalLM
    gemma = tmp_path / "gemma2"
    tok = build_tokenizer()
    Gemma2ForCausalLM(Gemma2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, vocab_size=len(tok))).save_pretrained(gemma)
    tok.save_pretrained(gemma)
    fails_cleanly(capsys, "train", "--output-dir", run, *QUICK, f"model.name_or_path={gemma}",
                  says="(config.final_logit_softcapping=30.0)")
    # a real model directory too big for this machine: refused from its config.json alone
    tok = build_tokenizer()
    huge = tmp_path / "huge"
    build_tiny_qwen3(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=64).save_pretrained(huge)
    tok.save_pretrained(huge)
    config = json.loads((huge / "config.json").read_text())
    config.update(hidden_size=65536, intermediate_size=262144, num_attention_heads=512,
                  num_key_value_heads=512)
    (huge / "config.json").write_text(json.dumps(config))
    broken = tmp_path / "broken"
    shutil.copytree(huge, broken)
    (broken / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    fails_cleanly(capsys, "train", "--output-dir", run, *QUICK, f"model.name_or_path={broken}",
                  says="could not read the config of model")
    fails_cleanly(capsys, "train", "--output-dir", run, *QUICK, f"model.name_or_path={huge}",
                  says="(weights, gradients, AdamW state at 16 bytes each)")
    fails_cleanly(capsys, "train", "--output-dir", run, *QUICK, f"model.name_or_path={huge}",
                  "model.lora_rank=8", says="(its weights at 4 bytes each)")
    fails_cleanly(capsys, "train", "--output-dir", run, "model.hidden_size=65536",
                  "model.intermediate_size=262144", "model.num_heads=512",
                  "model.num_kv_heads=512", says="choose a smaller model")


# ---- data

@pytest.mark.parametrize("name, content, says", [
    ("rows.jsonl", b'{"prompt": "1+1?", "answer": "2"}\n{"prompt": "\xff\xfe", "answer": "1"}\n',
     "rows.jsonl"),
    ("rows.json", b'[{"prompt": "a", "answer": "1"}, {"prompt": ', "not valid JSON"),
    ("rows.parquet", b"PAR1 this is not parquet", "not a readable Parquet file"),
    ("rows.csv", b"prompt,answer\n\xff,1\n", "rows.csv"),
    ("rows.csv", b"prompt,answer\n1+1?,2,\n",
     "rows.csv row 1: 1 more value than the header's columns (prompt, answer): remove the "
     "trailing comma"),
    ("rows.jsonl", b'{"prompt": "1+1?"}\n', "answer"),
    ("rows.jsonl", b'{"prompt": "1+1?", "answer": []}\n', "row 1: field 'answer' (answer): an "
                                                        "empty list; give the answer"),
    ("rows.txt", b"what?", "rows.txt"),
])
def test_a_bad_data_file(tmp_path, capsys, name, content, says):
    path = write(tmp_path / name, content)
    fails_cleanly(capsys, "train", "--output-dir", str(tmp_path / "r"), *QUICK, "data.task=math",
                  f"data.path={path}", "data.n_eval=1", says=says)


def test_missing_data_and_a_prompt_longer_than_the_context(tmp_path, capsys):
    fails_cleanly(capsys, "train", "--output-dir", str(tmp_path / "r"), *QUICK, "data.task=math",
                  f"data.path={tmp_path}/none.jsonl", says="none.jsonl")
    rows = [{"prompt": "x" * (5 << 20), "answer": "1"}] + [
        {"prompt": f"{i}+1?", "answer": str(i + 1)} for i in range(8)]
    path = write(tmp_path / "long.jsonl", "\n".join(json.dumps(r) for r in rows))
    fails_cleanly(capsys, "train", "--output-dir", str(tmp_path / "r2"), *QUICK, "data.task=math",
                  f"data.path={path}", "data.n_eval=2", says="do not fit the model's context")
    # a budget that leaves no room for any prompt names the budget, not the prompts (skipping
    # them, as the prompts' message advises, left 0 rows)
    fails_cleanly(capsys, "train", "--dry-run", *QUICK, "rollout.max_new_tokens=600",
                  says="none of the 64 training prompts fits (the shortest has")
    fails_cleanly(capsys, "train", "--dry-run", *QUICK, "rollout.max_new_tokens=600",
                  says="set rollout.max_new_tokens to at most 4")


@pytest.mark.parametrize("n_rows, args, says", [
    (1, ["data.eval_path=EVAL"], "has 1 training row(s)"),
    (3, ["data.n_eval=1"], "has 2 training row(s) (held-out rows not counted), fewer than the "
                           "rollout.prompts_per_step=4"),
])
def test_fewer_rows_than_a_step_draws(tmp_path, capsys, n_rows, args, says):
    rows = "".join(json.dumps({"prompt": f"{i}+1?", "answer": str(i + 1)}) + "\n"
                   for i in range(n_rows))
    path, held_out = write(tmp_path / "rows.jsonl", rows), write(tmp_path / "eval.jsonl", rows)
    args = [a.replace("EVAL", str(held_out)) for a in args]
    for dry in ([], ["--dry-run"]):  # the dry run reports what the step would really hold
        fails_cleanly(capsys, "train", *dry, "--output-dir", str(tmp_path / "r"), *QUICK,
                      "data.task=math", f"data.path={path}", "rollout.prompts_per_step=4",
                      f"data.reward={USER}:constant", *args, says=says)


def test_fewer_held_out_rows_than_ranks(tmp_path, capsys):
    rows = [json.dumps({"prompt": f"{i}+1?", "answer": str(i + 1)}) for i in range(4)]
    path, one = write(tmp_path / "rows.jsonl", "\n".join(rows)), write(tmp_path / "one.jsonl", rows[0])
    fails_cleanly(capsys, "train", "--dry-run", "--world-size", "2", *QUICK, "data.task=math",
                  f"data.path={path}", f"data.eval_path={one}", "algorithm.minibatches=1",
                  "train.eval_every=1", f"data.reward={USER}:constant",
                  says="1 held-out row(s) for 2 ranks")


def test_a_dry_run_for_no_ranks(tmp_path, capsys):
    fails_cleanly(capsys, "train", "--dry-run", "--world-size", "0", *QUICK,
                  says="--world-size 0: a launch has at least 1 rank; give the number of ranks "
                       "torchrun will start")


@pytest.mark.parametrize("source", [str(DATA / "math_mini.parquet"), "openai/gsm8k"])
def test_parquet_or_a_hub_dataset_without_the_data_extra(tmp_path, capsys, monkeypatch, source):
    for module in ("pyarrow", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed: import fails
    for dry in ([], ["--dry-run"]):
        fails_cleanly(capsys, "train", *dry, "--output-dir", str(tmp_path / "r"), *QUICK,
                      "data.task=math", f"data.path={source}", "data.n_eval=1",
                      says="pip install 'gspo[data]'")


# ---- rewards

@pytest.mark.parametrize("reward, says", [
    (f"{USER}:needs_a_missing_package", "gspo_no_such_package"),
    (f"{USER}:no_such_function", "no_such_function"),
    ("/no/such/file.py:f", "not found"),
    (f"{USER}:exits", "SystemExit"),
    (f"{USER}:absurd", "1e+30"),
    (f"{USER}:text", f"gspo: error: the reward {USER}:text failed on 4 of 4 completions of the "
                     f"first RL step (first error: TypeError: the reward text returned the text "
                     f"'1', not a number; return a float)"),
])
def test_a_reward_that_cannot_score(tmp_path, capsys, reward, says):
    fails_cleanly(capsys, "train", "--output-dir", str(tmp_path / "r"), *QUICK,
                  f"data.reward={reward}", says=says)


def test_a_reward_module_that_exits_when_imported(tmp_path, capsys):
    script = write(tmp_path / "script.py", "import sys\nsys.exit('bye')\n")
    for dry in ([], ["--dry-run"]):
        fails_cleanly(capsys, "train", *dry, "--output-dir", str(tmp_path / "r"), *QUICK,
                      f"data.reward={script}:f", says="(SystemExit: bye); a reward module must "
                                                      "not exit when imported")


def test_a_reward_that_returns_text_fails_the_dry_run_naming_it(tmp_path, capsys):
    fails_cleanly(capsys, "train", "--dry-run", "--output-dir", str(tmp_path / "r"), *QUICK,
                  f"data.reward={USER}:text",
                  says="gspo: error: the reward text failed on a sample answer (a worked "
                       "solution) to the first training row: TypeError: the reward text returned "
                       "the text '1', not a number; return a float")
    assert not (tmp_path / "r").exists()


def test_a_reward_that_never_returns_times_out(tmp_path, capsys):
    fails_cleanly(capsys, "train", "--output-dir", str(tmp_path / "r"), *QUICK,
                  f"data.reward={USER}:sleeps", "data.reward_fn_timeout=1", says="took longer than 1 s")


def test_a_code_sandbox_that_cannot_run_programs(tmp_path, capsys):
    fails_cleanly(capsys, "train", "--output-dir", str(tmp_path / "r"), *QUICK, "data.task=code",
                  f"data.path={DATA / 'code_mini.jsonl'}", "data.n_eval=2",
                  "data.code_python=/no/such/python3", says="set data.code_python")


# ---- the run directory: nothing of a finished run is lost

@pytest.mark.parametrize("args, says", [
    (["model.hidden_size=64"], "cannot change model.hidden_size=64 (trained with 32)"),
    (["algorithm=grpo"], "cannot change algorithm.name=grpo (trained with gspo)"),
    # what the reward or the objective is, beyond the reward's name and the rows
    (["data.reward_mode=fraction"], "cannot change data.reward_mode=fraction (trained with "
                                    "all): start a new run with --output-dir for that"),
    (["data.format_weight=0.5"], "cannot change data.format_weight=0.5 (trained with 0.0)"),
    (["algorithm.advantage_scale=none"], "cannot change algorithm.advantage_scale=none "
                                         "(trained with group)"),
    (["data.system_prompt=Be brief."], "cannot change data.system_prompt=Be brief. (trained "
                                       "with '')"),
    (["model.lora_rank=4"], "cannot change model.lora_rank=4 (trained with 0)"),
    (["--output-dir", "elsewhere"], "drop --output-dir"),
    (["train.steps=oops"], "train.steps"),
])
def test_a_wrong_resume_leaves_the_run_as_it_was(tmp_path, capsys, finished_run, args, says):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = snapshot(run)
    fails_cleanly(capsys, "train", "--resume", str(run), "train.steps=3", *args, says=says)
    assert snapshot(run) == before


def test_a_checkpoint_or_the_checkpoints_dir_given_as_the_run_is_refused(tmp_path, capsys,
                                                                        finished_run):
    """--resume RUN/checkpoints/step_N trained inside the checkpoint (appending to its
    metrics.jsonl, nesting checkpoints in it), and the next resume of RUN found it damaged;
    --resume RUN/checkpoints and a new run there nested a second run. All refused, naming RUN;
    nothing of the run changes."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = snapshot(run)
    step = sorted((run / "checkpoints").glob("step_*"))[-1]
    for args in (["--resume", str(step), "train.steps=3"],
                 ["--resume", str(run / "checkpoints"), "train.steps=3"],
                 ["--output-dir", str(step / "more"), *QUICK],
                 ["--dry-run", "--output-dir", str(step), *QUICK]):
        fails_cleanly(capsys, "train", *args, says=f"--resume {run}")
    assert snapshot(run) == before


def test_a_resume_of_a_file_or_of_a_broken_config_says_what_to_do(tmp_path, capsys,
                                                                  finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    fails_cleanly(capsys, "train", "--resume", str(run / "metrics.jsonl"),
                  says="--resume takes a run directory")
    fails_cleanly(capsys, "train", "--output-dir", str(tmp_path / "new"),
                  f"model.name_or_path={run}",
                  says="is a gspo run directory, not a model: to start from its trained "
                       "weights pass one of its checkpoints")
    (run / "config.yaml").write_text("train: [\n")
    before = snapshot(run)
    fails_cleanly(capsys, "train", "--resume", str(run), "train.steps=3",
                  says=f"to resume with the config saved with the latest checkpoint instead, "
                       f"delete {run / 'config.yaml'}")
    assert snapshot(run) == before


# ---- a resume that would train something else: refused, the run left as it was

def length_reward(completion: str, **_) -> float:
    return float(len(completion) % 3)


def other_reward(completion: str, **_) -> float:
    return 1.0


ROWS = [{"prompt": f"{i}+1?", "answer": str(i + 1)} for i in range(12)]
PY_RUN = QUICK + ["data.task=math", "data.n_eval=2"]


@pytest.fixture(scope="module")
def python_run(tmp_path_factory):
    """A finished 1-step run whose reward and rows were Python objects."""
    run = tmp_path_factory.mktemp("python") / "run"
    train(load_config(overrides=PY_RUN), run, reward_fn=length_reward, train_data=ROWS)
    return run


@pytest.fixture(scope="module")
def file_run(tmp_path_factory):
    """A finished 1-step run on a math file, scored by a reward named in the config."""
    run = tmp_path_factory.mktemp("file") / "run"
    data = tmp_path_factory.mktemp("data") / "math.jsonl"
    shutil.copy(DATA / "math_mini.jsonl", data)
    train(load_config(overrides=QUICK + ["data.task=math", f"data.path={data}", "data.n_eval=2",
                                         f"data.reward={USER}:constant"]), run)
    return run, data


def copied(run: Path, tmp_path: Path) -> tuple[Path, dict]:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run", snapshot(tmp_path / "run")


def test_a_python_run_resumed_from_the_cli_is_refused(tmp_path, capsys, python_run):
    run, before = copied(python_run, tmp_path)
    fails_cleanly(capsys, "train", "--resume", str(run), "train.steps=2",
                  says="trained on train_data rows given from Python")
    assert snapshot(run) == before


def test_a_python_resume_with_other_rows_or_another_reward_is_refused(tmp_path, python_run):
    from gspo.errors import TrainingError
    run, before = copied(python_run, tmp_path)
    cfg = load_config(overrides=PY_RUN + ["train.steps=2"])
    other_rows = ROWS[:-1] + [{"prompt": "100+1?", "answer": "101"}]
    with pytest.raises(TrainingError, match="rows differ .* the rows given from Python differ"):
        train(cfg, run, resume=True, reward_fn=length_reward, train_data=other_rows)
    with pytest.raises(TrainingError, match="cannot change the reward to test_bad_inputs:"
                                            "other_reward given from Python"):
        train(cfg, run, resume=True, reward_fn=other_reward, train_data=ROWS)
    with pytest.raises(TrainingError, match="cannot change the reward to the math task's own"):
        train(cfg, run, resume=True, train_data=ROWS)
    assert snapshot(run) == before
    train(cfg, run, resume=True, reward_fn=length_reward, train_data=ROWS)  # the same: resumes
    assert (run / "checkpoints" / "step_000002").is_dir()


@pytest.mark.parametrize("change, says", [
    ("data.path", "cannot change data.path="),
    ("data.n_eval=3", "data.n_eval=3 (trained with 2)"),
    ("edit", "the data file's contents changed"),
    ("data.reward=math", "cannot change the reward to the math task's own reward (trained "
                         "with data.reward="),
])
def test_a_resume_on_other_data_or_another_reward_is_refused(tmp_path, capsys, file_run, change,
                                                             says):
    run, before = copied(file_run[0], tmp_path)
    if change == "data.path":
        change = f"data.path={DATA / 'gsm8k_mini.jsonl'}"
    elif change == "edit":  # the file the run was trained on, changed in place
        file_run[1].write_text(file_run[1].read_text().replace("11", "12"))
    args = [change] if "=" in change else []
    try:
        fails_cleanly(capsys, "train", "--resume", str(run), "train.steps=2", *args, says=says)
        fails_cleanly(capsys, "train", "--dry-run", "--resume", str(run), "train.steps=2",
                      *args, says=says)
    finally:
        shutil.copy(DATA / "math_mini.jsonl", file_run[1])
    assert snapshot(run) == before


def test_what_only_tunes_the_run_or_means_nothing_in_it_may_change(finished_run):
    from gspo.runrecord import check_resume
    ckpt = finished_run / "checkpoints" / "step_000002"
    for change in (["optim.lr=1e-5", "algorithm.eps_high=5e-4", "algorithm.beta=0",
                    "data.reward_timeout=9", "train.precision=bf16-mixed"],
                   ["model.lora_alpha=8"]):  # LoRA's scale, in a run without LoRA
        cfg = load_config(overrides=QUICK + ["train.steps=3"] + change)
        assert check_resume(cfg, finished_run, ckpt)["reward"] == "arithmetic"


def test_fewer_steps_than_done_is_refused(tmp_path, capsys, finished_run):
    run, before = copied(finished_run, tmp_path)
    fails_cleanly(capsys, "train", "--resume", str(run), "train.steps=1",
                  says="train.steps=1 but the run has done 2 RL steps")
    assert snapshot(run) == before


@pytest.mark.parametrize("args, says", [
    (["algorithm=grpo"], "cannot change algorithm.name=grpo (trained with gspo)"),
    (["model.hidden_size=64"], "cannot change model.hidden_size=64 (trained with 32)"),
])
def test_a_deleted_config_yaml_does_not_skip_the_checks(tmp_path, capsys, finished_run, args,
                                                        says):
    run, _ = copied(finished_run, tmp_path)
    config = shutil.copy(run / "config.yaml", tmp_path / "x.yaml")
    (run / "config.yaml").unlink()
    before = snapshot(run)
    fails_cleanly(capsys, "train", "--resume", str(run), "--config", str(config),
                  "train.steps=3", *args, says=says)
    assert snapshot(run) == before and not (run / "config.yaml").exists()


def test_a_deleted_config_yaml_is_resumed_from_the_checkpoint(tmp_path, finished_run):
    run, _ = copied(finished_run, tmp_path)
    saved = (run / "config.yaml").read_text()
    (run / "config.yaml").unlink()
    assert main(["train", "--resume", str(run), "train.steps=3"]) == 0
    assert (run / "config.yaml").read_text() == saved.replace("steps: 2\n", "steps: 3\n", 1)
    # an old checkpoint (no run.json) without config.yaml: it says to pass --config
    (run / "config.yaml").unlink()
    for record in (run / "checkpoints").glob("step_*/run.json"):
        record.unlink()
        manifest = json.loads((record.parent / "manifest.json").read_text())
        del manifest["files"]["run.json"]
        (record.parent / "manifest.json").write_text(json.dumps(manifest))
    assert main(["train", "--resume", str(run), "train.steps=4"]) == 2


def test_training_into_a_finished_run_or_resuming_an_empty_one(tmp_path, capsys, finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = snapshot(run)
    fails_cleanly(capsys, "train", "--output-dir", str(run), *QUICK, says="--resume")
    assert snapshot(run) == before
    (tmp_path / "empty").mkdir()
    fails_cleanly(capsys, "train", "--resume", str(tmp_path / "empty"), *QUICK,
                  says="no run to resume there")


def test_a_new_run_does_not_overwrite_the_users_own_config_yaml(tmp_path, capsys, monkeypatch,
                                                                finished_run):
    mine = write(tmp_path / "config.yaml", "# my settings, with comments\ntrain:\n  steps: 1  "
                                           "# one step to try\n").read_text()
    monkeypatch.chdir(tmp_path)
    for dry in ([], ["--dry-run"]):
        fails_cleanly(capsys, "train", *dry, "--config", "config.yaml", "--output-dir", ".",
                      *QUICK, says="config.yaml is not a gspo run's (no metrics.jsonl beside "
                                   "it): a new run writes its resolved config there and would "
                                   "overwrite it; choose another --output-dir")
    assert (tmp_path / "config.yaml").read_text() == mine
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    # a gspo run stopped before its first checkpoint may be started again where it was
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "checkpoints")
    assert main(["train", "--output-dir", str(run), *QUICK]) == 0


def test_every_checkpoint_damaged_is_one_error_and_nothing_is_deleted(tmp_path, capsys,
                                                                      finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    for ckpt in (run / "checkpoints").glob("step_*"):
        weights = ckpt / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    before = snapshot(run)
    fails_cleanly(capsys, "train", "--resume", str(run), "train.steps=3", says="damaged")
    assert snapshot(run) == before


def test_a_truncated_trainer_state_without_a_manifest_is_damage_too(tmp_path, capsys, caplog,
                                                                   finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    for ckpt in (run / "checkpoints").glob("step_*"):
        (ckpt / "manifest.json").unlink()
        write(ckpt / "trainer_state.pt", (ckpt / "trainer_state.pt").read_bytes()[:100])
    before = snapshot(run)
    fails_cleanly(capsys, "train", "--resume", str(run), "train.steps=3",
                  says="step_000002: trainer_state.pt is unreadable (truncated, or not written "
                       "by torch.save); step_000001: trainer_state.pt is unreadable")
    assert snapshot(run) == before
    # with an intact one left, the resume starts from it
    shutil.rmtree(run)
    shutil.copytree(finished_run, run)
    for ckpt in (run / "checkpoints").glob("step_*"):
        (ckpt / "manifest.json").unlink()
    newest = run / "checkpoints" / "step_000002" / "trainer_state.pt"
    write(newest, newest.read_bytes()[:100])
    assert main(["train", "--resume", str(run), "train.steps=3"]) == 0
    assert "trainer_state.pt is unreadable" in caplog.text
    assert "resuming from step_000001" in caplog.text
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]


@pytest.mark.parametrize("where, says", [
    ("file", "it is a file, not a directory"),
    ("file/run", "file is a file, not a directory"),
    ("x" * 300, "longer than the 255 bytes a file name may have"),
    ("read-only/run", "not writable here (permissions, or a read-only filesystem)"),
])
def test_a_run_directory_that_cannot_be_written(tmp_path, capsys, monkeypatch, where, says):
    write(tmp_path / "file", "my notes")
    (tmp_path / "read-only").mkdir()
    access = os.access  # root may write anywhere: a read-only filesystem refuses it even so
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: (
        "read-only" not in str(p) and access(p, mode, **kw)))
    for how in (["--output-dir"], ["--dry-run", "--output-dir"], ["--resume"]):
        fails_cleanly(capsys, "train", *how, str(tmp_path / where), *QUICK, says=says)
    assert (tmp_path / "file").read_text() == "my notes"
    assert list((tmp_path / "read-only").iterdir()) == []


def _delete(path: Path) -> None:
    path.unlink()


def _cut_the_last_line(path: Path) -> None:  # a crash mid-write
    path.write_text(path.read_text()[:-40])


def _tear_a_middle_line(path: Path) -> None:  # a torn write, then more rows
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][:30] + "\n" + "".join(lines[2:]))


@pytest.mark.parametrize("damage, says", [
    (_delete, "metrics.jsonl is missing: restored"),
    (_cut_the_last_line, "lacks the rows of steps 2: restored"),
    (_tear_a_middle_line, "lacks the rows of steps 1: restored"),
])
def test_a_damaged_metrics_file_is_repaired_from_the_checkpoint(tmp_path, caplog, finished_run,
                                                                damage, says):
    run, _ = copied(finished_run, tmp_path)
    rows = read_metrics(run)
    damage(run / "metrics.jsonl")
    assert main(["train", "--resume", str(run), "train.steps=3"]) == 0
    assert says in caplog.text
    assert read_metrics(run)[:3] == rows and [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]


def _without_metrics_copies(run: Path) -> None:  # checkpoints from before they held one
    for copy in (run / "checkpoints").glob("step_*/metrics.jsonl"):
        copy.unlink()
        manifest = json.loads((copy.parent / "manifest.json").read_text())
        del manifest["files"]["metrics.jsonl"]
        (copy.parent / "manifest.json").write_text(json.dumps(manifest))


def test_a_torn_metrics_line_nothing_can_restore_is_one_error(tmp_path, capsys, finished_run):
    run, _ = copied(finished_run, tmp_path)
    metrics = run / "metrics.jsonl"
    _tear_a_middle_line(metrics)
    torn = f"gspo: error: {metrics}:2: not a metrics row (a torn or edited line)"
    assert fails_cleanly(capsys, "plot", str(run), says=torn) == (
        f"{torn}; delete or fix that line, or copy back "
        f"{run / 'checkpoints' / 'step_000002' / 'metrics.jsonl'}, the latest checkpoint's copy "
        f"of the rows up to its step")
    _without_metrics_copies(run)
    before = snapshot(run)
    for dry in ([], ["--dry-run"]):  # the resume would drop the row: refused, the file kept
        assert fails_cleanly(capsys, "train", *dry, "--resume", str(run), "train.steps=3",
                             says=torn) == (
            f"{torn}, and the checkpoint of step 2 holds no copy of the file to restore it "
            f"from; delete or fix that line, then resume again")
    assert snapshot(run) == before
    assert fails_cleanly(capsys, "plot", str(run), says=torn) == f"{torn}; delete or fix that line"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:1] + lines[2:]))
    assert main(["train", "--resume", str(run), "train.steps=3"]) == 0  # the line deleted
    assert [r["step"] for r in read_metrics(run)] == [0, 2, 3]


def test_a_run_directory_in_use(tmp_path, capsys, finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = snapshot(run)
    with exclusive(run):  # another gspo train holds it
        fails_cleanly(capsys, "train", "--resume", str(run), "train.steps=3", says="in use")
    assert snapshot(run) == before


# ---- the other commands

def test_eval_plot_and_fetch_model_mistakes(tmp_path, capsys, finished_run):
    ckpt = finished_run / "checkpoints" / "step_000002"
    fails_cleanly(capsys, "eval", "--model", str(ckpt), "--data", str(DATA / "math_mini.jsonl"),
                  "--task", "math", "--output", str(tmp_path), says=str(tmp_path))
    fails_cleanly(capsys, "eval", "--model", str(tmp_path / "nope"), "--data",
                  str(DATA / "math_mini.jsonl"), "--task", "math", says="nope")
    fails_cleanly(capsys, "plot", str(tmp_path / "no-run"), says="no-run")
    fails_cleanly(capsys, "eval", "--model", str(finished_run / "config.yaml"), "--data",
                  str(DATA / "math_mini.jsonl"), "--task", "math", says="is a file; pass a model")
    lora = write_dir(tmp_path / "step_000001" / "lora", {"adapter_config.json": "{}"})
    fails_cleanly(capsys, "eval", "--model", str(lora), "--data", str(DATA / "math_mini.jsonl"),
                  "--task", "math", says=f"LoRA adapter alone, not a model; pass the checkpoint "
                                         f"that holds it, {lora.parent}")
    fails_cleanly(capsys, "eval", "--model", str(tmp_path), "--data",
                  str(DATA / "math_mini.jsonl"), "--task", "math",
                  says="neither a model directory (no config.json) nor a run directory")
    fails_cleanly(capsys, "fetch-model", "smollm2-999m", says="unknown pretrained model")
    mine = write_dir(tmp_path / "mywork", {"notes.txt": "keep me"})
    for force in ([], ["--force"]):
        fails_cleanly(capsys, "fetch-model", "smollm2-135m-instruct", "--output", str(mine),
                      *force, says="is not a model gspo fetch-model wrote, so it is left as it is")
    assert (mine / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("where", ["", "checkpoints", "checkpoints/latest"])
def test_eval_takes_a_run_directory_for_its_latest_checkpoint(tmp_path, capsys, finished_run,
                                                              where):
    out = tmp_path / "eval.jsonl"
    assert main(["eval", "--model", str(finished_run / where), "--data",
                 str(DATA / "math_mini.jsonl"), "--task", "math", "--k", "1", "--limit", "2",
                 "--max-new-tokens", "4", "--output", str(out)]) == 0
    assert "step_000002, the latest checkpoint of" in capsys.readouterr().err
    assert out.is_file()


def test_run_json_records_the_software_and_a_resume_under_other_software_says_so(
        tmp_path, finished_run, caplog):
    import platform

    import torch
    import transformers

    from gspo import __version__
    from gspo.runrecord import IMPORTED_LIBRARIES, check_resume
    run, _ = copied(finished_run, tmp_path)
    ckpt = run / "checkpoints" / "step_000002"
    record = json.loads((ckpt / "run.json").read_text())
    base = {"python": platform.python_version(), "gspo": __version__,
            "torch": torch.__version__, "transformers": transformers.__version__}
    extra = {k: v for k, v in record["versions"].items() if k not in base}
    assert {k: record["versions"][k] for k in base} == base
    # peft's, vLLM's where this test process had imported them when the run trained
    assert extra == {k: sys.modules[k].__version__ for k in extra if k in IMPORTED_LIBRARIES}
    cfg = load_config(overrides=QUICK + ["train.steps=3"])
    check_resume(cfg, run, ckpt)
    assert "other software" not in caplog.text  # the same software: nothing said
    record["versions"]["torch"] = "2.0.0"
    (ckpt / "run.json").write_text(json.dumps(record))
    check_resume(cfg, run, ckpt)
    assert f"other software (torch 2.0.0 -> {torch.__version__})" in caplog.text
