"""Each experiment script runs end to end at its smallest size: its own plan, training and report
code, writing only into tmp_path. The SmolLM2 scripts take `--model tiny-qwen3` with tiny sizes
in `--extra`; the MoE scripts shrink steps, warm-up and held-out set (moe_mismatch its model
too). The numbers are not checked, only that every planned run trains and lands in the report.
The full experiments take hours of CPU and stay out of CI.

The scripts run in this process through main(argv), as their siblings import them (one torch
import for all six keeps the file under a minute on one thread); pytest-timeout bounds each."""

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
# the SmolLM2 recipe (its math task and data) on a tiny Qwen3; 2 x 4 samples a step, which
# smollm2_tuned's algorithm.minibatches 1, 4 and 8 all divide
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "train.eval_k=1"]
SMOLLM2 = ["--model", "tiny-qwen3", "--extra", *TINY]


@pytest.fixture
def experiment():
    """experiment(name): the script's module; torch's thread count is restored afterwards (the
    scripts set it for the whole process)."""
    threads = torch.get_num_threads()
    sys.path.insert(0, str(EXPERIMENTS))
    yield importlib.import_module
    sys.path.remove(str(EXPERIMENTS))
    torch.set_num_threads(threads)


def rl_steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if "loss" in r]


def eval_steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if "eval/accuracy" in r]


@pytest.mark.timeout(90)
def test_moe_stability_trains_each_variant_and_writes_its_table(tmp_path, experiment):
    mod = experiment("moe_stability")
    out = tmp_path / "out"
    assert mod.main(["--steps", "2", "--warmup", "2", "--seeds", "0", "--n-eval", "8",
                     "--eval-every", "1", "--work", str(tmp_path / "runs"), "--out", str(out)]) == 0
    res = json.loads((out / "moe_stability.json").read_text())
    assert set(res) == set(mod.VARIANTS) and all(set(r) == {"0"} for r in res.values())
    for rows in (r["0"] for r in res.values()):
        assert rl_steps(rows) == [1, 2] and eval_steps(rows) == [0, 1, 2]
    assert any(r.get("moe/volatility") is not None for r in res["grpo+replay"]["0"])
    page = (out / "moe_stability.md").read_text()
    assert all(f"| {name} | " in page for name in mod.VARIANTS)
    assert all((out / f"moe_{key.replace('/', '_')}.png").is_file() for key, _ in mod.PLOTS)


@pytest.mark.timeout(150)
def test_moe_mismatch_trains_a_variant_and_reads_it_back_from_its_report(tmp_path, experiment,
                                                                         monkeypatch):
    mod = experiment("moe_mismatch")
    # its MoE at a quarter of the depth and experts, and 4 x 2 samples a step (4 minibatches of
    # 2): its 2 warm-ups and 4 RL runs, bf16-mixed, took 53 s at full size on a CPU without bf16
    # instructions
    monkeypatch.setattr(mod, "MODEL", mod.MODEL + ["model.num_layers=2", "model.num_experts=4"])
    monkeypatch.setattr(mod, "COMMON", mod.COMMON + ["rollout.prompts_per_step=4",
                                                     "rollout.group_size=2"])
    out, work = tmp_path / "out", tmp_path / "runs"
    argv = ["--steps", "2", "--warmup", "2", "--seeds", "0", "--n-eval", "8", "--eval-every", "1",
            "--work", str(work), "--out", str(out)]
    assert mod.main(argv + ["--only", "gspo"]) == 0
    res = json.loads((out / "moe_mismatch.json").read_text())
    rows = res["grid"]["gspo"]["0"]
    assert rl_steps(rows) == [1, 2] and eval_steps(rows) == [0, 1, 2]
    assert all(res["grid"][name] == {} for name in mod.VARIANTS if name != "gspo")
    assert res["settings"]["steps"] == 2 and res["settings"]["seeds"] == [0]
    # the run dirs gone, --page-only rebuilds the page from the report's rows, training nothing
    shutil.rmtree(work)
    page = out / "moe_mismatch.md"
    page.write_text(page.read_text() + "kept by hand\n")
    assert mod.main(argv + ["--page-only"]) == 0
    assert json.loads((out / "moe_mismatch.json").read_text())["grid"]["gspo"]["0"] == rows
    text = page.read_text()
    assert "| gspo (n=1) |" in text and text.endswith(f"{mod.ANALYSIS}\nkept by hand\n")
    # a sweep point trains on top, on its own seeds (seed 1's warm-up trained for it); a later
    # invocation without it keeps its rows
    assert mod.main(argv + ["--only", "gspo", "--sweep", "optim.lr=1e-3",
                            "--sweep-variants", "grpo", "--sweep-seeds", "0", "1"]) == 0
    sweep = json.loads((out / "moe_mismatch.json").read_text())["sweep"]
    assert list(sweep) == ["optim.lr=1e-3"] and list(sweep["optim.lr=1e-3"]) == ["grpo"]
    assert set(sweep["optim.lr=1e-3"]["grpo"]) == {"0", "1"}
    assert all(rl_steps(r) == [1, 2] for r in sweep["optim.lr=1e-3"]["grpo"].values())
    assert (work / "warm-seed1" / "checkpoints" / "step_000000" / "config.json").is_file()
    work.rename(tmp_path / "kept")  # gone for --page-only; its warm-ups serve --warm-work below
    assert mod.main(argv + ["--page-only"]) == 0
    assert not work.exists()
    (tmp_path / "kept").rename(work)
    res = json.loads((out / "moe_mismatch.json").read_text())
    assert res["sweep"] == sweep and res["grid"]["gspo"]["0"] == rows
    text = page.read_text()
    assert "| `optim.lr=1e-3` | grpo | 0 |" in text and "| `optim.lr=1e-3` | grpo | 1 |" in text
    assert "| `optim.lr=1e-3` | grpo | mean of 2 |" in text
    # other overrides (--extra) on every RL run: a report of their own (--name), from the same
    # warm-ups (--warm-work); the first report is left as it was
    before = (out / "moe_mismatch.json").read_text()
    other = tmp_path / "other"
    assert mod.main(argv + ["--only", "grpo", "--extra", "algorithm.beta=0.01", "--name", "kl",
                            "--work", str(other), "--warm-work", str(work)]) == 0
    assert (work / "warm-seed0" / "checkpoints" / "step_000000" / "config.json").is_file()
    assert not (other / "warm-seed0").exists()
    assert "beta: 0.01" in (other / "grpo-seed0" / "config.yaml").read_text()
    kl = json.loads((out / "kl.json").read_text())
    assert kl["settings"]["extra"] == ["algorithm.beta=0.01"] and set(kl["grid"]["grpo"]) == {"0"}
    assert "on every RL run `algorithm.beta=0.01`" in (out / "kl.md").read_text()
    assert (out / "kl_eval_accuracy.png").is_file()
    assert (out / "moe_mismatch.json").read_text() == before


def test_moe_mismatch_drops_the_rows_of_a_variant_whose_overrides_changed(tmp_path, experiment,
                                                                           monkeypatch):
    mod = experiment("moe_mismatch")
    out = tmp_path
    old = {"settings": {**mod.settings(mod.argparse.Namespace(
        steps=2, warmup=2, mismatch_every=5, n_eval=8, extra=[]), [0])}, "grid": {},
        "sweep": {}}
    old["grid"] = {"gspo": {"0": [{"step": 0}]}, "grpo": {"0": [{"step": 0}]}}
    old["sweep"] = {"optim.lr=1e-3": {"gspo": [{"step": 0}], "grpo": [{"step": 0}]}}
    (out / "moe_mismatch.json").write_text(json.dumps(old))
    args = mod.argparse.Namespace(steps=2, warmup=2, mismatch_every=5, n_eval=8, out=out,
                                  seeds=[0], extra=[], name="moe_mismatch")
    monkeypatch.setitem(mod.VARIANTS, "grpo", mod.VARIANTS["grpo"] + ["algorithm.beta=0.1"])
    # runs with other --extra overrides are not these runs
    assert mod.earlier_report(mod.argparse.Namespace(**{**vars(args), "extra": [
        "rollout.engine=vllm"]})) == {"grid": {}, "sweep": {}}
    kept = mod.earlier_report(args)
    # a report from before sweeps had seeds: its one run per point is its first seed's
    assert set(kept["grid"]) == {"gspo"} and kept["sweep"] == {"optim.lr=1e-3": {"gspo": {
        "0": [{"step": 0}]}}}
    old = json.loads((out / "moe_mismatch.json").read_text())
    old["settings"]["seeds"] = [1, 0]
    (out / "moe_mismatch.json").write_text(json.dumps(old))
    assert mod.earlier_report(args)["sweep"] == {"optim.lr=1e-3": {"gspo": {"1": [{"step": 0}]}}}


@pytest.mark.timeout(90)
def test_async_staleness_trains_its_grid_on_a_tiny_model(tmp_path, experiment):
    mod = experiment("async_staleness")
    out, runs = tmp_path / "out", tmp_path / "runs"
    assert mod.main([*SMOLLM2, "--main-steps", "2", "--sweep-steps", "1", "--seeds", "0",
                     "--staleness", "0", "1", "--eval-every", "1", "--runs", str(runs),
                     "--out", str(out)]) == 0
    res = json.loads((out / "async_staleness.json").read_text())
    assert res["model"] == "tiny-qwen3"
    assert set(res["main"]) == {"gspo-k0-s0", "gspo-k1-s0"}
    assert set(res["sweep"]) == {f"{algo}-k{k}-s0" for algo in ("gspo", "grpo") for k in (0, 1)}
    assert all(len(v["per_step"]["reward/mean"]) == 2 for v in res["main"].values())
    # the sweep is the main runs' first step
    assert all(len(v["per_step"]["reward/mean"]) == 1 for v in res["sweep"].values())
    assert set(res["main"]["gspo-k0-s0"]["per_step"]["rollout/staleness"]) <= {0, None}
    assert all(set(v["evals"]) == {"0", "1", "2"} for v in res["main"].values())
    table = (out / "async_staleness_table.md").read_text()
    assert "| max_staleness | seed |" in table and "| algorithm | max_staleness |" in table
    assert (out / "async_staleness.png").is_file()
    assert not list(runs.rglob("model.safetensors"))  # weights deleted once a run finished
    # the run dirs gone, a rerun trains nothing and reports the same runs from the JSON's rows
    shutil.rmtree(runs)
    assert mod.main([*SMOLLM2, "--main-steps", "2", "--sweep-steps", "1", "--seeds", "0",
                     "--staleness", "0", "1", "--eval-every", "1", "--runs", str(runs),
                     "--out", str(out)]) == 0
    assert not runs.exists()
    assert json.loads((out / "async_staleness.json").read_text()) == res
    assert (out / "async_staleness_table.md").read_text() == table
    # ... but not for runs of other settings
    assert mod.main([*SMOLLM2, "rollout.temperature=0.9", "--report-only", "--seeds", "0",
                     "--staleness", "0", "1", "--runs", str(runs), "--out", str(out)]) == 0
    res = json.loads((out / "async_staleness.json").read_text())
    assert res["main"] == {} and res["sweep"] == {}
    # --gspo-extra changes the GSPO runs only; --name names the report's files
    # (and --sweep-seeds adds the sweep's seeds)
    assert mod.main([*SMOLLM2, "--gspo-extra", "algorithm.eps_low=0.01", "--name", "other",
                     "--main-steps", "1", "--sweep-steps", "1", "--seeds", "0",
                     "--sweep-seeds", "0", "1", "--staleness", "0", "--runs", str(runs),
                     "--out", str(out)]) == 0
    other = json.loads((out / "other.json").read_text())
    assert other["gspo_extra"] == ["algorithm.eps_low=0.01"] and set(other["sweep"]) == {
        f"{algo}-k0-s{seed}" for algo in ("gspo", "grpo") for seed in (0, 1)}
    table = (out / "other_table.md").read_text()
    assert "| grpo | 0 | 1 |" in table and "| grpo | 0 | 2 (0, 1) |" in table
    assert "eps_low: 0.01" in (runs / "gspo-k0-s0" / "config.yaml").read_text()
    assert "eps_low: 0.01" not in (runs / "grpo-k0-s0" / "config.yaml").read_text()
    assert (out / "other_table.md").is_file() and (out / "other.png").is_file()


def test_async_staleness_sweep_means_keep_the_share_of_each_seeds_synchronous_gain(experiment):
    mod = experiment("async_staleness")
    a = mod.argparse.Namespace(sweep_steps=10)
    run = lambda start, end: {"evals": {0: start, 10: end}}  # noqa: E731
    rows = {("gspo", 0, 0): run(0.1, 0.5), ("gspo", 1, 0): run(0.1, 0.3),
            ("gspo", 0, 1): run(0.2, 0.6), ("gspo", 1, 1): run(0.2, 0.5),
            ("grpo", 1, 0): run(0.1, 0.4)}
    means = mod.sweep_means(a, rows)
    acc, kept, n, seeds = means[("gspo", 1)]
    # seed 0 kept (0.3 - 0.1) / (0.5 - 0.1) = 0.5 of its gain, seed 1 (0.5 - 0.2) / 0.4 = 0.75
    assert (acc, kept, n, seeds) == (pytest.approx(0.4), pytest.approx(0.625), 2, [0, 1])
    assert means[("gspo", 0)][1] == pytest.approx(1.0)
    assert means[("grpo", 1)][1] is None  # no synchronous run of its seed to compare with


@pytest.mark.timeout(90)
def test_engine_likelihoods_trains_each_variant_on_a_tiny_model(tmp_path, experiment):
    mod = experiment("engine_likelihoods")
    out = tmp_path / "out"
    argv = [*SMOLLM2, "--steps", "2", "--runs", str(tmp_path / "runs"), "--out", str(out)]
    assert mod.main(argv) == 0
    res = json.loads((out / "engine_likelihoods.json").read_text())
    assert list(res) == [f"{v}|s0" for v in mod.VARIANTS]
    assert all(set(v["evals"]) == {"0", "2"} for v in res.values())
    page = (out / "engine_likelihoods.md").read_text()
    assert f"Made by `experiments/engine_likelihoods.py {' '.join(argv)}`" in page
    assert all(f"| {v} | 0 |" in page for v in mod.VARIANTS)
    assert (out / "engine_likelihoods.png").is_file()
    # the same finished runs reported under another name (a vLLM run's report sits beside)
    assert mod.main(argv + ["--report-only", "--name", "other"]) == 0
    assert json.loads((out / "other.json").read_text()) == res
    assert (out / "other.md").is_file() and (out / "other.png").is_file()


@pytest.mark.timeout(90)
def test_smollm2_gspo_vs_grpo_trains_both_on_a_tiny_model(tmp_path, experiment):
    mod = experiment("smollm2_gspo_vs_grpo")
    out = tmp_path / "out"
    assert mod.main([*SMOLLM2, "--steps", "2", "--seeds", "0", "--runs", str(tmp_path / "runs"),
                     "--out", str(out)]) == 0
    res = json.loads((out / "smollm2_gspo_vs_grpo.json").read_text())
    assert set(res) == {"gspo-s0", "grpo-s0"}
    assert all(set(v["evals"]) == {"0", "2"} for v in res.values())
    table = (out / "smollm2_gspo_vs_grpo_table.md").read_text()
    assert "| **gspo mean** | 1 seeds |" in table and "| **grpo mean** | 1 seeds |" in table
    assert all((out / f"smollm2_{key.replace('/', '_')}.png").is_file() for key, _ in mod.PLOTS)


@pytest.mark.timeout(90)
def test_smollm2_tuned_until_is_the_next_occurrence_of_its_time(experiment):
    mod = experiment("smollm2_tuned")
    utc = mod.dt.timezone.utc
    at_2250 = mod.dt.datetime(2026, 12, 6, 22, 50, 30, tzinfo=utc)
    assert mod.deadline("23:30", at_2250) == mod.dt.datetime(2026, 12, 6, 23, 30, tzinfo=utc)
    assert mod.deadline("01:00", at_2250) == mod.dt.datetime(2026, 12, 7, 1, 0, tzinfo=utc)
    assert mod.deadline("22:50", at_2250) == mod.dt.datetime(2026, 12, 7, 22, 50, tzinfo=utc)
    assert mod.deadline(None, at_2250) is None


def test_smollm2_tuned_trains_the_lr_sweep_and_a_probe_on_a_tiny_model(tmp_path, experiment):
    mod = experiment("smollm2_tuned")
    out, runs = tmp_path / "out", tmp_path / "runs"
    sweep = [f"gspo-lr{lr:g}-s0" for lr in mod.SWEEP_LRS]
    probe = "gspo-lr5e-06-float16-probe-s0"
    assert mod.main([*SMOLLM2, "--steps", "1", "--eval-every", "1", "--only", *sweep, probe,
                     "--runs", str(runs), "--out", str(out)]) == 0
    res = json.loads((out / "smollm2_tuned.json").read_text())
    assert res["model"] == "tiny-qwen3"
    # SmolLM2's earlier runs (REUSED) are not the tiny model's: every run is trained here
    assert set(res["runs"]) == {*sweep, probe}
    assert all(v["run"]["source"] == "this script" and v["steps"] == 1
               for v in res["runs"].values())
    assert [v["run"]["lr"] for v in (res["runs"][n] for n in sweep)] == list(mod.SWEEP_LRS)
    assert all(set(res["runs"][n]["evals"]) == {"0", "1"} for n in sweep)
    assert res["runs"][probe]["evals"] == {} and res["runs"][probe]["run"]["sampler"] == "float16"
    page = (out / "smollm2_tuned.md").read_text()
    assert mod.TABLE_START in page and mod.TABLE_END in page
    assert "| gspo | " in page and "| grpo | " not in page  # a best lr for GSPO only
    assert all((out / f"smollm2_tuned_{g}.png").is_file()
               for g in ("lr", "precision", "clip_minibatches", "minibatches_best_lr"))
    assert not list(runs.rglob("model.safetensors"))
