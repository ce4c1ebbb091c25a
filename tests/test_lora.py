"""LoRA through peft: the engine samples the merged weights, only adapters train, checkpoints
load in plain transformers and resume exactly."""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from gspo import metrics as M  # noqa: E402
from gspo.config import ConfigError, load_config  # noqa: E402
from gspo.logger import read_metrics  # noqa: E402
from gspo.logprobs import token_logprobs  # noqa: E402
from gspo.models import build_tiny_qwen3  # noqa: E402
from gspo.lora import add_lora, load_adapter, merged_weights  # noqa: E402
from gspo.errors import TrainingError  # noqa: E402
from gspo.preflight import build_model  # noqa: E402
from gspo.step import rl_step  # noqa: E402
from gspo.trainer import prepare, train  # noqa: E402
from gspo.weights import copy_weights_  # noqa: E402

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _perturb(model, seed=0):
    """Adapters as training leaves them: B != 0 (peft starts B at zero, an identity update)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _batch(vocab, B=3, L=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    return ids, mask


def test_merged_weights_are_w_plus_scaled_ba_and_give_the_adapted_model(model, tok):
    lora = add_lora(copy.deepcopy(model), rank=4, alpha=8.0, dropout=0.0, target_modules=TARGETS)
    _perturb(lora)
    merged = dict(merged_weights(lora))
    assert set(merged) == set(model.state_dict())  # the plain model's names, no adapter keys
    # one layer by hand, in float64: W + (alpha / r) B A
    q = lora.model.layers[0].self_attn.q_proj
    want = (q.base_layer.weight.double() + 8.0 / 4 * q.lora_B["default"].weight.double()
            @ q.lora_A["default"].weight.double())
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"].double(), want,
                               rtol=0, atol=1e-6)
    k = "model.layers.0.self_attn.k_proj.weight"  # not a target: untouched
    assert torch.equal(merged[k], model.state_dict()[k])
    plain = copy.deepcopy(model)
    copy_weights_(plain, merged.items())
    ids, mask = _batch(len(tok))
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(plain, ids, mask, 4),
                                   token_logprobs(lora, ids, mask, 4), rtol=0, atol=1e-5)


def test_a_target_the_model_lacks_is_a_clear_error(model):
    with pytest.raises(ValueError, match=r"names \['wq'\].*it has \[.*'q_proj'"):
        add_lora(copy.deepcopy(model), rank=2, alpha=4.0, dropout=0.0, target_modules=["wq"])


@pytest.mark.parametrize("tied", [True, False])
def test_an_adapter_on_the_output_embedding_is_a_clear_error(tok, tied):
    # token_logprobs applies lm_head by its weight: an adapter there gets no gradient (and,
    # tied to embed_tokens as in SmolLM2, its merged delta would land in the embedding too)
    model = build_tiny_qwen3(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, tie_word_embeddings=tied)
    with pytest.raises(ValueError, match=r"names the output embedding 'lm_head'.*never train"):
        add_lora(model, rank=2, alpha=4.0, dropout=0.0, target_modules=["q_proj", "lm_head"])


WORKER = Path(__file__).with_name("dist_update_worker.py")


def _cfg(tiny_overrides, *extra):
    # a dense reward (the digit fraction of a completion): every step has a learning signal
    return load_config(overrides=tiny_overrides + [f"data.reward={WORKER}:digit_fraction",
                                                   "model.lora_rank=4", "model.lora_alpha=8",
                                                   f"model.lora_target_modules=[{','.join(TARGETS)}]",
                                                   "optim.lr=1e-2", *extra])


def test_only_the_adapters_train_and_the_engine_samples_the_merged_policy(tiny_overrides, tmp_path):
    cfg = _cfg(tiny_overrides, "warmup.steps=0")
    run = prepare(cfg, tmp_path / "run", resume=False)
    base, _ = build_model(cfg)  # the same seed: the weights the run started from
    held = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    trainable = {id(p) for n, p in run.model.named_parameters() if "lora_" in n}
    assert held == trainable and trainable
    before = {n: p.detach().clone() for n, p in run.model.named_parameters() if "lora_B" in n}
    rl_step(run, 0)
    assert any(not torch.equal(p, before[n]) for n, p in run.model.named_parameters() if n in before)
    for key, w in base.state_dict().items():  # the base is frozen
        assert torch.equal(run.model.state_dict()[key.replace("_proj.", "_proj.base_layer.")]
                           if any(f"{t}.weight" in key for t in TARGETS) else
                           run.model.state_dict()[key], w), key
    # the engine's own copy holds W + BA: it scores its samples as the trainer does
    ids, mask = _batch(len(run.tokenizer))
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(run.engine.model, ids, mask, 4),
                                   token_logprobs(run.model, ids, mask, 4), rtol=0, atol=1e-5)
    run.engine.close()


def test_a_lora_checkpoint_loads_in_plain_transformers_and_resumes_exactly(tiny_overrides, tmp_path):
    from transformers import AutoModelForCausalLM
    cfg = _cfg(tiny_overrides)
    full = tmp_path / "full"
    train(cfg, full)
    ckpt = full / "checkpoints" / "step_000002"
    plain = AutoModelForCausalLM.from_pretrained(ckpt)  # the merged model, no peft needed
    adapted, tok = build_model(cfg)
    adapted = add_lora(adapted, 4, 8.0, 0.0, TARGETS)
    load_adapter(adapted, ckpt / "lora")
    ids, mask = _batch(len(tok))
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(plain, ids, mask, 4),
                                   token_logprobs(adapted, ids, mask, 4), rtol=0, atol=1e-5)
    # resume from step 1: the same step 2 as the uninterrupted run
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000002")
    (resumed / "checkpoints" / "latest").write_text("step_000001\n")
    rows = [r for r in read_metrics(resumed) if r["step"] <= 1]
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train(cfg, resumed, resume=True)
    want, got = read_metrics(full)[-1], read_metrics(resumed)[-1]
    for k in (M.REWARD_MEAN, M.LOSS, M.GRAD_NORM, M.CLIP_FRAC, M.EVAL_ACCURACY):
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), k
    from safetensors.torch import load_file
    a = load_file(ckpt / "lora" / "adapter_model.safetensors")
    b = load_file(resumed / "checkpoints" / "step_000002" / "lora" / "adapter_model.safetensors")
    assert set(a) == set(b) and all(k.startswith("base_model.model.") for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-7, msg=k)


def test_resuming_a_full_run_with_lora_is_a_clear_error(tiny_overrides, tmp_path):
    cfg = load_config(overrides=tiny_overrides + ["train.steps=1"])
    train(cfg, tmp_path / "run")
    # the run's config says it was trained without adapters: refused before anything loads
    with pytest.raises(TrainingError, match=r"cannot change model.lora_rank=4 \(trained with 0\)"):
        prepare(_cfg(tiny_overrides, "train.steps=2"), tmp_path / "run", resume=True)
    # and a checkpoint without lora/ (its config.yaml lost) is named as such
    model, _ = build_model(cfg)
    model = add_lora(model, 4, 8.0, 0.0, TARGETS)
    with pytest.raises(ValueError, match="saved without LoRA"):
        load_adapter(model, tmp_path / "run" / "checkpoints" / "step_000001" / "lora")


@pytest.mark.parametrize("override, message", [
    ("model.lora_rank=-1", "model.lora_rank must be >= 0"),
    ("model.lora_dropout=1.5", "model.lora_dropout must be in"),
    ("model.lora_target_modules=[]", "model.lora_target_modules must be a non-empty list"),
])
def test_bad_lora_settings_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["model.lora_rank=4", override])
