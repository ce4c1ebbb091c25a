"""gspo against TRL's GRPOTrainer running GSPO, side by side on the same work.

    python benchmarks/vs_trl.py [--steps 4] [--repeats 3] [--max-new-tokens 8] [--threads 1] ...
    python benchmarks/vs_trl.py --model smollm2-135m-instruct --max-new-tokens 128 ...

One tiny Qwen3 model, its tokenizer and the arithmetic prompt set are built once and saved to a
temporary directory (or, with `--model`, a real model is taken as it is, on the task of the
recipe examples/configs/smollm2_addition.yaml: 2-digit sums asked in \\boxed{}, scored by
math-verify on both sides); each system then trains from those exact weights in a fresh
subprocess, the runs alternating gspo, trl, gspo-rollout-logp, gspo, trl, ... so that all see the
same background load and ru_maxrss is a per-system peak. The parent prints, per system and as
ratios to TRL: completions per second end to end (completions generated / wall time of all RL
steps, from each trainer's on_train_begin callback, the model, engine and optimiser built, to
its step-end callback of the last step), the median wall time per RL step (between step-end
callbacks), generated tokens, FLOPs per RL step (one extra run per system under
torch.utils.flop_counter.FlopCounterMode: every matmul and attention kernel, forward and
backward) and the rate they run at, and peak RSS (gspo's read at its last step's end).

Matched settings. TRL: GRPOConfig(importance_sampling_level="sequence", loss_type="grpo",
beta=0, epsilon=3e-4, epsilon_high=4e-4, num_generations=G, per_device_train_batch_size=B/4,
steps_per_generation=4, gradient_accumulation_steps=1, num_iterations=1) so that, like gspo's
algorithm.minibatches=4, one rollout batch of B = prompts * G completions feeds 4 optimiser
steps, and pi_old is recomputed by a no-grad forward (TRL does so because
gradient_accumulation_steps % steps_per_generation != 0). TRL's defaults that would differ
are set explicitly: bf16=False (`--bf16`: True, and gspo train.precision=bf16-mixed),
gradient_checkpointing=False, lr_scheduler_type="constant",
warmup 0, max_grad_norm 1.0, AdamW betas (0.9, 0.999), weight decay 0, top_k=0, use_cpu=True,
no logging, saving or evaluation. gspo: warmup.steps=0, train.eval_every=0, no checkpoint but
the final one, which train() writes after the last step's mark and peak RSS reading, so that no
figure includes it (TRL saves nothing). `gspo` recomputes pi_old as TRL does;
`gspo-rollout-logp` sets algorithm.old_logprobs=rollout (mismatch_every=0): the sampler's own
log-probs are pi_old, GSPO's sequence-likelihood shortcut, which TRL has no equivalent of for
its transformers-generate path.

Work that differs and cannot be removed without patching TRL (the FLOP column shows the net):
- gspo computes less for the same result: each distinct prompt is prefilled once per rollout
  and runs through the decoder once per micro-batch, finished rows leave the decode batch, and
  padding columns past the longest response are not computed.
- TRL's fused LM head scores every position of prompt + completion on CPU (its compact path
  is Triton-only); gspo applies the output embedding to response positions only.
- TRL computes token entropies in each training forward; gspo once, in the pi_old pass.
- Completions are sampled, so the generated token counts differ by chance; the table prints
  them, and tokens/s alongside completions/s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="RL steps (rollout batches) per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per system, alternating")
    p.add_argument("--prompts", type=int, default=16, help="prompts per RL step")
    p.add_argument("--group-size", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=8,
                   help="completion length (8: gspo's embedded default)")
    p.add_argument("--minibatches", type=int, default=4, help="optimiser steps per rollout batch")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    common.add_model_args(p)
    p.add_argument("--model", help="a Hugging Face model directory or a `gspo fetch-model` name "
                                   "(e.g. smollm2-135m-instruct) in place of the tiny Qwen3; the "
                                   "task becomes the SmolLM2 recipe's (chat template, math-verify)")
    p.add_argument("--systems", default="gspo,trl,gspo-rollout-logp",
                   help="comma-separated, in alternation order: gspo (pi_old recomputed, as TRL "
                        "does), gspo-rollout-logp (algorithm.old_logprobs=rollout: the sampler's "
                        "log-probs are pi_old, no recompute pass), trl")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0 = default)")
    p.add_argument("--bf16", action="store_true",
                   help="both sides in bf16 mixed precision: gspo train.precision=bf16-mixed "
                        "(its sampler in bf16 too), TRL bf16=True")
    p.add_argument("--no-flops", action="store_true",
                   help="skip the extra run per system that counts FLOPs per RL step")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--count-flops", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["gspo", "gspo-rollout-logp", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


DATA = dict(n_train=2000, n_eval=8, digits=2, operations="+", seed=1234)


# --------------------------------------------------------------------------------------------
# workers: one system, one run, in a fresh process


def task_config(a, overrides: list[str]):
    """The Config both systems read their task from: the recipe's on a real model, else the
    generated arithmetic of DATA on the tiny one."""
    from gspo import load_config

    if a.model:
        return common.recipe_config(a.model_dir, ["model.dtype=float32", *overrides])
    return load_config(overrides=[f"model.name_or_path={a.model_dir}", "model.dtype=float32",
                                  *[f"data.{k}={v}" for k, v in DATA.items()], *overrides])


def gspo_worker(a) -> dict:
    from gspo import Callback, train

    B = a.prompts * a.group_size
    cfg = task_config(a, [
        f"rollout.group_size={a.group_size}", f"rollout.prompts_per_step={a.prompts}",
        f"rollout.max_new_tokens={a.max_new_tokens}", f"rollout.temperature={a.temperature}",
        f"rollout.top_p={a.top_p}",
        "algorithm=gspo", f"algorithm.minibatches={a.minibatches}", "algorithm.beta=0",
        f"optim.lr={a.lr}", "optim.grad_clip=1.0", "optim.weight_decay=0.0",
        "warmup.steps=0", f"train.steps={a.steps}", "train.eval_every=0",
        f"train.save_every={10**9}", "train.progress=false", "train.tensorboard=false",
        f"train.seed={a.seed}", f"train.precision={'bf16-mixed' if a.bf16 else 'fp32'}",
        *(["algorithm.old_logprobs=rollout", "algorithm.mismatch_every=0"]
          if a.worker == "gspo-rollout-logp" else []),
    ])

    class Clock(Callback):  # the marks of trl_worker's Clock, on gspo's side
        def __init__(self):
            self.begin, self.steps, self.tokens, self.peak_rss_mb = 0.0, [], [], 0.0

        def on_train_begin(self, run):
            self.begin = time.perf_counter()

        def on_step_end(self, run, step, metrics):
            self.steps.append(time.perf_counter())
            self.tokens.append(metrics["response/len_mean"] * B)
            self.peak_rss_mb = common.peak_rss_mb()  # before the final checkpoint's write

    clock = Clock()
    with tempfile.TemporaryDirectory() as run_dir:
        train(cfg, Path(run_dir) / "run", callbacks=[clock])
    return {**_result(clock.begin, clock.steps, clock.tokens, B, clock.peak_rss_mb),
            "task": cfg.data.task}


def trl_worker(a) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gspo import build_task, close_reward

    torch.manual_seed(a.seed)
    B = a.prompts * a.group_size
    tokenizer = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    # gspo's own rows and reward function, so that both systems score the same way
    task = task_config(a, []).data
    train_rows, _, reward_fn, _ = build_task(task)
    # Conversational prompts: TRL applies the chat template as gspo's encode_prompts does
    # (add_generation_prompt, no special tokens beyond the template's).
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": r["prompt"]}] for r in train_rows],
        "answer": [r["answer"] for r in train_rows]})
    tokens: list[float] = []

    def reward(completions, completion_ids, answer, **_):
        tokens.append(sum(len(ids) for ids in completion_ids))  # eos included, as gspo counts
        # TRL hands conversational completions over as [{"role": "assistant", "content": ...}]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward_fn(c, answer=x) for c, x in zip(texts, answer)]

    marks: dict[str, list[float]] = {"begin": [], "steps": []}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            marks["begin"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % a.minibatches == 0:  # the last optimiser step of a rollout
                marks["steps"].append(time.perf_counter())

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, seed=a.seed, data_seed=a.seed,
        bf16=a.bf16, fp16=False, gradient_checkpointing=False, torch_compile=False,
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0,
        loss_type="grpo", importance_sampling_level="sequence", beta=0.0,
        epsilon=3e-4, epsilon_high=4e-4, scale_rewards="group",
        num_generations=a.group_size, per_device_train_batch_size=B // a.minibatches,
        gradient_accumulation_steps=1, steps_per_generation=a.minibatches, num_iterations=1,
        max_steps=a.steps * a.minibatches,
        max_completion_length=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
        top_k=0, repetition_penalty=1.0, log_completions=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    close_reward(reward_fn)
    return {**_result(marks["begin"][0], marks["steps"], tokens, B, common.peak_rss_mb()),
            "task": task.task}


def _result(t_start: float, step_ends: list[float], tokens: list[float], B: int,
            peak_rss_mb: float) -> dict:
    bounds = [t_start, *step_ends]
    step_s = [b - a for a, b in zip(bounds, bounds[1:])]
    total = step_ends[-1] - t_start
    return {"completions": B * len(step_ends), "tokens": float(sum(tokens)), "step_tokens": tokens,
            "total_s": total,
            "completions_per_s": B * len(step_ends) / total, "tokens_per_s": sum(tokens) / total,
            "step_s": step_s, "step_s_median": common.median(step_s),
            "peak_rss_mb": peak_rss_mb}


# --------------------------------------------------------------------------------------------
# the parent: build once, alternate, compare


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        if a.threads:
            import torch
            torch.set_num_threads(a.threads)
        work = trl_worker if a.worker == "trl" else gspo_worker
        if not a.count_flops:
            common.emit(work(a))
            return 0
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            work(a)
        common.emit({"gflop_per_step": counter.get_total_flops() / 1e9 / a.steps})
        return 0
    systems = a.systems.split(",")
    if "trl" in systems:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("TRL is not installed: pip install -e '.[bench]'", file=sys.stderr)
            return 2
    passthrough = _strip(argv if argv is not None else sys.argv[1:], {"--json", "--repeats",
                                                                      "--systems"})
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = common.resolve_model(a.model) if a.model else common.save_tiny_model(
            Path(tmp) / "model", a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads,
            a.intermediate_size, seed=a.seed)
        for rep in range(a.repeats):
            for s in systems:
                r = common.run_worker(__file__, [*passthrough, "--worker", s,
                                                 "--model-dir", str(model_dir)])
                runs[s].append(r)
                print(f"run {rep + 1}/{a.repeats} {s}: {r['completions_per_s']:.1f} "
                      f"completions/s, {r['step_s_median']:.3f} s/step, "
                      f"{r['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
        flops = {s: common.run_worker(__file__, [*passthrough, "--worker", s, "--count-flops",
                                                 "--model-dir", str(model_dir)])["gflop_per_step"]
                 for s in systems} if not a.no_flops else {}
    rows = [_summarise(s, runs[s]) for s in systems]
    for r in rows:
        if flops:
            r["gflop_per_step"] = flops[r["system"]]
            r["gflops"] = r["gflop_per_step"] / r["step_s_median"]
    if "trl" in systems:
        y = rows[systems.index("trl")]
        rows += [{"system": f"{x['system']} / trl",
                  **{k: x[k] / y[k] for k in ("completions_per_s", "tokens_per_s", "step_s_median",
                                              "peak_rss_mb", "tokens", "gflop_per_step", "gflops")
                     if k in x}}
                 for x in rows if x["system"] != "trl"]
    B = a.prompts * a.group_size
    name = a.model or f"tiny Qwen3 hidden {a.hidden_size} x {a.num_layers} layers"
    print(f"\nvs_trl: {name}, B = {a.prompts} "
          f"prompts x G {a.group_size} = {B}, {a.max_new_tokens} new tokens, "
          f"{a.minibatches} optimiser steps per rollout, {a.steps} RL steps x {a.repeats} runs "
          f"per system (medians over runs), {a.threads or 'default'} threads\n")
    shown = [r if "/" not in r["system"] else  # ratios: two decimals, the headline in bold
             {k: (f"**{v:.2f}**" if k == "completions_per_s" else
                  f"**{v}**" if k == "system" else f"{v:.2f}") for k, v in r.items()}
             for r in rows]
    print(common.table(shown, [("system", "system", ""),
                              ("completions_per_s", "completions/s", ".2f"),
                              ("tokens_per_s", "gen. tokens/s", ".1f"),
                              ("step_s_median", "s / RL step", ".3f"),
                              ("tokens", "gen. tokens / run", ".0f"),
                              ("gflop_per_step", "GFLOP / RL step", ".2f"),
                              ("gflops", "GFLOP/s", ".1f"),
                              ("peak_rss_mb", "peak RSS MB", ".0f")]))
    common.write_json(a.json, {"args": vars(a), "runs": runs, "flops": flops, "rows": rows})
    return 0


def _strip(argv: list[str], drop: set[str]) -> list[str]:
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        key = x.split("=", 1)[0]
        if key in drop:
            skip = "=" not in x
            continue
        out.append(x)
    return out


def _summarise(system: str, runs: list[dict]) -> dict:
    med = lambda k: common.median([r[k] for r in runs])  # noqa: E731
    return {"system": system, "completions_per_s": med("completions_per_s"),
            "tokens_per_s": med("tokens_per_s"), "step_s_median": med("step_s_median"),
            "tokens": med("tokens"), "peak_rss_mb": med("peak_rss_mb")}


if __name__ == "__main__":
    sys.exit(main())
