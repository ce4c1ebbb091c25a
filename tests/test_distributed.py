"""Data parallelism under torchrun with gloo on CPU: N ranks x M micro-batches must give the
same update as one process with the whole batch; end-to-end runs and resume across world size."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo.logger import read_metrics

WORKER = Path(__file__).with_name("dist_update_worker.py")
MODEL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64", "data.n_train=200", "data.n_eval=8", "warmup.steps=2",
         "warmup.batch_size=4", "train.progress=false", "train.tensorboard=false"]


def torchrun(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *args] if nproc > 1 else [sys.executable, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.parametrize("aggregation", [["algorithm=gspo"],
                                         ["algorithm=grpo", "algorithm.aggregation=token-mean"]])
def test_two_ranks_give_the_single_process_update(tmp_path, aggregation):
    # 16 sequences, one optimiser step; 2 ranks x 4 micro-batches of 2 vs 1 process x 1 batch
    common = MODEL + aggregation + ["rollout.prompts_per_step=4", "rollout.group_size=4",
                                    "algorithm.minibatches=1"]
    torchrun(1, str(WORKER), str(tmp_path / "one.pt"), *common)
    torchrun(2, str(WORKER), str(tmp_path / "two.pt"), *common, "algorithm.micro_batch_size=2")
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for k, v in one["params"].items():
        torch.testing.assert_close(two["params"][k], v, rtol=0, atol=1e-5, msg=k)
    # Adam's first step barely depends on the gradient's scale: compare the gradients too
    for k, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][k], g, rtol=1e-4, atol=1e-7, msg=k)
    for k in ("loss", "clip_frac", "ratio_mean", "ratio_min", "ratio_max", "kl_old", "grad_norm"):
        assert two["metrics"][k] == pytest.approx(one["metrics"][k], abs=1e-5), k
    assert one["metrics"]["grad_norm"] > 0


def test_two_process_train_then_resume_on_one(tmp_path):
    run_dir = tmp_path / "run"
    args = MODEL + ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
                    "train.steps=2", "train.eval_every=1", "train.eval_k=2", "train.save_every=1"]
    torchrun(2, "-m", "gspo", "train", "--output-dir", str(run_dir), *args)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]  # rank 0 alone writes, once per step
    ckpt = run_dir / "checkpoints" / "step_000002"
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(ckpt)  # the same Hugging Face format as 1 process
    # resume the 2-rank run in a single process
    torchrun(1, "-m", "gspo", "train", "--resume", str(run_dir), "train.steps=3")
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]


def test_prompts_not_divisible_by_ranks_is_a_clear_error(tmp_path):
    env_args = MODEL + ["rollout.prompts_per_step=3", "rollout.group_size=4",
                        "algorithm.minibatches=1", "train.steps=1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "gspo", "train", "--output-dir", str(tmp_path / "r"), *env_args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0 and "divisible by the 2 ranks" in out.stderr
