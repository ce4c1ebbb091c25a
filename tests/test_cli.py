import subprocess
import sys

import pytest

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


def test_an_unknown_hub_id_without_network_fails_at_once_naming_it(tmp_path):
    import time

    import pytest

    from gspo.hub import hub_unreachable as _hub_unreachable
    if _hub_unreachable() is None:
        pytest.skip("the hub is reachable from here: transformers reports the missing repo")
    t0 = time.monotonic()
    out = run_cli("train", "--output-dir", str(tmp_path / "run"),
                  "model.name_or_path=no-such-org/no-such-model", "train.steps=1")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "model 'no-such-org/no-such-model' is not a local directory nor in the Hugging Face " \
           "cache, and the hub at " in out.stderr
    assert time.monotonic() - t0 < 60  # no retry loop with back-off (it took 40 s and more)


def test_hf_hub_offline_is_named_in_the_error(monkeypatch):
    import pytest
    from huggingface_hub import constants

    from gspo.models import ModelLoadError, load_model
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="nor in the Hugging Face cache, and HF_HUB_OFFLINE is set"):
        load_model("no-such-org/no-such-model")


def test_a_tiny_model_too_big_for_this_machine_is_refused_before_allocation(tmp_path):
    out = run_cli("train", "--output-dir", str(tmp_path / "run"), "model.hidden_size=65536",
                  "model.intermediate_size=262144", "model.num_heads=512", "model.num_kv_heads=512")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "the tiny model (hidden_size=65536, 2 layers) has " in out.stderr
    assert "GiB available; choose a smaller model" in out.stderr


@pytest.mark.slow  # out of CI: test_bad_inputs checks the same refusals in-process
def test_a_resume_cannot_change_the_model_or_the_algorithm_and_leaves_the_run_as_it_was(
        tmp_path, tiny_overrides):
    run = tmp_path / "run"
    assert run_cli("train", "--output-dir", str(run), *tiny_overrides).returncode == 0
    config = (run / "config.yaml").read_text()
    for change, says in (("model.hidden_size=64", "model.hidden_size=64 (trained with 32)"),
                         ("algorithm=grpo", "algorithm.name=grpo (trained with gspo)")):
        out = run_cli("train", "--resume", str(run), change, "train.steps=3")
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert f"--resume {run} cannot change {says}: start a new run" in out.stderr
        assert (run / "config.yaml").read_text() == config  # not rewritten by the failed start
    out = run_cli("train", "--resume", str(run), "--output-dir", str(tmp_path / "elsewhere"))
    assert out.returncode == 2 and "drop --output-dir" in out.stderr
    assert not (tmp_path / "elsewhere").exists()
    out = run_cli("train", "--resume", str(run), "train.steps=3")  # a plain resume still works
    assert out.returncode == 0, out.stderr[-2000:]
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]


def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path):
    """`gspo eval ... | head` closes stdout's pipe before gspo's last lines: a
    BrokenPipeError traceback (and a second at exit) before; now the status a shell gives a
    pipeline's cut-short writer (128 + SIGPIPE) and nothing on stderr."""
    p = subprocess.Popen([sys.executable, "-m", "gspo", "train", "--dry-run", "--output-dir",
                          str(tmp_path / "run")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # the reader is gone before gspo writes (its imports take longer)
    try:
        err = p.stderr.read()
        assert p.wait(timeout=120) == 141
    finally:
        p.kill()
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    from gspo.cli import main
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"gspo {version('gspo')}\n"  # the installed metadata's
