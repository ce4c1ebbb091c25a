import subprocess
import sys

from gspo.logger import read_metrics


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "gspo", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_train_help_lists_config_fields():
    out = run_cli("train", "--help")
    assert out.returncode == 0
    for key in ("algorithm.name", "algorithm.eps_low", "rollout.group_size", "optim.lr",
                "warmup.steps", "train.eval_every"):
        assert key in out.stdout


def test_cli_train_runs_and_prints_a_summary(tmp_path, tiny_overrides):
    out = run_cli("train", "--output-dir", str(tmp_path / "run"), *tiny_overrides)
    assert out.returncode == 0, out.stderr
    assert "held-out accuracy after RL" in out.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]


def test_config_error_exits_2_with_one_line_and_no_traceback(tmp_path):
    out = run_cli("train", "--output-dir", str(tmp_path / "run"), "optim.lrr=1")
    assert out.returncode == 2
    assert "unknown config key 'optim.lrr'" in out.stderr
    assert "Traceback" not in out.stderr


def test_missing_model_exits_2_naming_the_path(tmp_path):
    out = run_cli("train", "--output-dir", str(tmp_path / "run"),
                  f"model.name_or_path={tmp_path}/missing-model")
    assert out.returncode == 2 and "missing-model" in out.stderr
    assert "Traceback" not in out.stderr


def test_fetch_model_of_an_unknown_name_exits_2_listing_the_known_ones():
    out = run_cli("fetch-model", "smollm2-999m")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("gspo: error: unknown pretrained model 'smollm2-999m'; known: "
                                 "smollm2-135m-instruct")


def test_plot_writes_pngs(tmp_path, tiny_overrides):
    assert run_cli("train", "--output-dir", str(tmp_path / "run"), *tiny_overrides).returncode == 0
    out = run_cli("plot", str(tmp_path / "run"), "--out", str(tmp_path / "plots"))
    assert out.returncode == 0, out.stderr
    pngs = list((tmp_path / "plots").glob("*.png"))
    assert pngs and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_resume_skips_a_damaged_latest_checkpoint_and_says_so(tmp_path, tiny_overrides):
    run = tmp_path / "run"
    assert run_cli("train", "--output-dir", str(run), *tiny_overrides).returncode == 0
    weights = run / "checkpoints" / "step_000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, as by a full disk or a crash
    out = run_cli("train", "--resume", str(run))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step_000002 is damaged (model.safetensors has 100 bytes where" in out.stderr
    assert "resuming from step_000001, the newest intact checkpoint" in out.stderr
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]  # step 2 trained again, once
