import pytest

from gspo.models import build_tiny_qwen3, build_tokenizer

# A run small enough for unit tests: ~1 s per RL step on 2 cores.
TINY_OVERRIDES = [
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
    "model.intermediate_size=64",
    "data.n_train=200", "data.n_eval=8",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
    "warmup.steps=3", "warmup.batch_size=8",
    "train.steps=2", "train.eval_every=1", "train.eval_k=2", "train.save_every=1",
    "train.progress=false", "train.tensorboard=false",
]


@pytest.fixture
def tiny_overrides():
    return list(TINY_OVERRIDES)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    """A small randomly initialised Qwen3 over the character tokenizer."""
    return build_tiny_qwen3(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=128)
