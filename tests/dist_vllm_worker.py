"""One rank of a torchrun launch with one vLLM engine per rank (tests/test_vllm_engine.py).

    torchrun --nproc_per_node 2 tests/dist_vllm_worker.py OUT_DIR TENSOR_PARALLEL_SIZE...

For each tensor-parallel size in turn (one launch serves them all: a launch costs each rank a
vLLM import), each rank samples its own prompts with its own seed, checks vLLM's log-probs
against its float32 trainer model before and after a weight push, closes the engine and then
uses the process group once more; it writes what it saw to OUT_DIR/rank{R}-tp{TP}.json.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gspo.engines import SamplingParams, make_engine
from gspo.logprobs import token_logprobs
from gspo.models import build_tiny_qwen3, build_tokenizer


def max_dlogp(model, r) -> float:
    r = r.to(next(model.parameters()).device)
    with torch.no_grad():
        ref = token_logprobs(model, r.input_ids, r.attention_mask, r.response_ids.shape[1])
    return float(((r.logp - ref) * r.response_mask).abs().max())


def main(out: Path, sizes: list[int]) -> None:
    cuda = torch.cuda.is_available()  # one GPU per rank (scripts/gpu_check.sh), else the CPU
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    for tp in sizes:
        seen = one_engine(device, tp)
        (out / f"rank{dist.get_rank()}-tp{tp}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def one_engine(device: torch.device, tp: int) -> dict:
    rank = dist.get_rank()
    tok = build_tokenizer()
    torch.manual_seed(0)  # the same model on every rank, as after the trainer's broadcast
    model = build_tiny_qwen3(tok, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                             intermediate_size=128).to(device)
    engine = make_engine("vllm", model, tok, dtype="float32", seed=0, tensor_parallel_size=tp)
    torch.set_num_threads(2)  # vLLM's CPU worker had made this a no-op
    seen = {"threads": torch.get_num_threads()}
    torch.set_num_threads(1)
    # the same two prompts on both ranks (their seeds differ), and a third on rank 1
    prompts = [tok.encode(t) for t in ("12+34=", "7*8=", "99-1=")][: 2 + rank]
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    r = engine.generate(prompts, n=4, params=params, seed=1000 * rank)
    seen["rows"], seen["before"] = r.response_ids.shape[0], max_dlogp(model, r)
    seen["responses"] = r.response_ids.tolist()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    # a sharded trainer's gather sends the tied embedding once: so does this push
    engine.load_weights((n, t) for n, t in model.state_dict().items() if n != "lm_head.weight")
    seen["after"] = max_dlogp(model, engine.generate(prompts, n=4, params=params, seed=7))
    engine.close()
    alive = torch.ones(1, device=device)
    dist.all_reduce(alive)  # the trainer's group outlived vLLM's teardown
    seen["group_after_close"] = float(alive)
    return seen


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(a) for a in sys.argv[2:]])
