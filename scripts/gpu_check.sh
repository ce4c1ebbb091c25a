#!/usr/bin/env bash
# One prepared check for a GPU machine with vLLM already installed (`pip install -e '.[vllm]'`),
# in two parts that each finish within the device runner's 600 s per command:
#   tests  the GPU-training tests (CPU == GPU update; FSDP2 / DDP on 2 GPUs), then
#          tests/test_vllm_engine.py on the GPU build: pushed weights, R3 routing, sleep mode,
#          and with 2 GPUs one engine per rank under torchrun (TP 1 and 2, DDP, FSDP2, SIGTERM
#          and resume); caps 150 s + 400 s
#   steps  a few GSPO steps with each rollout engine (hf, vllm) on a small Qwen3 built locally,
#          printing the train/inference mismatch and the step times; cap 380 s
#   bash scripts/gpu_check.sh [tests|steps|all]   (default all; set PYTHON=... to choose python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
PART=${1:-all}
"$PY" -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name(), \
'x', torch.cuda.device_count())"
if [[ $PART == tests || $PART == all ]]; then
  timeout 150 "$PY" -m pytest -q -m gpu tests/test_gpu_training.py
  timeout 400 "$PY" -m pytest -q -m "not slow" tests/test_vllm_engine.py
fi
[[ $PART == steps || $PART == all ]] || exit 0
timeout 380 "$PY" - <<'PYEOF'
import tempfile, time
from pathlib import Path
from gspo import close_run, load_config, prepare, rl_step

BASE = ["model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=2", "model.num_layers=4",
        "model.intermediate_size=1024", "warmup.steps=100", "train.eval_every=0",
        "train.progress=false", "train.tensorboard=false", "rollout.max_new_tokens=16",
        "algorithm.mismatch_every=1"]
RUNS = {
    "hf fp32, recompute": ["rollout.engine=hf"],
    "hf bf16-mixed, recompute": ["rollout.engine=hf", "train.precision=bf16-mixed"],
    "vllm fp32, rollout logp": ["rollout.engine=vllm", "rollout.dtype=float32",
                                "algorithm.old_logprobs=rollout"],
    "vllm bf16, rollout logp": ["rollout.engine=vllm", "rollout.dtype=bfloat16",
                                "algorithm.old_logprobs=rollout"],
}
for name, extra in RUNS.items():
    cfg = load_config(overrides=BASE + extra)
    with tempfile.TemporaryDirectory() as d:
        run = prepare(cfg, Path(d), resume=False)
        try:
            for step in range(4):
                t0 = time.perf_counter()
                row = rl_step(run, step)
                print(f"{name:<26} step {step}: {time.perf_counter() - t0:6.2f}s  "
                      f"rollout {row['time/rollout_s']:.2f}s  update {row['time/update_s']:.2f}s  reward {row['reward/mean']:.3f}  "
                      f"|dlogp| {row.get('mismatch/token_abs_mean', float('nan')):.2e}  "
                      f"max seq log-ratio {row.get('mismatch/seq_log_ratio_abs_max', float('nan')):.2e}",
                      flush=True)
        finally:
            close_run(run)  # a vLLM engine's process-wide state, before the next run's
PYEOF
