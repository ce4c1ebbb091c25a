"""Each benchmark script runs end to end at a minimal setting (they are scripts, not tests: the
numbers are not checked, only that the script works and prints its table)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = ["--hidden-size", "32", "--num-heads", "2", "--num-kv-heads", "1", "--intermediate-size", "64"]


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A tiny Qwen3 and its tokenizer saved as a Hugging Face directory, for `--model`."""
    sys.path.insert(0, str(BENCH))
    from common import save_tiny_model

    return save_tiny_model(tmp_path / "model", 32, 1, 2, 1, 64)


def run(script: str, *args: str, tmp_path: Path) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(BENCH / script), *args, "--threads", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "|---" in proc.stdout  # the table
    return json.loads(out.read_text())


def test_generation_benchmark_runs(tmp_path):
    res = run("generation.py", "--prompts", "2", "--group-size", "2", "--max-new-tokens", "3",
              "--num-layers", "1", "--repeats", "1", *TINY, tmp_path=tmp_path)
    assert {r["system"] for r in res["rows"]} == {"hf engine", "hf engine, plain loop", "model.generate"}
    assert all(r["tokens_per_s"] > 0 for r in res["rows"])


def test_logprobs_benchmark_runs_and_agrees_with_naive(tmp_path):
    res = run("logprobs.py", "--vocab", "500", "--lengths", "24", "--hidden-size", "16",
              "--chunk-size", "8", tmp_path=tmp_path)
    assert [r["T"] for r in res["rows"]] == [24]
    assert all(r["same"] == "yes" for r in res["rows"])


def test_scaling_benchmark_runs_and_counts_update_flops(tmp_path):
    res = run("scaling.py", "--lengths", "2,3", "--groups", "2", "--widths", "32",
              "--base-length", "3", "--base-group", "2", "--base-width", "32", "--prompts", "2",
              "--layers", "1", "--steps", "2", "--flops-width", "32", tmp_path=tmp_path)
    assert [r["T"] for r in res["sweeps"]["T"]] == [2, 3]
    assert res["matmul"]["update_gflop"] > 0 and res["gemm_gflops"] > 0


@pytest.mark.slow  # TRL is the baseline of a benchmark run by hand, not a gspo path
@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="TRL is not installed (pip install -e '.[bench]')")
def test_vs_trl_benchmark_runs(tmp_path):
    res = run("vs_trl.py", "--steps", "1", "--repeats", "1", "--prompts", "2", "--group-size", "2",
              "--max-new-tokens", "3", "--num-layers", "1", "--systems", "gspo,trl", "--no-flops",
              *TINY, tmp_path=tmp_path)
    systems = {r["system"] for r in res["rows"]}
    assert {"gspo", "trl", "gspo / trl"} <= systems
    assert all(r["completions"] == 4 and r["task"] == "arithmetic"
               for runs in res["runs"].values() for r in runs)


@pytest.mark.slow  # out of CI: test_vs_trl_benchmark_runs runs the same comparison
@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="TRL is not installed (pip install -e '.[bench]')")
def test_vs_trl_on_a_model_directory_takes_the_recipes_task(tmp_path, model_dir):
    # --model: a saved model instead of the built one, prompted through its chat template and
    # scored by math-verify on both sides (the SmolLM2 recipe's task); a tiny model keeps it quick
    res = run("vs_trl.py", "--model", str(model_dir), "--steps", "1", "--repeats", "1", "--prompts",
              "2", "--group-size", "2", "--max-new-tokens", "3", "--systems", "gspo,trl",
              "--no-flops", tmp_path=tmp_path)
    assert [r["task"] for runs in res["runs"].values() for r in runs] == ["math", "math"]
    assert all(r["completions"] == 4 for runs in res["runs"].values() for r in runs)


def test_old_logprobs_benchmark_runs():
    proc = subprocess.run(
        [sys.executable, str(BENCH / "old_logprobs.py"), "--steps", "1", "--repeats", "1",
         "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=3", "data.n_train=50", "data.n_eval=4"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ratio rollout/recompute" in proc.stdout


def test_async_rollouts_benchmark_prints_the_ratio_and_the_bound():
    proc = subprocess.run(
        [sys.executable, str(BENCH / "async_rollouts.py"), "--steps", "2", "--repeats", "2",
         "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=3", "data.n_train=50", "data.n_eval=4"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "steps/hour async k=1 / sync: " in proc.stdout and "the bound" in proc.stdout
    assert "steps/hour async k=1 fixed / sync: " in proc.stdout
    sync = next(line for line in proc.stdout.splitlines() if line.startswith("sync "))
    mean, each = float(sync.split()[1]), [float(x) for x in sync.split("  ")[-1].split(" / ")]
    assert len(each) == 2 and mean == pytest.approx(sum(each) / 2, abs=0.011)  # each repeat's


def test_profile_step_benchmark_splits_the_step_into_phases(tmp_path):
    res = run("profile_step.py", "--prompts", "2", "--group-size", "2", "--max-new-tokens", "3",
              "--num-layers", "1", "--minibatches", "2", "--steps", "1", *TINY, tmp_path=tmp_path)
    rows = {r["phase"]: r for r in res["rows"]}
    assert set(rows) == {"rollout", "pi_old", "update", "step"}
    assert rows["step"]["ms"] == pytest.approx(sum(rows[p]["ms"] for p in ("rollout", "pi_old", "update")))
    assert all(0 < rows[p]["gemm_share"] < 1 and rows[p]["gemm_gflop"] > 0
               for p in ("rollout", "pi_old", "update"))


def test_profile_step_on_a_model_directory(tmp_path, model_dir):
    res = run("profile_step.py", "--model", str(model_dir), "--prompts", "2", "--group-size", "2",
              "--max-new-tokens", "3", "--minibatches", "2", "--steps", "1", "--warmup-steps", "1",
              "--profile-repeats", "1", tmp_path=tmp_path)
    assert {r["phase"] for r in res["rows"]} == {"rollout", "pi_old", "update", "step"}


def test_lora_vs_full_benchmark_runs(tmp_path):
    pytest.importorskip("peft")
    res = run("lora_vs_full.py", "--model", "tiny-qwen3", "--steps", "2", "--lora-rank", "2",
              "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
              "model.num_kv_heads=1", "model.intermediate_size=64", "rollout.prompts_per_step=2",
              "rollout.group_size=2", "rollout.max_new_tokens=4", "algorithm.minibatches=1",
              tmp_path=tmp_path)
    assert set(res["summary"]) == {"full", "lora"}
    assert all(v["step_s"] > 0 and v["peak_rss_mb"] > 0 for v in res["summary"].values())


def test_memory_benchmark_runs_and_sizes_the_parts(tmp_path):
    res = run("memory.py", "--model", "tiny-qwen3", "model.hidden_size=32", "model.num_layers=1",
              "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
              "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
              "algorithm.minibatches=1", tmp_path=tmp_path)
    assert len(res["phases"]) == 5 and all(p["peak"] >= p["before"] > 0 for p in res["phases"])
    # AdamW's two moments are exactly twice the gradients, which are the weights (all trainable)
    assert res["needs"]["AdamW moments"] == pytest.approx(2 * res["needs"]["gradients"])
    assert res["needs"]["gradients"] == pytest.approx(res["needs"]["weights"])


def test_precision_benchmark_times_each_mode_and_phase(tmp_path):
    res = run("precision.py", "--prompts", "2", "--group-size", "2", "--max-new-tokens", "3",
              "--num-layers", "1", "--steps", "1", "--modes", "fp32", "bf16-mixed",
              "--rate-seconds", "0", *TINY,
              tmp_path=tmp_path)
    rows = {(r["mode"], r["phase"]): r for r in res["rows"]}
    assert set(rows) == {(m, p) for m in ("fp32", "bf16-mixed")
                         for p in ("rollout", "pi_old", "update", "step")}
    # FLOPs counted per mode (bf16 samples other responses, of other lengths)
    assert all(rows[m, p]["gflop"] > 0 for m in ("fp32", "bf16-mixed")
               for p in ("rollout", "pi_old", "update"))
    assert rows["fp32", "step"]["speedup"] == 1.0 and res["rates"]["bf16_gemm"] > 0


def test_precision_benchmark_measures_the_update_direction(tmp_path):
    res = run("precision.py", "--direction", "--prompts", "2", "--group-size", "2",
              "--max-new-tokens", "3", "--num-layers", "1", "--modes", "fp32", "bf16-true",
              *TINY, tmp_path=tmp_path)
    rows = {r["mode"]: r for r in res["rows"]}
    assert rows["fp32"]["same_direction"] == 1.0 and rows["fp32"]["moved"] > 0.9
    assert rows["bf16-true"]["moved"] < 0.1  # lr 1e-6 vanishes in bf16 weights


def test_token_budget_benchmark_times_fixed_and_packed_micro_batches(tmp_path):
    res = run("token_budget.py", "--steps", "1", "--micro", "2", "model.hidden_size=32",
              "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
              "model.intermediate_size=64", "rollout.prompts_per_step=2", "rollout.group_size=2",
              "rollout.max_new_tokens=6", "algorithm.minibatches=1", "data.n_train=50",
              "data.n_eval=4", tmp_path=tmp_path)
    fixed, packed = res["rows"]
    assert fixed["system"] == "2 rows each" and packed["system"].endswith("tokens each")
    assert all(r["update_s"] > 0 and r["update_positions"] > 0 for r in res["rows"])
    assert res["budget"] > 0 and fixed["update_speedup"] == 1.0
