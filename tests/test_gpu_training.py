"""Training on a GPU (train.device=cuda): the same update as on the CPU, and a short
end-to-end run, 1 process and 2 processes (NCCL, FSDP2 and DDP) where enough GPUs exist.
Skipped without CUDA; scripts/gpu_check.sh runs these on a lent GPU machine."""

import pytest
import torch

from test_distributed import MODEL, WORKER, torchrun

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]
BATCH = MODEL + ["algorithm=gspo", "rollout.prompts_per_step=4", "rollout.group_size=4",
                 "algorithm.minibatches=1"]


def test_update_on_the_gpu_equals_the_cpu_update(tmp_path):
    torchrun(1, str(WORKER), str(tmp_path / "cpu.pt"), *BATCH, "train.device=cpu")
    torchrun(1, str(WORKER), str(tmp_path / "gpu.pt"), *BATCH, "train.device=cuda")
    cpu, gpu = torch.load(tmp_path / "cpu.pt"), torch.load(tmp_path / "gpu.pt")
    for k, v in cpu["grads"].items():
        torch.testing.assert_close(gpu["grads"][k].cpu(), v, rtol=1e-3, atol=1e-6, msg=k)


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_gpus_give_the_single_process_update(tmp_path, mode):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torchrun(1, str(WORKER), str(tmp_path / "one.pt"), *BATCH, "train.device=cuda")
    torchrun(2, str(WORKER), str(tmp_path / "two.pt"), *BATCH, "train.device=cuda",
             "algorithm.micro_batch_size=2", f"train.data_parallel={mode}")
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for k, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][k], g, rtol=1e-3, atol=1e-6, msg=k)


def test_gspo_train_on_the_gpu_runs_and_checkpoints(tmp_path):
    from transformers import AutoModelForCausalLM
    run_dir = tmp_path / "run"
    torchrun(1, "-m", "gspo", "train", "--output-dir", str(run_dir), *MODEL,
             "rollout.prompts_per_step=4", "rollout.group_size=4", "train.steps=2",
             "train.eval_every=1", "train.eval_k=2", "train.device=cuda")
    AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_000002")
    torchrun(1, "-m", "gspo", "train", "--resume", str(run_dir), "train.steps=3",
             "train.device=cpu")  # a GPU checkpoint resumes on the CPU
