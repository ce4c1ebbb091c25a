"""Per-token log-probs at the Qwen3 vocabulary: gspo's chunked path against the naive one.

    python benchmarks/logprobs.py [--vocab 151936] [--lengths 1024,2048,4096] [--hidden-size 256]

For T positions with hidden states (T, H) and an output embedding (V, H), both compute
log softmax(h W^T)_y at the targets y and backpropagate a weighted sum of them into h and W
(the training use; `--no-grad` times the forward alone, the pi_old use):

    naive  F.linear(h, W).log_softmax(-1).gather(-1, y)          (T, V) logits, kept for backward
    gspo   gspo.models.logprobs_from_hidden(h, W, y, chunk_size)  one (chunk, V) block at a time

Each (method, T) runs in a fresh process, so its peak is its own: "peak MB" is the process's
peak resident memory minus its resident memory just before the call (inputs, W and its gradient
buffer already allocated), i.e. what the log-prob computation itself adds. The hidden size only
scales the GEMMs (time), not the (T, V) blocks (memory); 256 keeps the naive T = 4096 run near a
minute on 2 cores.
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
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--lengths", default="1024,2048,4096", help="comma-separated T")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=1024, help="gspo's positions per chunk "
                   "(model.logprob_chunk_size)")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per process")
    p.add_argument("--no-grad", action="store_true", help="time the forward alone")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--worker", choices=["naive", "gspo"], help=argparse.SUPPRESS)
    p.add_argument("--T", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(a) -> dict:
    import torch
    import torch.nn.functional as F

    from gspo.logprobs import logprobs_from_hidden

    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    grad = not a.no_grad
    hidden = (torch.randn(a.T, a.hidden_size, generator=g) * 0.5).requires_grad_(grad)  # (T, H)
    weight = (torch.randn(a.vocab, a.hidden_size, generator=g) * 0.05).requires_grad_(grad)
    targets = torch.randint(0, a.vocab, (a.T,), generator=g)
    w = torch.randn(a.T, generator=g)
    if grad:  # the gradient buffers exist before the call, as in training
        weight.grad, hidden.grad = torch.zeros_like(weight), torch.zeros_like(hidden)

    def naive():
        logp = F.linear(hidden, weight).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
        return logp

    def ours():
        return logprobs_from_hidden(hidden[None], weight, targets[None],
                                    chunk_size=a.chunk_size)[0]

    fn = naive if a.worker == "naive" else ours
    times, out = [], None
    base = common.current_rss_mb()
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        with torch.set_grad_enabled(grad):
            out = fn()
            if grad:
                (out * w).sum().backward()
        times.append(time.perf_counter() - t0)
    peak = common.peak_rss_mb() - base
    return {"seconds": min(times), "peak_mb": peak, "checksum": float(out.detach().double().sum()),
            "grad_checksum": float(weight.grad.double().abs().sum()) if grad else 0.0}


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        common.emit(worker(a))
        return 0
    lengths = [int(x) for x in a.lengths.split(",")]
    passthrough = ["--vocab", str(a.vocab), "--hidden-size", str(a.hidden_size), "--chunk-size",
                   str(a.chunk_size), "--repeats", str(a.repeats), "--threads", str(a.threads),
                   *(["--no-grad"] if a.no_grad else [])]
    rows = []
    for T in lengths:
        res = {}
        for method in ("gspo", "naive"):  # alternating, T by T
            res[method] = common.run_worker(__file__, [*passthrough, "--worker", method, "--T", str(T)])
            print(f"T={T} {method}: {res[method]['seconds']:.2f}s, "
                  f"{res[method]['peak_mb']:.0f} MB", file=sys.stderr, flush=True)
        ours, naive = res["gspo"], res["naive"]
        same = abs(ours["checksum"] - naive["checksum"]) <= 1e-3 * max(1.0, abs(naive["checksum"]))
        rows.append({"T": T, "naive_mb": naive["peak_mb"], "gspo_mb": ours["peak_mb"],
                     "mem_ratio": ours["peak_mb"] / naive["peak_mb"],
                     "naive_s": naive["seconds"], "gspo_s": ours["seconds"],
                     "time_ratio": ours["seconds"] / naive["seconds"],
                     "same": "yes" if same else "NO"})
    mode = "forward only" if a.no_grad else "forward + backward"
    print(f"\nlogprobs: V = {a.vocab}, H = {a.hidden_size}, {mode}, gspo chunk = {a.chunk_size} "
          f"positions, float32\n")
    print(common.table(rows, [("T", "T", "d"), ("naive_mb", "naive peak MB", ".0f"),
                              ("gspo_mb", "gspo peak MB", ".0f"),
                              ("mem_ratio", "gspo / naive memory", ".3f"),
                              ("naive_s", "naive s", ".2f"), ("gspo_s", "gspo s", ".2f"),
                              ("time_ratio", "gspo / naive time", ".2f"),
                              ("same", "same logp sum", "")]))
    common.write_json(a.json, {"args": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
