"""The engine registry: an engine reads its own rollout.* settings (`settings`), and nothing
outside gspo.engines names an engine or reads an engine's keys."""

import ast
from pathlib import Path

import pytest

from gspo.config import load_config
from gspo.engines import ENGINES, EngineSettings, HFEngine, VLLMEngine
from gspo.preflight import build_model
from gspo.trainer import build_engine

SRC = Path(__file__).resolve().parents[1] / "src" / "gspo"


def _names_an_engine(node: ast.AST) -> str | None:
    """What in `node` names an engine: a comparison with an ENGINES key (`engine == "hf"`,
    `engine in ("hf", ...)`) or an engine's own config key (`rollout.vllm_sleep`)."""
    if isinstance(node, ast.Compare):
        for side in (node.left, *node.comparators):
            items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            for item in items:
                if isinstance(item, ast.Constant) and item.value in ENGINES:
                    return f"compares with {item.value!r}"
    if isinstance(node, ast.Attribute) and any(node.attr.startswith(f"{name}_")
                                               for name in ENGINES):
        return f"reads .{node.attr}"
    return None


def test_no_module_outside_engines_names_an_engine():
    found = [f"{path.relative_to(SRC)}:{node.lineno} {what}"
             for path in sorted(SRC.rglob("*.py")) if "engines" not in path.parts
             for node in ast.walk(ast.parse(path.read_text()))
             if (what := _names_an_engine(node))]
    assert not found, f"name engines only in gspo/engines: {found}"


def test_the_check_finds_what_it_looks_for():
    tree = ast.parse("if r.engine != 'vllm':\n    x = r.vllm_sleep")
    assert sorted(filter(None, map(_names_an_engine, ast.walk(tree)))) == [
        "compares with 'vllm'", "reads .vllm_sleep"]


def test_vllm_reads_its_keys_into_its_options_and_memory_profile():
    cfg = load_config(overrides=["rollout.vllm_gpu_memory_utilization=0.5",
                                 "rollout.tensor_parallel_size=2", "rollout.vllm_sleep=true"])
    s = VLLMEngine.settings(cfg.rollout, routing_replay=True)  # builds nothing: no vLLM needed
    assert s.options == {"gpu_memory_utilization": 0.5, "record_routing": True,
                         "tensor_parallel_size": 2, "sleep": True}
    assert (s.own_copy, s.shards, s.kv_cache, s.gpu_share, s.sleeps) == (
        True, 2, False, 0.5, "rollout.vllm_sleep")
    assert HFEngine.settings(cfg.rollout) == EngineSettings(own_copy=False, kv_cache=True)


class ToyEngine(HFEngine):
    """A new engine: its own setting (here it borrows rollout.top_p) reaches its constructor."""

    built_with: dict = {}

    @classmethod
    def settings(cls, rollout, routing_replay=False):
        return EngineSettings(options={"toy_top_p": rollout.top_p,
                                       "routing_replay": routing_replay},
                              own_copy=True, kv_cache=False)

    @classmethod
    def from_model(cls, model, tokenizer, *, dtype="float32", seed=0, own_copy=False,
                   **options):
        cls.built_with = {"own_copy": own_copy, "seed": seed, **options}
        return super().from_model(model, tokenizer, dtype=dtype, seed=seed, own_copy=own_copy)


def test_a_new_engines_settings_reach_it_and_the_dry_run(monkeypatch):
    from gspo.dryrun import memory_estimate

    monkeypatch.setitem(ENGINES, "toy", ToyEngine)
    cfg = load_config(overrides=["rollout.engine=toy", "rollout.top_p=0.9", "train.seed=3",
                                 "model.name_or_path=tiny-qwen3-moe",
                                 "algorithm.routing_replay=true"])
    model, tokenizer = build_model(cfg)
    assert isinstance(build_engine(model, tokenizer, cfg), ToyEngine)
    assert ToyEngine.built_with == {"own_copy": False, "seed": 3, "toy_top_p": 0.9,
                                    "routing_replay": True}
    memory = memory_estimate(model, cfg, world=1, mode="none", prompt_max=8)
    n = sum(p.numel() for p in model.parameters())
    assert memory["rollout_copy"] == 4 * n and memory["kv_cache"] == 0  # own float32 copy


@pytest.mark.parametrize("engine, copy, kv", [("hf", False, True), ("vllm", True, False)])
def test_the_dry_run_counts_what_the_engine_declares(engine, copy, kv):
    from gspo.dryrun import memory_estimate

    cfg = load_config(overrides=[f"rollout.engine={engine}"])
    model, _ = build_model(cfg)
    memory = memory_estimate(model, cfg, world=1, mode="none", prompt_max=8)
    assert (memory["rollout_copy"] > 0, memory["kv_cache"] > 0) == (copy, kv)
