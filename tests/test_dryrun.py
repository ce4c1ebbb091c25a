"""`gspo train --dry-run` and the recipes in examples/configs/: each recipe loads, resolves and
passes the dry run against a locally built stand-in of its architecture (the same config class
and keys as the real model, tiny sizes)."""

import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from gspo.config import load_config
from gspo.dryrun import dry_run
from gspo.errors import GspoError
from gspo.models import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data"
RECIPES = ROOT / "examples" / "configs"
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)
# the real models' sizes (their config.json on the hub), for the parameter counts
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     max_position_embeddings=32768, tie_word_embeddings=False)
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True)


def run_cli(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "gspo", "train", "--dry-run", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, **(env or {})})


def save_standin(config, path: Path, weights: bool = True) -> Path:
    """A model directory with the character tokenizer (it has a chat template); weights=False
    writes the config alone, as a dry run needs no more."""
    tok = build_tokenizer()
    if weights:
        config.update(dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id))
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    else:
        config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
        config.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    cfg = Qwen3Config(**TINY, max_position_embeddings=40960, tie_word_embeddings=True)
    return save_standin(cfg, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    cfg = Qwen3MoeConfig(**TINY, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=32768, tie_word_embeddings=False)
    return save_standin(cfg, tmp_path_factory.mktemp("qwen3moe"))


# ---------------------------------------------------------------------------------------------
# the recipes

# the recipes read hub datasets; the mini files stand in, with no more prompts per step than
# they hold (the dry run refuses a step that would draw more distinct prompts than there are)
GSM8K = [f"data.path={DATA / 'gsm8k_mini.jsonl'}", f"data.eval_path={DATA / 'gsm8k_mini.jsonl'}",
         "data.subset=", "rollout.prompts_per_step=8"]
RECIPE_RUNS = {
    "qwen3_0.6b_gsm8k_vllm.yaml": ("dense", GSM8K, 1),
    "qwen3_1.7b_gsm8k_vllm.yaml": ("dense", GSM8K, 1),
    "qwen3_30b_a3b_gspo_fsdp8.yaml": ("moe", [f"data.path={DATA / 'math_mini.jsonl'}",
                                              f"data.eval_path={DATA / 'math_mini.jsonl'}",
                                              "rollout.prompts_per_step=8"], 8),
    "qwen3_1.7b_code_lcb_vllm.yaml": ("dense", [f"data.path={DATA / 'code_mini.jsonl'}",
                                                f"data.eval_path={DATA / 'code_mini.jsonl'}",
                                                "rollout.prompts_per_step=4"], 1),
}


def test_every_recipe_is_checked_here():
    recipes = {p.name for p in RECIPES.glob("qwen3_*.yaml")}
    assert recipes == set(RECIPE_RUNS)


@pytest.mark.parametrize("recipe", sorted(RECIPE_RUNS))
def test_a_recipe_passes_the_dry_run_on_a_standin_of_its_architecture(recipe, dense_dir, moe_dir,
                                                                      tmp_path):
    kind, data, world = RECIPE_RUNS[recipe]
    model_dir = {"dense": dense_dir, "moe": moe_dir}[kind]
    out = run_cli("--config", str(RECIPES / recipe), "--world-size", str(world),
                  f"model.name_or_path={model_dir}", *data, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    arch = "Qwen3MoeForCausalLM" if kind == "moe" else "Qwen3ForCausalLM"
    assert f"model       {arch}" in out.stdout
    assert f"launch      {world} rank(s), {'FSDP2' if world > 1 else 'one process'}" in out.stdout
    assert "dry run passed" in out.stdout and "Traceback" not in out.stderr
    cfg = load_config(RECIPES / recipe, [f"model.name_or_path={model_dir}", *data])
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        assert ("checked on this machine: rollout.engine=vllm (the vllm package) not available "
                "here; needed at run time") in out.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_moe_recipe_keeps_the_papers_settings():
    cfg = load_config(RECIPES / "qwen3_30b_a3b_gspo_fsdp8.yaml",
                      [f"data.path={DATA / 'math_mini.jsonl'}",
                       f"data.eval_path={DATA / 'math_mini.jsonl'}"])
    a = cfg.algorithm
    assert (a.name, a.eps_low, a.eps_high, a.minibatches, a.beta, a.routing_replay) == \
        ("gspo", 3e-4, 4e-4, 4, 0.0, False)
    assert cfg.train.data_parallel == "fsdp" and cfg.train.eval_k == 32  # AIME'24 avg@32
    r = cfg.rollout  # vLLM, TP within a node, asleep while the trainer updates
    assert (r.engine, r.tensor_parallel_size, r.vllm_sleep) == ("vllm", 4, True)


def test_the_rollout_copy_is_split_over_the_tensor_parallel_ranks(moe_dir):
    base = [f"model.name_or_path={moe_dir}", "warmup.steps=0", "rollout.engine=vllm",
            "rollout.prompts_per_step=8"]
    one, four = (dry_run(load_config(overrides=base + [f"rollout.tensor_parallel_size={tp}"]),
                         world=8, out=io.StringIO())["memory"]["rollout_copy"] for tp in (1, 4))
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(moe_dir).parameters())
    assert one == n * 4 and four == n  # float32 sampler ('auto' of fp32), a quarter each


# ---------------------------------------------------------------------------------------------
# what the dry run counts


def test_parameters_are_counted_from_the_config_as_the_weights_hold_them(dense_dir, moe_dir):
    for path in (dense_dir, moe_dir):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
        cfg = load_config(overrides=[f"model.name_or_path={path}", "warmup.steps=0"])
        assert dry_run(cfg, out=io.StringIO())["parameters"] == real


@pytest.mark.parametrize("sizes, cls, published", [
    (QWEN3_30B_A3B, Qwen3MoeConfig, 30.5e9),  # Qwen: "30.5B in total, 3.3B activated"
    (QWEN3_0_6B, Qwen3Config, 0.6e9),         # Qwen: "0.6B"
])
def test_the_real_sizes_match_what_qwen_publishes_without_allocating(sizes, cls, published,
                                                                     tmp_path):
    path = save_standin(cls(**sizes), tmp_path / "m", weights=False)  # no weight files at all
    cfg = load_config(overrides=[f"model.name_or_path={path}", "warmup.steps=0",
                                 "train.data_parallel=fsdp", "rollout.prompts_per_step=8",
                                 "rollout.dtype=bfloat16"])
    figures = dry_run(cfg, world=8, out=io.StringIO())
    n = figures["parameters"]
    assert abs(n - published) < 0.05e9
    m = figures["memory"]
    # float32: 4 bytes each for weights and gradients, 8 for AdamW's two moments, over 8 ranks;
    # the rollout engine holds a whole bf16 copy (2 bytes each) on every rank
    assert (m["weights"], m["gradients"], m["adamw"]) == (n * 4 / 8, n * 4 / 8, n * 8 / 8)
    assert m["rollout_copy"] == n * 2


def test_the_kv_cache_is_the_hf_engines_full_length_cache(tmp_path):
    path = save_standin(Qwen3MoeConfig(**QWEN3_30B_A3B), tmp_path / "m", weights=False)
    cfg = load_config(overrides=[f"model.name_or_path={path}", "warmup.steps=0",
                                 "rollout.prompts_per_step=16", "rollout.group_size=16",
                                 "rollout.max_new_tokens=1000", "rollout.dtype=bfloat16"])
    f = dry_run(cfg, world=8, out=io.StringIO())
    # 32 sequences per rank x (prompt + 1000) tokens x K and V x 48 layers x 4 heads x 128 x 2 B
    tokens = 32 * (f["prompt_tokens_max"] + 1000)
    assert f["memory"]["kv_cache"] == tokens * 2 * 48 * 4 * 128 * 2


def test_the_report_names_the_batch_and_the_token_budget(capsys):
    cfg = load_config(overrides=["rollout.prompts_per_step=8", "rollout.group_size=4",
                                 "rollout.max_new_tokens=10", "algorithm.minibatches=2"])
    f = dry_run(cfg, world=2)
    text = capsys.readouterr().out
    assert "rollout     8 prompts x 4 = 32 sequences per step; per rank 4 x 4 = 16; " \
           "2 minibatches of 16 (8 per rank)" in text
    per_seq = f["prompt_tokens_max"] + 10
    assert f"per step <= {32 * per_seq:,} ({16 * per_seq:,} per rank)" in text
    assert "resolved config:\n  model:\n    name_or_path: tiny-qwen3" in text


# ---------------------------------------------------------------------------------------------
# what it refuses, and what it only warns about


def test_every_malformed_row_is_named_in_one_error_line(tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n{"prompt": "c", "answer": "3"}\n'
                   'not json\n{"prompt": "e", "answer": "5"}\n')
    out = run_cli("data.task=math", f"data.path={bad}", "data.n_eval=1", "warmup.steps=0",
                  cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    line, = out.stderr.strip().splitlines()
    assert line.startswith("gspo: error: 2 malformed row(s): ")
    assert f"{bad} row 2: field 'answer' (answer) is missing" in line
    assert f"{bad} row 4: not valid JSON" in line


@pytest.mark.parametrize("overrides, world, env, message", [
    ([], 3, {}, "rollout.prompts_per_step=32 must be divisible by the 3 ranks"),
    (["warmup.batch_size=36"], None, {"WORLD_SIZE": "8"},  # a torchrun launch's world size
     "the warm-up batch (36 = min(warmup.batch_size, training rows)) must be divisible by the "
     "8 ranks"),
    (["rollout.prompts_per_step=2", "rollout.group_size=2"], 2, {},
     "each of the 2 ranks holds 2 rollouts per step, which is not divisible by "
     "algorithm.minibatches=4"),
    (["rollout.engine=vllm", "rollout.tensor_parallel_size=4"], 2, {},
     "rollout.tensor_parallel_size=4 needs rollout.engine=vllm under torchrun with a multiple "
     "of that many ranks per node (here: rollout.engine=vllm, 2 rank(s))"),
    (["rollout.tensor_parallel_size=2"], 2, {}, "here: rollout.engine=hf"),
])
def test_what_does_not_divide_over_the_ranks_is_refused_as_the_run_would(overrides, world, env,
                                                                         message, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(GspoError) as e:
        dry_run(load_config(overrides=overrides), world=world, out=io.StringIO())
    assert message in str(e.value)


@pytest.mark.parametrize("world, env, message", [
    (0, {}, "--world-size 0: a launch has at least 1 rank"),  # was: 1 rank checked, silently
    (-2, {}, "--world-size -2: a launch has at least 1 rank"),
    (0, {"WORLD_SIZE": "8"}, "--world-size 0: a launch has at least 1 rank"),
    (None, {"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not a number of ranks"),
    (None, {"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a number of ranks"),
])
def test_a_world_size_below_one_is_refused(world, env, message, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(GspoError) as e:
        dry_run(load_config(), world=world, out=io.StringIO())
    assert message in str(e.value)


def test_a_reward_that_raises_on_the_sample_is_an_error(tmp_path):
    (tmp_path / "r.py").write_text("def broken(completion, **_):\n    raise KeyError('answr')\n")
    cfg = load_config(overrides=[f"data.reward={tmp_path}/r.py:broken"])
    with pytest.raises(GspoError, match="the reward broken failed on a sample answer .* "
                                        "KeyError: 'answr'"):
        dry_run(cfg, out=io.StringIO())


def test_a_task_without_solutions_and_a_warm_up_is_an_error():
    cfg = load_config(overrides=["data.task=math", f"data.path={DATA / 'math_mini.jsonl'}",
                                 "data.n_eval=2", "rollout.prompts_per_step=8"])
    with pytest.raises(GspoError, match="set warmup.steps=0"):
        dry_run(cfg, out=io.StringIO())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_missing_cuda_device_is_a_warning_not_an_error():
    out = io.StringIO()
    dry_run(load_config(overrides=["train.device=cuda"]), out=out)
    assert ("warning: checked on this machine: train.device=cuda (a CUDA device) not available "
            "here; needed at run time") in out.getvalue()


def test_it_writes_nothing_and_takes_no_lock(tmp_path):
    run = tmp_path / "run"
    out = run_cli("--output-dir", str(run), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_a_directory_with_checkpoints_is_refused_as_the_run_would(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "trainer_state.pt"):  # what makes one whole
        (step / name).write_text("")
    with pytest.raises(GspoError, match="already holds checkpoints; pass --resume"):
        dry_run(load_config(), run_dir=tmp_path / "run", out=io.StringIO())


def test_world_size_without_dry_run_is_refused(tmp_path, monkeypatch, capsys):
    from gspo.cli import main
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--world-size", "2"]) == 2
    assert "--world-size plans a launch for --dry-run" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_train_help_says_what_the_dry_run_only_warns_about():
    from gspo.cli import _train_parser
    text = " ".join(_train_parser().format_help().split())
    assert "--dry-run" in text and "a GPU recipe can be checked on a laptop" in text


def test_the_report_names_the_objective_and_the_switches_that_are_on():
    out = io.StringIO()
    dry_run(load_config(overrides=["algorithm=grpo", "algorithm.overlong=soft_penalty",
                                   "rollout.max_new_tokens=12", "algorithm.is_correction=mask",
                                   "algorithm.is_level=token", "algorithm.is_cap=3"]), out=out)
    line = next(x for x in out.getvalue().splitlines() if x.startswith("objective"))
    assert line == ("objective   grpo, clip [1 - 0.2, 1 + 0.27], seq-mean-token-mean; pi_old "
                    "recompute; is_correction=mask (token, weights in [0, 3]); "
                    "overlong=soft_penalty (-1 over the last 3 tokens)")
    out = io.StringIO()
    dry_run(load_config(), out=out)
    assert "objective   gspo, clip [1 - 0.0003, 1 + 0.0004], seq-mean-token-mean; pi_old " \
           "recompute\n" in out.getvalue()


@pytest.mark.parametrize("overrides, words", [
    (["algorithm.eps_low=0.2", "algorithm.eps_high=0.28"],
     ["algorithm.eps_low=0.2 is 667x gspo's own clip range (0.0003)",
      "algorithm.eps_high=0.28 is 700x gspo's own clip range (0.0004)"]),
    (["algorithm=grpo", "algorithm.eps_high=4e-4"],
     ["algorithm.eps_high=0.0004 is 1/675 of grpo's own clip range (0.27)"]),
    (["algorithm.eps_high=1e-3"], []),  # a few times the paper's: fine
])
def test_a_clip_range_far_from_the_objectives_own_is_warned(overrides, words):
    out = io.StringIO()
    dry_run(load_config(overrides=overrides), out=out)
    warned = [x for x in out.getvalue().splitlines() if x.startswith("warning: algorithm.eps")]
    assert [w.split(":")[1].strip() for w in warned] == words


@pytest.mark.parametrize("overrides, settings", [
    (["train.precision=fp16-mixed"], ["train.precision=fp16-mixed"]),
    (["rollout.dtype=float16"], ["rollout.dtype=float16"]),
    (["train.precision=fp16-mixed", "rollout.dtype=float16"],
     ["train.precision=fp16-mixed", "rollout.dtype=float16"]),
    (["rollout.dtype=bfloat16"], []),
    (["train.precision=fp16-mixed", "train.device=cuda"], []),  # a GPU recipe: fp16 is fast
])
@pytest.mark.parametrize("has_bf16", [True, False])
def test_float16_on_the_cpu_is_warned(monkeypatch, overrides, settings, has_bf16):
    import gspo.preflight
    monkeypatch.setattr(gspo.preflight, "cpu_has_bf16", lambda: has_bf16)
    out = io.StringIO()
    dry_run(load_config(overrides=["train.device=cpu", *overrides]), out=out)
    warned = [x for x in out.getvalue().splitlines() if "on the CPU: most CPUs" in x]
    # bf16 offered only where the CPU has bf16 instructions (else it is slower still)
    fixes = {"train.precision=fp16-mixed": "use train.precision=bf16-mixed or fp32"
             if has_bf16 else "use train.precision=fp32",
             "rollout.dtype=float16": "use rollout.dtype=bfloat16 or float32"
             if has_bf16 else "use rollout.dtype=float32"}
    assert [w.split(" on the CPU")[0] for w in warned] == [f"warning: {s}" for s in settings]
    assert all(w.endswith(fixes[s]) and "2-core AMD EPYC" in w for w, s in zip(warned, settings))


BOTH_FIXES = "train.precision=fp32 rollout.dtype=float32"


@pytest.mark.parametrize("overrides, settings, fix", [
    (["train.precision=bf16-mixed"], "train.precision=bf16-mixed and rollout.dtype=auto (bfloat16)",
     BOTH_FIXES),
    (["train.precision=bf16-mixed", "rollout.dtype=float32"], "train.precision=bf16-mixed",
     "train.precision=fp32"),
    (["train.precision=bf16-true", "rollout.dtype=float32"], "train.precision=bf16-true",
     "train.precision=fp32"),
    (["rollout.dtype=bfloat16"], "rollout.dtype=bfloat16", "rollout.dtype=float32"),
    (["train.precision=bf16-mixed", "rollout.dtype=bfloat16"],
     "train.precision=bf16-mixed and rollout.dtype=bfloat16", BOTH_FIXES),
    ([], None, None),  # float32 throughout
    (["train.precision=bf16-mixed", "train.device=cuda"], None, None),  # a GPU has bf16
])
@pytest.mark.parametrize("has_bf16", [False, True])
def test_bfloat16_on_a_cpu_without_bf16_instructions_is_warned(monkeypatch, overrides, settings,
                                                               fix, has_bf16):
    import gspo.preflight
    monkeypatch.setattr(gspo.preflight, "cpu_has_bf16", lambda: has_bf16)
    out = io.StringIO()
    dry_run(load_config(overrides=["train.device=cpu", *overrides]), out=out)
    warned = [x for x in out.getvalue().splitlines() if "without bf16 instructions" in x]
    if settings is None or has_bf16:
        assert warned == []
    else:
        assert len(warned) == 1 and warned[0].startswith(f"warning: {settings} on a CPU without")
        assert warned[0].endswith(f"; use {fix} on this machine")


def test_vllms_bfloat16_is_warned_about_as_the_hf_engines(monkeypatch):
    # vLLM's CPU backend emulates bf16 too (BF16_SLOW_CPU_MEASURED); on a GPU nothing warns
    import gspo.preflight
    monkeypatch.setattr(gspo.preflight, "cpu_has_bf16", lambda: False)
    for engine in ("vllm", "hf"):
        cfg = load_config(overrides=[f"rollout.engine={engine}", "rollout.dtype=bfloat16"])
        (warned,) = [w for w in gspo.preflight.setting_warnings(cfg, on_cpu=True)
                     if "bf16 instructions" in w]
        assert warned.startswith("rollout.dtype=bfloat16 on a CPU without"), engine
        assert not any("bf16 instructions" in w
                       for w in gspo.preflight.setting_warnings(cfg, on_cpu=False))


def test_engine_log_probs_after_top_p_as_pi_old_are_warned():
    """vLLM returns the log-probs of the top-p truncated distribution (logp_before_top_p is
    False): as pi_old with top_p < 1 they sit above the policy's. The hf engine's are the
    policy's; a recomputed pi_old or top_p=1 is fine."""
    import gspo.preflight

    def warned(*overrides):
        cfg = load_config(overrides=list(overrides))
        return [w for w in gspo.preflight.setting_warnings(cfg) if "top-p truncated" in w]
    (w,) = warned("rollout.engine=vllm", "rollout.top_p=0.9", "algorithm.old_logprobs=rollout")
    assert w.startswith("rollout.top_p=0.9 with algorithm.old_logprobs=rollout: "
                        "rollout.engine=vllm returns")
    assert w.endswith("use algorithm.old_logprobs=recompute or rollout.top_p=1")
    assert not warned("rollout.engine=hf", "rollout.top_p=0.9", "algorithm.old_logprobs=rollout")
    assert not warned("rollout.engine=vllm", "rollout.top_p=0.9")
    assert not warned("rollout.engine=vllm", "algorithm.old_logprobs=rollout")


def test_the_bf16_check_agrees_with_the_cpus_own_flags():
    flags = Path("/proc/cpuinfo")
    if not flags.is_file() or "flags" not in flags.read_text():
        pytest.skip("no x86 /proc/cpuinfo flags to compare with")
    from gspo.preflight import cpu_has_bf16
    have = set(re.search(r"^flags\s*:(.*)$", flags.read_text(), re.M).group(1).split())
    assert cpu_has_bf16() == bool(have & {"avx512_bf16", "amx_bf16"})


def test_the_report_gives_the_worst_case_rollouts_of_filter_groups():
    # 2 ranks, 8 prompts x 4: round 0 and up to 3 extra rounds of at most 4 prompts per rank
    out = io.StringIO()
    dry_run(load_config(overrides=["rollout.prompts_per_step=8", "rollout.group_size=4",
                                   "rollout.filter_groups=true", "rollout.filter_max_rounds=3"]),
            world=2, out=out)
    lines = [x for x in out.getvalue().splitlines() if x.startswith("filter")]
    assert lines == ["filter      rollout.filter_groups: groups whose 4 rewards are all equal are "
                     "dropped and resampled, up to 3 extra rounds; at worst 32 prompts x 4 = 128 "
                     "rollouts sampled per step (64 per rank, in rounds of at most 16), still 32 "
                     "trained"]
    out = io.StringIO()
    dry_run(load_config(), out=out)
    assert "\nfilter " not in out.getvalue()


def test_the_report_says_how_a_minibatch_is_cut_into_forwards():
    base = ["rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.max_new_tokens=10",
            "algorithm.minibatches=2"]
    out = io.StringIO()
    f = dry_run(load_config(overrides=base + ["algorithm.micro_batch_size=4"]), out=out)
    per_seq = f["prompt_tokens_max"] + 10
    assert (f"micro       4 sequences per forward/backward (algorithm.micro_batch_size), "
            f"<= {4 * per_seq:,} tokens each\n") in out.getvalue()
    # a budget of three full-length sequences, or of 16 (the minibatch) one-token ones
    out = io.StringIO()
    budget = 3 * per_seq
    dry_run(load_config(overrides=base + ["algorithm.micro_batch_size=4",
                                          f"train.max_tokens_per_micro={budget}"]), out=out)
    line = next(x for x in out.getvalue().splitlines() if x.startswith("micro"))
    assert line == (f"micro       packed by tokens: <= {budget:,} per forward/backward "
                    f"(train.max_tokens_per_micro, counted as rows x (prompt width + longest "
                    f"response)): per forward 3 of a minibatch's 16 sequences at full length, "
                    f"up to {min(16, budget // (per_seq - 9)):,} with one-token responses; "
                    f"algorithm.micro_batch_size=4 not used")
    assert "warning" not in out.getvalue()
    out = io.StringIO()
    dry_run(load_config(overrides=base + [f"train.max_tokens_per_micro={per_seq - 1}"]), out=out)
    assert (f"warning: train.max_tokens_per_micro={per_seq - 1:,} is below a full-length "
            f"sequence's {per_seq:,} tokens: such a sequence gets a micro-batch of its own, "
            f"over the budget") in out.getvalue()


def test_a_tracker_that_cannot_be_imported_is_a_warning_as_the_run_refuses_it(monkeypatch):
    # the run refuses at start a train.report_to tracker it cannot import (gspo.trackers.require,
    # tests/test_trackers.py); the dry run said "passed" without a word about it
    monkeypatch.setitem(sys.modules, "wandb", None)  # its import raises
    out = io.StringIO()
    dry_run(load_config(overrides=["train.report_to=[tensorboard, wandb]"]), out=out)
    warnings = [line for line in out.getvalue().splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: checked on this machine: train.report_to=wandb (pip install "
                        "'gspo[trackers]') not available here; needed at run time"]
