import pytest

from gspo.hub import hub_unreachable, looks_like_hub_id, looks_like_path


@pytest.mark.parametrize("name, is_path", [
    ("./m", True), ("/abs/m", True), ("~/m", True), ("runs/a/ckpt", True),
    ("Qwen/Qwen3-0.6B", False), ("gpt2", False),
])
def test_hub_ids_are_not_mistaken_for_paths(name, is_path):
    assert looks_like_path(name) == is_path


@pytest.mark.parametrize("name, is_id", [
    ("openai/gsm8k", True), ("gsm8k", True), ("Qwen/Qwen3-0.6B", True),
    ("HuggingFaceH4/MATH-500", True),
    ("train.jsonl", False), ("data/train.parquet", False),  # a missing file, not a dataset
    ("./gsm8k", False), ("a/b/c", False), ("my data", False), ("org/", False), ("", False),
])
def test_what_can_be_a_hub_id(name, is_id):
    assert looks_like_hub_id(name) == is_id


def test_the_hub_unreachable_says_why_at_once(monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_unreachable() == "HF_HUB_OFFLINE is set"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused
    assert hub_unreachable().startswith("the hub at http://127.0.0.1:9 cannot be reached")
