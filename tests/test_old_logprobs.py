"""Inference-engine log-probs as pi_old, engine mismatch, bf16 rollouts, TIS, the vLLM engine."""

import math

import pytest
import torch

import gspo.step as step
import gspo.trainer as trainer
from gspo import metrics as M
from gspo.config import ConfigError, load_config
from gspo.logger import read_metrics
from gspo.objectives import engine_mismatch, importance_weights
from gspo.engines import to_rollouts
from gspo.engines.vllm import vllm_available


class ForwardCounter:
    """Counts token_logprobs calls made by the trainer, split by whether grad was on."""

    def __init__(self, monkeypatch):
        self.reset()
        import gspo.logprobs

        real = gspo.logprobs.token_logprobs

        def counted(*args, **kwargs):
            if torch.is_grad_enabled():
                self.grad += 1
            else:
                self.no_grad += 1
            return real(*args, **kwargs)

        # every forward of the training model goes through gspo.distributed.Policy, which
        # calls gspo.logprobs.token_logprobs
        monkeypatch.setattr(gspo.logprobs, "token_logprobs", counted)

    def reset(self):
        self.no_grad = self.grad = 0


def test_rollout_mode_runs_no_recompute_pass(tmp_path, tiny_overrides, monkeypatch):
    common = tiny_overrides + ["train.eval_every=0", "train.steps=2", "warmup.steps=0"]
    counter = ForwardCounter(monkeypatch)
    trainer.train(load_config(overrides=common), tmp_path / "a")
    recompute = (counter.no_grad, counter.grad)
    counter.reset()
    trainer.train(load_config(overrides=common + ["algorithm.old_logprobs=rollout",
                                                  "algorithm.mismatch_every=0"]), tmp_path / "b")
    # recompute: one no-grad forward per micro-batch (16 rows / 4 per micro) per step;
    # the update passes (with grad) are the same in both modes
    assert recompute == (2 * 4, 2 * 4)
    assert (counter.no_grad, counter.grad) == (0, 2 * 4)
    rows = read_metrics(tmp_path / "b")
    assert all(not any(k.startswith("mismatch/") for k in r) for r in rows)
    assert all(math.isfinite(r["entropy"]) for r in rows)


def test_rollout_mode_monitors_mismatch_every_n_steps(tmp_path, tiny_overrides, monkeypatch):
    counter = ForwardCounter(monkeypatch)
    cfg = load_config(overrides=tiny_overrides + [
        "train.eval_every=0", "train.steps=4", "warmup.steps=0", "algorithm.old_logprobs=rollout",
        "algorithm.mismatch_every=2"])
    trainer.train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [(M.MISMATCH + "token_abs_mean" in r) for r in rows] == [True, False, True, False]
    assert counter.no_grad == 2 * 4  # steps 0 and 2 only


def test_same_model_same_precision_has_no_mismatch(tmp_path, tiny_overrides):
    trainer.train(load_config(overrides=tiny_overrides + ["train.eval_every=0"]), tmp_path / "r")
    for row in read_metrics(tmp_path / "r"):
        assert row[M.MISMATCH + "token_abs_mean"] < 1e-5
        assert row[M.MISMATCH + "seq_log_ratio_abs_max"] < 1e-5


def test_bfloat16_rollouts_have_positive_mismatch(tmp_path, tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + ["train.eval_every=0", "rollout.dtype=bfloat16"])
    run = trainer.prepare(cfg, tmp_path / "r", resume=False)
    assert next(run.engine.model.parameters()).dtype == torch.bfloat16
    assert next(run.model.parameters()).dtype == torch.float32
    row = step.rl_step(run, 0)
    assert row[M.MISMATCH + "token_abs_mean"] > 1e-4  # float32 vs float32 gives ~1e-7
    # the engine's copy follows the trainer's weights after the step
    for (name, p), q in zip(run.model.named_parameters(), run.engine.model.parameters()):
        torch.testing.assert_close(p.detach().to(torch.bfloat16), q.detach(), rtol=0, atol=0,
                                   msg=name)


def test_tis_weights_on_a_hand_built_case():
    # pi_old / pi_rollout per token: e^0.5, e^-1, e^2 (capped at 2), and one padded position
    logp = torch.tensor([[-1.0, -2.0, 0.0, 9.0]])
    rollout = torch.tensor([[-1.5, -1.0, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w = importance_weights(logp, rollout, mask, "truncate", "token", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5), math.exp(-1.0), 2.0, 1.0]]))
    # sequence: prod = e^(0.5 - 1 + 2) = e^1.5 = 4.48 -> capped at 2; with a big cap, e^1.5
    ws = importance_weights(logp, rollout, mask, "truncate", "sequence", cap=2.0)
    torch.testing.assert_close(ws, torch.tensor([2.0]))
    ws = importance_weights(logp, rollout, mask, "truncate", "sequence", cap=10.0)
    torch.testing.assert_close(ws, torch.tensor([math.exp(1.5)]))
    huge = importance_weights(torch.full((1, 4), 100.0), torch.zeros(1, 4), torch.ones(1, 4),
                              "truncate", "sequence", cap=3.0)
    assert torch.isfinite(huge).all() and float(huge) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="cap"):
        importance_weights(logp, rollout, mask, "truncate", "token", cap=0)


def test_engine_mismatch_on_a_hand_built_case():
    logp = torch.tensor([[-1.0, -2.0, 5.0], [-1.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, 0.0], [-1.25, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = engine_mismatch(logp, rollout, mask)
    # |deltas| on real tokens: 0.5, 1.0, 0.25 -> mean 0.5833; sequences: (0.5-1)/2=-0.25, 0.25
    assert float(m["token_abs_mean"]) == pytest.approx(1.75 / 3)
    assert float(m["token_abs_max"]) == pytest.approx(1.0)
    assert float(m["seq_log_ratio_mean"]) == pytest.approx(0.0)
    assert float(m["seq_log_ratio_abs_mean"]) == pytest.approx(0.25)
    assert float(m["seq_log_ratio_abs_max"]) == pytest.approx(0.25)


@pytest.mark.parametrize("algorithm, extra, warned", [
    # the tiny model's bf16 sampler sits ~2e-4 from its float32 trainer, per token and per
    # sequence (length-normalised): beyond a clip range of 3e-5, within 0.5 and GRPO's 0.27
    ("gspo", ["algorithm.eps_low=3e-5", "algorithm.eps_high=3e-5"], True),
    ("gspo", ["algorithm.eps_low=0.5", "algorithm.eps_high=0.5"], False),
    ("grpo", [], False),
])
def test_a_mismatch_beyond_the_clip_range_is_warned_once(tmp_path, tiny_overrides, caplog,
                                                          algorithm, extra, warned):
    cfg = load_config(overrides=tiny_overrides + [
        "train.eval_every=0", "rollout.dtype=bfloat16", "algorithm.old_logprobs=rollout",
        "algorithm.mismatch_every=1", f"algorithm={algorithm}", *extra])
    run = trainer.prepare(cfg, tmp_path / "r", resume=False)
    rows = [step.rl_step(run, s) for s in range(2)]
    said = [r.getMessage() for r in caplog.records if "clipped on precision alone" in r.message]
    key = "seq_log_ratio_abs_mean" if algorithm == "gspo" else "token_abs_mean"
    eps = float(extra[1].split("=")[1]) if extra else 0.27
    assert all((r[M.MISMATCH + key] > eps) == warned for r in rows)  # the premise
    assert len(said) == int(warned)  # once, not per step
    if warned:
        assert f"mismatch/{key}" in said[0] and "old_logprobs=recompute" in said[0]


def test_tis_in_train_changes_the_update_only_through_the_weights(tmp_path, tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + ["train.eval_every=0", "train.steps=1",
                                                  "rollout.dtype=bfloat16", "algorithm.tis=sequence"])
    trainer.train(cfg, tmp_path / "r")
    assert math.isfinite(read_metrics(tmp_path / "r")[-1]["loss"])


@pytest.mark.parametrize("overrides, words", [
    (["algorithm.tis=token"], "gspo has one advantage per sequence"),
    (["algorithm.tis=sequence", "algorithm.is_correction=mask"], "drop algorithm.tis"),
    (["algorithm.is_correction=mask", "algorithm.is_floor=3"], "must be below algorithm.is_cap"),
    (["algorithm.old_logprobs=cache"], r"algorithm.old_logprobs must be one of recompute \| "
                                       r"rollout, got 'cache'"),
    (["rollout.dtype=int8"], "rollout.dtype"),
])
def test_bad_engine_settings_are_config_errors(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config(overrides=overrides)


def test_moe_rollout_routing_is_recorded_for_replay(tmp_path, tiny_overrides):
    """With old_logprobs=rollout and routing replay, the engine records routing while decoding;
    it matches the routing a full forward of the same model records for the same tokens."""
    cfg = load_config(overrides=tiny_overrides + [
        "model.name_or_path=tiny-qwen3-moe", "model.moe_intermediate_size=32", "algorithm=grpo",
        "algorithm.routing_replay=true", "algorithm.old_logprobs=rollout",
        "train.eval_every=0", "warmup.steps=0"])
    run = trainer.prepare(cfg, tmp_path / "r", resume=False)
    rows = step.step_prompts(run.train_rows, 0, cfg.rollout.prompts_per_step, 0)
    r = step.generate(run, rows, 0)
    streamed = run.routing.engine_recorder.indices("old")
    recorder = run.routing.recorder  # on the training model
    recorder.allocate("full", r.input_ids.shape[0], r.input_ids.shape[1] - 1)
    step.policy_logprobs(run.policy, r, 1.0, step.micro_batches(run, r, run.policy), 1024,
                         route=lambda rows: recorder.record(rows, store="full"))
    mask = r.attention_mask[:, :-1] > 0  # real tokens of the decoder input
    for s, f in zip(streamed, recorder.indices("full")):
        agree = (s.sort(-1).values == f.sort(-1).values).all(-1)[mask].float().mean()
        assert agree > 0.99  # near-ties may flip under different kernels' rounding
    step.rl_step(run, 0)  # and the replayed update runs


def test_to_rollouts_pads_like_the_hf_engine():
    r = to_rollouts([[5, 6], [7]], [[1, 2, 3], [4]], [[-0.1, -0.2, -0.3], [-0.4]], pad_id=0)
    assert r.prompt_ids.tolist() == [[5, 6], [0, 7]] and r.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert r.response_ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert r.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    torch.testing.assert_close(r.logp, torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0]]))


@pytest.mark.gpu
@pytest.mark.skipif(not vllm_available(), reason="vLLM and a CUDA GPU are not available here")
def test_vllm_engine_logprobs_match_the_trainer(tok):
    from gspo.models import build_tiny_qwen3
    from gspo.logprobs import token_logprobs
    from gspo.engines import SamplingParams
    from gspo.engines.vllm import VLLMEngine

    model = build_tiny_qwen3(tok, hidden_size=256, num_heads=4, num_kv_heads=2).cuda()
    engine = VLLMEngine(model, tok, dtype="float32", gpu_memory_utilization=0.2)
    r = engine.generate([[5, 6, 7], [8, 9]], n=4, params=SamplingParams(1.0, 1.0, 8), seed=0)
    logp = token_logprobs(model, r.input_ids.cuda(), r.attention_mask.cuda(), r.logp.shape[1])
    m = engine_mismatch(logp.cpu(), r.logp, r.response_mask)
    assert float(m["token_abs_mean"]) < 1e-3


def test_vllm_engine_without_vllm_is_a_clear_import_error(tok):
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    from gspo.models import build_tiny_qwen3
    from gspo.engines.vllm import VLLMEngine

    with pytest.raises(ImportError, match="gspo\\[vllm\\]"):
        VLLMEngine(build_tiny_qwen3(tok, hidden_size=32, num_layers=1, num_heads=2,
                                    num_kv_heads=1), tok)
