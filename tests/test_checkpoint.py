"""Tests for gspo.checkpoint: HF-loadable output, atomic writes, pruning, exact resume."""

import os
import random

import numpy as np
import pytest
import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from gspo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

WORDS = ["<unk>", "<pad>", "<eos>", "1", "2", "3", "+", "=", "what", "is"]


def tiny_model(tie: bool = False, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, head_dim=16, tie_word_embeddings=tie,
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )


def trained_setup(seed: int = 0):
    """A model, AdamW and scheduler after one real update, so optimizer state is non-trivial."""
    model = tiny_model(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    one_step(model, opt, sched)
    return model, opt, sched


def one_step(model, opt, sched) -> None:
    ids = torch.arange(8).view(1, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def save(run_dir, step, model=None, **kw):
    model = model if model is not None else tiny_model()
    return save_checkpoint(run_dir, step, model, tiny_tokenizer(), None, None, {"step": step}, **kw)


@pytest.mark.parametrize("tie", [False, True])
def test_plain_transformers_loads_identical_logits(tmp_path, tie):
    model = tiny_model(tie=tie)
    ckpt = save_checkpoint(tmp_path, 5, model, tiny_tokenizer(), None, None, {})
    assert ckpt == tmp_path / "checkpoints" / "step_000005"
    ids = torch.tensor([[3, 6, 4, 7, 5]])
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_plain_transformers_loads_same_tokenizer(tmp_path):
    tok = tiny_tokenizer()
    ckpt = save_checkpoint(tmp_path, 1, tiny_model(), tok, None, None, {})
    reloaded = AutoTokenizer.from_pretrained(ckpt)
    text = "what is 1 + 2 = 3 unknown"
    assert reloaded(text)["input_ids"] == tok(text)["input_ids"]
    assert (reloaded.pad_token_id, reloaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)


@pytest.mark.parametrize("tie", [False, True])
def test_load_checkpoint_restores_weights_into_fresh_model(tmp_path, tie):
    model = tiny_model(tie=tie, seed=0)
    ckpt = save_checkpoint(tmp_path, 1, model, None, None, None, {"pos": 7})
    fresh = tiny_model(tie=tie, seed=1)
    state = load_checkpoint(ckpt, fresh)
    assert state == {"pos": 7, "step": 1}
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_keep_last_keeps_exactly_the_newest_k(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000004", "step_000005"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000005"


def test_keep_last_zero_keeps_all(tmp_path):
    for step in range(1, 4):
        save(tmp_path, step, keep_last=0)
    assert len(list((tmp_path / "checkpoints").glob("step_*"))) == 3


def test_crash_mid_save_leaves_earlier_checkpoint_and_no_partial(tmp_path, monkeypatch):
    first = save(tmp_path, 1)
    model = tiny_model()

    def crash(save_directory, **kwargs):
        (save_directory / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(model, "save_pretrained", crash)
    from gspo.errors import TrainingError
    with pytest.raises(TrainingError, match=r"could not write checkpoint step_000002 .*\(disk full\)"):
        save(tmp_path, 2, model=model)
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000001"]
    assert latest_checkpoint(tmp_path) == first
    load_checkpoint(first, tiny_model(seed=3))


def test_hard_crash_leftovers_are_ignored_then_cleaned(tmp_path):
    first = save(tmp_path, 1)
    stale = tmp_path / "checkpoints" / ".tmp-step_000002-99999"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    half_latest = tmp_path / "checkpoints" / ".latest.tmp-99999"  # killed before its rename
    half_latest.write_text("step_000002\n")
    assert latest_checkpoint(tmp_path) == first
    save(tmp_path, 3)
    assert not stale.exists() and not half_latest.exists()
    assert sorted(p.name for p in stale.parent.iterdir()) == ["latest", "step_000001",
                                                               "step_000003"]


def test_resaving_same_step_replaces_it(tmp_path):
    save(tmp_path, 1, model=tiny_model(seed=0))
    ckpt = save(tmp_path, 1, model=tiny_model(seed=1))
    fresh = tiny_model(seed=2)
    load_checkpoint(ckpt, fresh)
    assert torch.equal(fresh.lm_head.weight, tiny_model(seed=1).lm_head.weight)
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["latest", "step_000001"]


def test_optimizer_and_scheduler_resume_exactly(tmp_path):
    model, opt, sched = trained_setup(seed=0)
    ckpt = save_checkpoint(tmp_path, 1, model, None, opt, sched, {"data_pos": 3})
    model2, opt2, sched2 = trained_setup(seed=1)  # different weights and moments
    state = load_checkpoint(ckpt, model2, opt2, sched2)
    assert state["data_pos"] == 3
    assert sched2.state_dict() == sched.state_dict()
    # One more identical step on both must give bit-identical weights.
    one_step(model, opt, sched)
    one_step(model2, opt2, sched2)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name


def test_rng_states_restored_exactly(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    ckpt = save(tmp_path, 1)
    expected = (torch.rand(3), random.random(), np.random.rand())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_checkpoint(ckpt, tiny_model())
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_latest_checkpoint_accepts_run_ckpts_and_ckpt_dirs(tmp_path):
    save(tmp_path, 1)
    second = save(tmp_path, 2)
    assert latest_checkpoint(tmp_path) == second
    assert latest_checkpoint(tmp_path / "checkpoints") == second
    assert latest_checkpoint(second) == second
    assert latest_checkpoint(tmp_path / "nowhere") is None


def test_latest_checkpoint_follows_pointer_then_highest_step(tmp_path):
    save(tmp_path, 2)
    first = save(tmp_path, 1)  # written last, as after resuming from an earlier step
    assert latest_checkpoint(tmp_path) == first
    (tmp_path / "checkpoints" / "latest").unlink()
    assert latest_checkpoint(tmp_path).name == "step_000002"


def test_load_missing_or_incomplete_checkpoint_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_checkpoint(tmp_path / "nope", tiny_model())
    partial = tmp_path / "step_000001"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="step_000001"):
        load_checkpoint(partial, tiny_model())


def test_load_optimizer_from_weights_only_checkpoint_is_clear(tmp_path):
    ckpt = save(tmp_path, 1)
    model, opt, _ = trained_setup()
    with pytest.raises(ValueError, match="no optimizer state"):
        load_checkpoint(ckpt, model, opt)


def test_load_checkpoint_converts_moe_expert_layout(tmp_path):
    # transformers v5 keeps Qwen3-MoE experts fused in memory but saves them per expert.
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, head_dim=16,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    ckpt = save_checkpoint(tmp_path, 1, model, None, None, None, {})
    torch.manual_seed(1)
    fresh = transformers.Qwen3MoeForCausalLM(config)
    load_checkpoint(ckpt, fresh)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------- damage


def _truncate(path, keep: int = 10):
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("harm, file, says", [
    (_truncate, "model.safetensors", "model.safetensors has 10 bytes where"),
    (_flip_a_byte, "trainer_state.pt", "trainer_state.pt does not match the checksum"),
    (lambda p: p.unlink(), "tokenizer.json", "tokenizer.json is missing"),
])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, caplog, harm,
                                                                         file, says):
    first = save(tmp_path, 1)
    second = save(tmp_path, 2)
    harm(second / file)
    assert latest_checkpoint(tmp_path) == second  # unverified: the pointer as it is
    with caplog.at_level("WARNING", logger="gspo.checkpoint"):
        assert latest_checkpoint(tmp_path, verify=True) == first
    assert says in caplog.text and "resuming from step_000001" in caplog.text


def test_no_intact_checkpoint_is_one_clear_error(tmp_path):
    from gspo.errors import TrainingError
    for step in (1, 2):
        _flip_a_byte(save(tmp_path, step) / "model.safetensors")
    with pytest.raises(TrainingError, match=r"no intact checkpoint in .*step_000002: model"
                                            r".*; step_000001: model.*start a new run"):
        latest_checkpoint(tmp_path, verify=True)


def _unknown_dtype(path):  # a header of the same length that safetensors cannot parse
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8:8 + n] = data[8:8 + n].replace(b'"F32"', b'"X32"', 1)
    path.write_bytes(bytes(data))


def _without_manifest(ckpt):  # a checkpoint from before manifests, or its manifest lost
    (ckpt / "manifest.json").unlink()
    return ckpt


@pytest.mark.parametrize("harm, file, says", [
    (_truncate, "trainer_state.pt", "trainer_state.pt is unreadable (truncated"),
    (lambda p: _truncate(p, p.stat().st_size // 2), "trainer_state.pt",
     "trainer_state.pt is unreadable (truncated"),
    (lambda p: _truncate(p, p.stat().st_size - 1), "model.safetensors",
     "model.safetensors is unreadable (its size is not the one its header gives)"),
    (_unknown_dtype, "model.safetensors", "model.safetensors is unreadable (Error while "
                                          "deserializing header"),
])
def test_an_unreadable_file_without_a_manifest_falls_back_to_the_newest_intact_one(
        tmp_path, caplog, harm, file, says):
    first = _without_manifest(save(tmp_path, 1))
    second = _without_manifest(save(tmp_path, 2))
    assert latest_checkpoint(tmp_path, verify=True) == second  # whole: nothing to say
    harm(second / file)
    with caplog.at_level("WARNING", logger="gspo.checkpoint"):
        assert latest_checkpoint(tmp_path, verify=True) == first
    assert says in caplog.text and "resuming from step_000001" in caplog.text


def test_an_unreadable_trainer_state_with_no_intact_checkpoint_is_one_clear_error(tmp_path):
    from gspo.errors import TrainingError
    for step in (1, 2):
        _truncate(_without_manifest(save(tmp_path, step)) / "trainer_state.pt")
    with pytest.raises(TrainingError, match=r"no intact checkpoint in .*step_000002: "
                                            r"trainer_state.pt is unreadable .*; step_000001: "
                                            r"trainer_state.pt is unreadable .*start a new run"):
        latest_checkpoint(tmp_path, verify=True)
    # loaded without that check: the same file named, no torch traceback
    with pytest.raises(TrainingError, match=r"step_000002/trainer_state.pt cannot be read "
                                            r"\(PytorchStreamReader .*\): the checkpoint is "
                                            r"damaged; restore the file"):
        load_checkpoint(tmp_path / "checkpoints" / "step_000002", tiny_model())


def test_a_safetensors_file_of_the_right_size_that_cannot_be_read_is_one_clear_error(tmp_path):
    from gspo.errors import TrainingError
    ckpt = _without_manifest(save(tmp_path, 1))
    _unknown_dtype(ckpt / "model.safetensors")  # its size still the one its header gives
    with pytest.raises(TrainingError, match=r"no intact checkpoint .*model.safetensors is "
                                            r"unreadable \(Error while deserializing header"):
        latest_checkpoint(tmp_path, verify=True)
    # loaded without that check: the file named, no safetensors traceback
    with pytest.raises(TrainingError, match=r"step_000001/model.safetensors cannot be read "
                                            r"\(Error while deserializing header.*\): the "
                                            r"checkpoint is damaged; restore the file"):
        load_checkpoint(ckpt, tiny_model())


def test_a_full_disk_is_one_clear_error_and_keeps_the_earlier_checkpoints(tmp_path):
    import subprocess

    from gspo.errors import TrainingError
    fs = tmp_path / "small"
    fs.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(fs)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        first = save(fs, 1)
        fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill the disk, then free a few KB: far less than a checkpoint needs
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - 16384))
        finally:
            os.close(fd)
        with pytest.raises(TrainingError, match=r"could not write checkpoint step_000002 in "
                                                r".*checkpoints \(.*\); it needs about \d+ MB and "
                                                r"\d+ MB are free there; the earlier checkpoints "
                                                r"are intact"):
            save(fs, 2)
        assert latest_checkpoint(fs, verify=True) == first
        assert sorted(p.name for p in (fs / "checkpoints").iterdir()) == ["latest", "step_000001"]
    finally:
        subprocess.run(["umount", str(fs)], check=False)
