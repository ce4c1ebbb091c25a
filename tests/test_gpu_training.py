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


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_on_the_gpu_agrees_with_the_float32_cpu_gradient(tmp_path, precision):
    # autocast on CUDA (tensor cores), float32 master weights: the gradient of the float32 CPU
    # run within bf16's rounding (cosine), the weights still float32
    torchrun(1, str(WORKER), str(tmp_path / "cpu.pt"), *BATCH, "train.device=cpu")
    torchrun(1, str(WORKER), str(tmp_path / "gpu.pt"), *BATCH, "train.device=cuda",
             f"train.precision={precision}")
    cpu, gpu = torch.load(tmp_path / "cpu.pt"), torch.load(tmp_path / "gpu.pt")
    flat = lambda d: torch.cat([d[k].flatten().double().cpu() for k in sorted(d)])  # noqa: E731
    a, b = flat(cpu["grads"]), flat(gpu["grads"])
    assert float(a @ b / (a.norm() * b.norm())) > 0.999
    assert all(v.dtype == torch.float32 for v in gpu["params"].values())


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_gpus_in_bf16_mixed_agree_with_one(tmp_path, mode):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    common = [*BATCH, "train.device=cuda", "train.precision=bf16-mixed"]
    torchrun(1, str(WORKER), str(tmp_path / "one.pt"), *common)
    torchrun(2, str(WORKER), str(tmp_path / "two.pt"), *common, "algorithm.micro_batch_size=2",
             f"train.data_parallel={mode}")  # FSDP2: MixedPrecisionPolicy(bf16, reduce fp32)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    flat = lambda d: torch.cat([d[k].flatten().double().cpu() for k in sorted(d)])  # noqa: E731
    a, b = flat(one["grads"]), flat(two["grads"])
    assert float(a @ b / (a.norm() * b.norm())) > 0.999


def test_gspo_train_on_the_gpu_runs_and_checkpoints(tmp_path):
    from transformers import AutoModelForCausalLM
    run_dir = tmp_path / "run"
    torchrun(1, "-m", "gspo", "train", "--output-dir", str(run_dir), *MODEL,
             "rollout.prompts_per_step=4", "rollout.group_size=4", "train.steps=2",
             "train.eval_every=1", "train.eval_k=2", "train.device=cuda")
    AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_000002")
    torchrun(1, "-m", "gspo", "train", "--resume", str(run_dir), "train.steps=3",
             "train.device=cpu")  # a GPU checkpoint resumes on the CPU
