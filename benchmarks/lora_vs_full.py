"""Full fine-tuning vs LoRA on a real model: step time per phase and peak memory, side by side.

    .venv/bin/python benchmarks/lora_vs_full.py                     # SmolLM2-135M-Instruct, the recipe
    .venv/bin/python benchmarks/lora_vs_full.py --steps 4 --repeats 2 --lora-rank 16

Each run is `gspo train` in a fresh process (so that its peak RSS is its own) on the recipe
examples/configs/smollm2_addition.yaml with evaluation off, alternating full / LoRA `--repeats`
times. Phase times are the medians of the trainer's own per-step timings, the first step left
out (allocator and thread-pool warm-up). Peak RSS is the process's maximum resident set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RECIPE, ROOT, median, table, write_json  # noqa: E402

PHASES = ("time/rollout_s", "time/old_logp_s", "time/update_s")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model.name_or_path")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="OMP threads (0 = torch's default)")
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*", help="more config overrides for both runs")
    return p.parse_args(argv)


def run_once(a, lora: bool, out: Path) -> dict:
    env = dict(os.environ)
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    cmd = [sys.executable, "-m", "gspo", "train", "--config", str(RECIPE), "--output-dir", str(out),
           f"model.name_or_path={a.model}", f"train.steps={a.steps}", "train.eval_every=0",
           "train.save_every=0", "train.progress=false", "train.tensorboard=false",
           f"model.lora_rank={a.lora_rank if lora else 0}", *a.overrides]
    if lora:
        cmd.append("optim.lr=1e-4")  # adapters take a larger step; the FLOPs do not depend on it
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rss = float(re.search(r"peak RSS\s+([\d.]+) MB", proc.stdout).group(1))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r][1:] or [r for r in rows if "loss" in r]
    res = {k: median([r[k] for r in rows]) for k in PHASES}
    res["step_s"] = sum(res[k] for k in PHASES)
    res["peak_rss_mb"] = rss
    return res


def main(argv=None) -> int:
    a = parse(argv)
    results = {"full": [], "lora": []}
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.repeats):
            for kind in ("full", "lora"):
                results[kind].append(run_once(a, kind == "lora", Path(d) / f"{kind}-{i}"))
    keys = ["step_s", *PHASES, "peak_rss_mb"]
    summary = {kind: {k: median([r[k] for r in rs]) for k in keys} for kind, rs in results.items()}
    rows = [{"what": k, "full": summary["full"][k], "lora": summary["lora"][k],
             "ratio": summary["lora"][k] / summary["full"][k]} for k in keys]
    print(f"{a.model}, recipe {RECIPE.name}, {a.steps} steps x {a.repeats}, LoRA rank "
          f"{a.lora_rank} on the default target modules")
    print(table(rows, [("what", "", ""), ("full", "full", ".2f"),
                       ("lora", f"LoRA r={a.lora_rank}", ".2f"), ("ratio", "LoRA / full", ".2f")]))
    if a.json:
        write_json(a.json, {"args": vars(a), "summary": summary, "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
