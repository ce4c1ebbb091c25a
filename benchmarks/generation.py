"""The `hf` rollout engine against transformers' `model.generate`: generated tokens per second.

    python benchmarks/generation.py [--prompts 16] [--group-size 8] [--max-new-tokens 32] ...

Both sample the same tiny Qwen3 (built locally, float32), the same left-padded arithmetic
prompts, G samples per prompt (`num_return_sequences=G` for generate, which repeats each prompt
G times before its prefill), temperature and top-p as given, top-k off, stop at eos. The two
alternate `--repeats` times in one process; the table shows the median tokens/s of each and
their ratio. Generated tokens count every response token up to and including eos.

With `--vllm` (run it with `.venv-vllm/bin/python`, `bash scripts/setup.sh --vllm`), the vLLM
engine (`rollout.engine=vllm`, in this process, eager on the CPU) samples the same prompts from
the same weights too, in `--vllm-dtype` (float32 by default: the others sample in float32;
bfloat16 measures what `rollout.dtype=bfloat16` costs or saves on this CPU); `--model DIR` takes a
Hugging Face model directory instead of the tiny Qwen3 (e.g. `$(gspo fetch-model
smollm2-135m-instruct)`).

Also timed: the engine's plain loop (`HFEngine(fast=False)`: one transformers forward per step
over all rows with a DynamicCache), so the table separates the engine's fast path from the
sampler it shares with the plain loop.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    common.add_model_args(p)
    p.add_argument("--model", help="a Hugging Face model directory (default: the tiny Qwen3)")
    p.add_argument("--vllm", action="store_true", help="also time the vLLM engine")
    p.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the dtype vLLM samples in (rollout.dtype)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from gspo.data import encode_prompts
    from gspo.engines import SamplingParams, left_pad, make_engine, stop_token_ids
    from gspo.engines.hf import HFEngine
    from gspo.models import build_tiny_qwen3, build_tokenizer, load_model
    from gspo.tasks.arithmetic import make_splits

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.model:
        model, tokenizer = load_model(a.model)
        model.eval()
    else:
        tokenizer = build_tokenizer()
        model = build_tiny_qwen3(tokenizer, hidden_size=a.hidden_size, num_layers=a.num_layers,
                                 num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                                 intermediate_size=a.intermediate_size).eval()
    rows, _ = make_splits(max(a.prompts, 1), 1)
    prompts = encode_prompts(tokenizer, rows[: a.prompts])
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    params = SamplingParams(a.temperature, a.top_p, a.max_new_tokens)
    eos, pad = stop_token_ids(model, tokenizer), tokenizer.pad_token_id

    def run_engine(engine, seed):
        r = engine.generate(prompts, a.group_size, params, seed=seed)
        return int(r.response_mask.sum())

    def run_generate(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=a.temperature > 0,
                                 temperature=a.temperature or None, top_p=a.top_p, top_k=0,
                                 num_return_sequences=a.group_size,
                                 max_new_tokens=a.max_new_tokens, eos_token_id=eos,
                                 pad_token_id=pad)
        resp = out[:, ids.shape[1]:]  # (B, T)
        is_eos = torch.isin(resp, torch.tensor(eos))
        done = is_eos.cumsum(-1)  # tokens after the first eos have done > 0 before them
        return int(((done - is_eos.long()) == 0).sum())

    hf = HFEngine(model, eos_token_ids=eos, pad_token_id=pad)
    systems = {"hf engine": lambda s: run_engine(hf, s),
               "hf engine, plain loop": lambda s: run_engine(
                   HFEngine(model, eos_token_ids=eos, pad_token_id=pad, fast=False), s)}
    if a.vllm:
        t0 = time.perf_counter()
        vllm_engine = make_engine("vllm", model, tokenizer, dtype=a.vllm_dtype)
        print(f"vLLM engine started in {time.perf_counter() - t0:.1f} s")
        systems[f"vllm engine ({a.vllm_dtype})"] = lambda s: run_engine(vllm_engine, s)
    systems["model.generate"] = run_generate
    samples: dict[str, list[tuple[int, float]]] = {k: [] for k in systems}
    for name, fn in systems.items():  # warm-up: first calls allocate and pick kernels
        fn(10_000)
    for rep in range(a.repeats):
        for name, fn in systems.items():
            t0 = time.perf_counter()
            n = fn(rep)
            samples[name].append((n, time.perf_counter() - t0))
    rows_out = []
    for name, runs in samples.items():
        rates = [n / s for n, s in runs]
        rows_out.append({"system": name, "tokens_per_s": common.median(rates),
                         "tokens": common.median([n for n, _ in runs]),
                         "seconds": common.median([s for _, s in runs])})
    base = rows_out[-1]["tokens_per_s"]
    for r in rows_out:
        r["ratio"] = r["tokens_per_s"] / base
    if a.vllm:
        vllm_engine.close()
    name = a.model or f"tiny Qwen3 hidden {a.hidden_size} x {a.num_layers} layers"
    print(f"generation: {name}, "
          f"{a.prompts} prompts x G {a.group_size}, {a.max_new_tokens} new tokens, "
          f"temperature {a.temperature}, top-p {a.top_p}, {torch.get_num_threads()} threads, "
          f"median of {a.repeats} alternating runs\n")
    print(common.table(rows_out, [("system", "system", ""), ("tokens_per_s", "tokens/s", ".0f"),
                                  ("ratio", "vs model.generate", ".2f"),
                                  ("tokens", "tokens / call", ".0f"),
                                  ("seconds", "s / call", ".3f")]))
    common.write_json(a.json, {"args": vars(a), "rows": rows_out, "samples": samples})
    return 0


if __name__ == "__main__":
    sys.exit(main())
