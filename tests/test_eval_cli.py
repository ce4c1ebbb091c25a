import json
from pathlib import Path

import pytest
import torch

from gspo.cli import main as cli_main
from gspo.config import DataConfig
from gspo.eval_cli import format_table, report_records
from gspo.evaluation import evaluate
from gspo.models import build_tiny_qwen3
from gspo.engines import Rollouts, SamplingParams, left_pad
from gspo.tasks import build_reward
from gspo.tasks.datasets import load_rows

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


class ScriptedEngine:
    """A rollout engine whose responses are given: script[i] holds the n texts of prompt i,
    in the order prompts arrive across generate calls."""

    def __init__(self, tok, script):
        self.tok, self.script, self.next = tok, script, 0

    def generate(self, prompts, n, params, seed):
        texts = []
        for _ in prompts:
            assert len(self.script[self.next]) == n
            texts += self.script[self.next]
            self.next += 1
        eos, pad = self.tok.eos_token_id, self.tok.pad_token_id
        resp = [self.tok.encode(t, add_special_tokens=False) + [eos] for t in texts]
        T = max(map(len, resp))
        ids = torch.full((len(resp), T), pad)  # (B, T)
        mask = torch.zeros(len(resp), T)
        for i, r in enumerate(resp):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], pad)
        return Rollouts(prompt_ids, prompt_mask, ids, mask, torch.zeros(len(resp), T))

    def load_weights(self, state_dict):
        pass


def exact(completion, answer, **_):
    return float(completion.strip() == answer)


def test_avg_and_pass_at_k_of_known_outputs(tok):
    rows = [{"prompt": "3+3", "answer": "6"}, {"prompt": "1+1", "answer": "2"},
            {"prompt": "1+2", "answer": "3"}]
    script = [["6", "7", "6", "x"], ["a", "b", "c", "d"], ["3", "3", "3", "3"]]  # 2, 0, 4 right
    result = evaluate(ScriptedEngine(tok, script), tok, rows, exact, k=4,
                      params=SamplingParams(), seed=0, batch_size=2)
    records = report_records(result, rows, k=4)
    per, overall = records[:-1], records[-1]
    assert [r["correct"] for r in per] == [2, 0, 4]
    assert [r["avg@4"] for r in per] == [0.5, 0.0, 1.0]
    # pass@2 of 2 right in 4: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert [r["pass@2"] for r in per] == pytest.approx([5 / 6, 0.0, 1.0])
    assert per[0]["completions"] == ["6", "7", "6", "x"] and per[0]["rewards"][:2] == [1.0, 0.0]
    assert overall["id"] == "overall" and overall["problems"] == 3
    assert overall["avg@4"] == pytest.approx(6 / 12)
    assert overall["pass@1"] == pytest.approx(0.5)
    assert overall["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert overall["pass@4"] == pytest.approx(2 / 3)
    table = format_table(records, k=4)
    assert "avg@4" in table and "pass@4" in table
    assert " 2/4 " in table and "83.3%" in table and "overall" in table and "66.7%" in table


def test_code_eval_runs_the_programs(tok):
    d = DataConfig(task="code", solution_field="solution", code_timeout=3.0)
    rows = load_rows(DATA / "code_mini.jsonl", d)
    script = [[r["solution"], "```python\nprint(0)\n```"] for r in rows]
    reward = build_reward(d)
    try:
        result = evaluate(ScriptedEngine(tok, script), tok, rows, reward, k=2,
                          params=SamplingParams(), seed=0)
    finally:
        reward.close()
    assert [p["rewards"] for p in result.per_problem] == [[1.0, 0.0]] * len(rows)
    assert result.avg_at_k == 0.5 and result.pass_at == {1: 0.5, 2: 1.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("tiny-model")
    model = build_tiny_qwen3(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_gspo_eval_writes_jsonl_and_prints_a_table(model_dir, tmp_path, capsys):
    out = tmp_path / "eval.jsonl"
    rc = cli_main(["eval", "--model", str(model_dir), "--data", str(DATA / "math_mini.jsonl"),
                   "--task", "math", "--k", "4", "--max-new-tokens", "8", "--output", str(out)])
    assert rc == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    per, overall = records[:-1], records[-1]
    assert len(per) == 12 and [r["id"] for r in per] == list(range(12))
    assert all(len(r["completions"]) == 4 and len(r["rewards"]) == 4 for r in per)
    assert overall["id"] == "overall" and overall["n"] == 4
    assert overall["avg@4"] == pytest.approx(sum(r["avg@4"] for r in per) / 12)
    for k in (1, 2, 4):
        assert overall[f"pass@{k}"] == pytest.approx(sum(r[f"pass@{k}"] for r in per) / 12)
    printed = capsys.readouterr().out
    assert "overall" in printed and "pass@4" in printed and str(out) in printed


@pytest.mark.parametrize("dtype, warned", [
    ("bfloat16", "warning: --dtype bfloat16 on a CPU without bf16 instructions"),
    ("float16", "warning: --dtype float16 on the CPU: most CPUs have no fast float16 matmul"),
    ("float32", None)])
def test_gspo_eval_warns_of_a_dtype_this_cpu_runs_slowly(model_dir, tmp_path, capsys,
                                                         monkeypatch, dtype, warned):
    import gspo.preflight
    monkeypatch.setattr(gspo.preflight, "cpu_has_bf16", lambda: False)
    rc = cli_main(["eval", "--model", str(model_dir), "--data", str(DATA / "math_mini.jsonl"),
                   "--task", "math", "--k", "1", "--limit", "1", "--max-new-tokens", "2",
                   "--dtype", dtype, "--device", "cpu", "--output", str(tmp_path / "e.jsonl")])
    assert rc == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    if warned is None:
        assert lines == []
    else:  # named as gspo eval's user sets it, the fix too
        (line,) = lines
        assert line.startswith(warned) and "rollout.dtype" not in line
        assert line.endswith({"bfloat16": "use --dtype float32 on this machine",  # not bf16 here
                              "float16": "use --dtype float32"}[dtype])


def test_gspo_eval_builds_the_models_gspo_train_builds(tmp_path):
    out = tmp_path / "eval.jsonl"
    assert cli_main(["eval", "--model", "tiny-qwen3-moe", "--data", str(DATA / "math_mini.jsonl"),
                     "--task", "math", "--k", "2", "--max-new-tokens", "4", "--limit", "3",
                     "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[-1]["problems"] == 3 and all(len(r["completions"]) == 2 for r in records[:-1])


def test_gspo_eval_passes_the_engines_settings_to_it(tmp_path, monkeypatch):
    from gspo.engines import HFEngine, VLLMEngine

    built = {}

    def from_model(cls, model, tokenizer, *, dtype, seed, own_copy, **options):
        built.update(model=type(model).__name__, dtype=dtype, seed=seed, own_copy=own_copy,
                     **options)
        return HFEngine.from_model(model, tokenizer, dtype=dtype, seed=seed)

    monkeypatch.setattr(VLLMEngine, "from_model", classmethod(from_model))  # vLLM not needed
    assert cli_main(["eval", "--model", "tiny-qwen3-moe", "--data", str(DATA / "math_mini.jsonl"),
                     "--task", "math", "--k", "2", "--max-new-tokens", "2", "--limit", "2",
                     "--engine", "vllm", "--dtype", "bfloat16", "--seed", "5",
                     "rollout.vllm_gpu_memory_utilization=0.8", "rollout.vllm_sleep=true",
                     "--output", str(tmp_path / "eval.jsonl")]) == 0
    assert built == {"model": "Qwen3MoeForCausalLM", "dtype": "bfloat16", "seed": 5,
                     "own_copy": False, "gpu_memory_utilization": 0.8, "record_routing": False,
                     "tensor_parallel_size": 1, "sleep": True}


def test_gspo_eval_of_a_reward_that_failed_on_every_sample_is_an_error_not_0(model_dir,
                                                                             tmp_path, capsys):
    (tmp_path / "rw.py").write_text("def raises(completion, **_):\n    raise KeyError('boom')\n")
    out = tmp_path / "eval.jsonl"
    rc = cli_main(["eval", "--model", str(model_dir), "--data", str(DATA / "math_mini.jsonl"),
                   "--task", "math", "--k", "2", "--limit", "2", "--max-new-tokens", "2",
                   f"data.reward={tmp_path}/rw.py:raises", "--output", str(out)])
    captured = capsys.readouterr()
    assert rc == 2 and "Traceback" not in captured.err and "overall" not in captured.out
    assert captured.err.strip().splitlines()[-1] == (
        f"gspo: error: the reward {tmp_path}/rw.py:raises failed on every one of the 4 samples "
        f"(first error: KeyError: 'boom'), so nothing was measured; fix the reward function "
        f"(the samples are in {out})")
    assert len(out.read_text().splitlines()) == 3  # the samples are kept to debug it with


def test_gspo_eval_bounds_a_reward_call_by_data_reward_fn_timeout(model_dir, tmp_path, capsys):
    # as gspo train's evaluation does: a reward that hangs (a network call) must not hang eval
    (tmp_path / "rw.py").write_text("import time\n\n"
                                    "def slow(completion, **_):\n    time.sleep(3)\n"
                                    "    return 1.0\n")
    rc = cli_main(["eval", "--model", str(model_dir), "--data", str(DATA / "math_mini.jsonl"),
                   "--task", "math", "--k", "1", "--limit", "1", "--max-new-tokens", "2",
                   f"data.reward={tmp_path}/rw.py:slow", "data.reward_fn_timeout=0.2",
                   "--output", str(tmp_path / "eval.jsonl")])
    assert rc == 2 and "TimeoutError: the reward took longer than 0.2 s" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--data", "/no/such.jsonl"], "data.path '/no/such.jsonl' not found"),
    (["--data", str(DATA / "gsm8k_mini.jsonl")], "row 1: field 'prompt' (prompt) is missing"),
    (["--data", str(DATA / "math_mini.jsonl"), "train.steps=2"],
     "data.* and rollout.* overrides only"),
    (["--data", str(DATA / "math_mini.jsonl"), "rollout.temperature=0.5"],
     "rollout.temperature=0.5 (set with --temperature)"),
    # a flag's bad value is named by the flag, not by the config key it sets
    (["--data", str(DATA / "math_mini.jsonl"), "--engine", "sglang"],
     "--engine must be one of hf | vllm, got 'sglang'"),
    (["--data", str(DATA / "math_mini.jsonl"), "--dtype", "bf16"],
     "--dtype must be one of auto | float32 | bfloat16 | float16, got 'bf16'"),
    (["--data", str(DATA / "math_mini.jsonl"), "--device", "gpu"],
     "--device 'gpu' is not a device"),
    # NaN sampled one token over and over, scored 0% and exited 0
    (["--data", str(DATA / "math_mini.jsonl"), "--temperature", "nan"],
     "temperature must be >= 0, got nan"),
    # checked before the evaluation runs, so that its results are never lost
    (["--data", str(DATA / "math_mini.jsonl"), "--output", str(DATA)], "must name a file"),
    (["--data", str(DATA / "math_mini.jsonl"), "--output", "/no/such/dir/e.jsonl"],
     "must name a file in an existing directory"),
    (["--data", str(DATA / "math_mini.jsonl"), "--output", "/proc/e.jsonl"],
     "--output /proc/e.jsonl: cannot write it"),
])
def test_gspo_eval_errors_exit_2_with_one_line(model_dir, capsys, args, message):
    rc = cli_main(["eval", "--model", str(model_dir), "--task", "math", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err
