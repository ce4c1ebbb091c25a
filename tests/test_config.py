import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gspo.config import (Config, ConfigError, allowed, check_value, help_text, load_config,
                         save_config)

MATH_ROWS = str(Path(__file__).resolve().parents[1] / "examples" / "data" / "math_mini.jsonl")


def test_defaults_resolve_the_gspo_preset():
    cfg = load_config()
    assert cfg.algorithm.name == "gspo"
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == (3e-4, 4e-4)
    assert cfg.algorithm.minibatches == 4


def test_algorithm_shorthand_selects_grpo_preset():
    cfg = load_config(overrides=["algorithm=grpo"])
    assert (cfg.algorithm.name, cfg.algorithm.eps_low, cfg.algorithm.eps_high) == ("grpo", 0.2, 0.27)


def test_explicit_eps_beats_the_preset():
    cfg = load_config(overrides=["algorithm=grpo", "algorithm.eps_high=0.3"])
    assert cfg.algorithm.eps_high == 0.3 and cfg.algorithm.eps_low == 0.2


def test_overrides_are_typed_from_yaml():
    cfg = load_config(overrides=["optim.lr=1e-3", "optim.betas=[0.9, 0.95]", "train.progress=false",
                                 "train.steps=7"])
    assert cfg.optim.lr == 1e-3 and cfg.optim.betas == [0.9, 0.95]
    assert cfg.train.progress is False and cfg.train.steps == 7


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm: grpo\noptim:\n  lr: 0.01\ntrain:\n  steps: 5\n")
    cfg = load_config(path, ["train.steps=9"])
    assert cfg.algorithm.name == "grpo" and cfg.optim.lr == 0.01 and cfg.train.steps == 9


def test_saved_config_loads_back_identically(tmp_path):
    cfg = load_config(overrides=["algorithm=grpo", "rollout.group_size=4"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize("override, words", [
    ("optim.lrr=1", "unknown config key 'optim.lrr'"),
    ("nosuch.key=1", "unknown config key"),
    ("optim.lr=fast", "optim.lr: expected float"),
    ("train.steps=1.5", "train.steps: expected int"),
    ("algorithm.minibatches=5", "not divisible by algorithm.minibatches"),
    ("algorithm=ppo", r"algorithm.name must be one of gspo \| gspo_token \| grpo, got 'ppo'"),
    ("algorithm.eps_low=-0.1", "algorithm.eps_low must be >= 0"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("model=3", "is a section"),
    ("lr", "must look like key.sub=value"),
    ("data.n_train=99999", "distinct problems"),
    ("algorithm.aggregation=token-mean", "does not apply to gspo"),
])
def test_bad_config_raises_one_clear_line(override, words):
    with pytest.raises(ConfigError, match=words) as e:
        load_config(overrides=[override])
    assert "\n" not in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_help_lists_every_field_with_its_help():
    text = help_text()
    import dataclasses
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):
            assert f"{section.name}.{f.name}=" in text
            assert f.metadata["help"] in text


def test_rollout_engine_names_come_from_the_engine_registry(monkeypatch):
    from gspo.config import ConfigError, load_config
    from gspo.engines import ENGINES, HFEngine
    monkeypatch.setitem(ENGINES, "toy", HFEngine)  # what adding an engine file amounts to
    assert load_config(overrides=["rollout.engine=toy"]).rollout.engine == "toy"
    with pytest.raises(ConfigError, match=r"rollout.engine must be one of hf \| toy \| vllm, "
                                          r"got 'sglang'"):
        load_config(overrides=["rollout.engine=sglang"])


@pytest.mark.parametrize("override, message", [
    ("optim.betas=[0.9,2]", r"optim.betas must be two numbers in \[0, 1\)"),
    ("optim.betas=[0.9]", r"optim.betas must be two numbers"),
    ("rollout.group_size=1", r"rollout.group_size must be >= 2, got 1 \(group advantages need "
                             r"at least 2"),
])
def test_settings_that_cannot_train_are_config_errors(override, message):
    from gspo.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_report_to_defaults_to_no_tracker_and_takes_a_name_or_a_list():
    assert load_config().train.report_to == []
    assert load_config(overrides=["train.report_to=wandb"]).train.report_to == ["wandb"]
    assert load_config(overrides=["train.report_to=[mlflow, wandb, mlflow]"]).train.report_to == [
        "mlflow", "wandb"]


def test_deprecated_tensorboard_flag_is_folded_into_report_to(tmp_path):
    cfg = load_config(overrides=["train.report_to=[wandb]", "train.tensorboard=true"])
    assert (cfg.train.report_to, cfg.train.tensorboard) == (["wandb", "tensorboard"], False)
    save_config(cfg, tmp_path / "config.yaml")  # the saved config names it once, in report_to
    assert load_config(tmp_path / "config.yaml") == cfg
    assert load_config(overrides=["train.tensorboard=false"]).train.report_to == []


@pytest.mark.parametrize("override, message", [
    ("train.report_to=[neptune]", r"train.report_to must be one of tensorboard \| wandb \| "
                                  r"trackio \| mlflow, got 'neptune'"),
    ("train.report_to=[[wandb]]", r"train.report_to must be one of .*, got \['wandb'\]"),
    ("train.project=''", "train.project must name"),
])
def test_bad_trackers_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


# ---- the choices and bounds fields declare: one check, one message, shown by --help


def _declared() -> list[tuple[str, dataclasses.Field]]:
    """(section.field, field) of every config field that declares choices or bounds."""
    return [(f"{section.name}.{f.name}", f) for section in dataclasses.fields(Config)
            for f in dataclasses.fields(section.default_factory()) if allowed(f.metadata)]


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _outside(f: dataclasses.Field) -> list:
    """The values nearest a field's declaration that break it: a name not among its choices (as
    an entry, for a list field), the bound itself at an open end, one past it at a closed end."""
    m = f.metadata
    if m["choices"] is not None:
        return [["no-such-name"] if isinstance(_default(f), list) else "no-such-name"]
    return [m[op] + step for op, step in (("gt", 0), ("ge", -1), ("lt", 0), ("le", 1))
            if m[op] is not None]


def _closed_ends(f: dataclasses.Field) -> list:
    return [f.metadata[op] for op in ("ge", "le") if f.metadata[op] is not None]


# overrides that turn on a `when` field's check where the defaults leave it off
ENABLE = {"model.lora_alpha": ["model.lora_rank=8"], "model.lora_dropout": ["model.lora_rank=8"],
          "rollout.filter_max_rounds": ["rollout.filter_groups=true"]}

OUTSIDE = [(key, bad) for key, f in _declared() for bad in _outside(f)]
CLOSED = [(key, edge) for key, f in _declared() for edge in _closed_ends(f)]


@pytest.mark.parametrize("key, bad", OUTSIDE, ids=[f"{k}={b!r}" for k, b in OUTSIDE])
def test_a_value_outside_a_declared_field_is_one_line_naming_the_field(key, bad):
    meta = dict(_declared())[key].metadata
    section = key.split(".")[0]
    when = meta["when"]
    cfg = load_config(overrides=ENABLE.get(key, []))
    assert when is None or when(getattr(cfg, section)), f"add to ENABLE what turns on {key}'s check"
    with pytest.raises(ConfigError) as e:
        load_config(overrides=ENABLE.get(key, []) + [f"{key}={json.dumps(bad)}"])
    message = str(e.value)
    assert message.startswith(f"{key} must be ") and allowed(meta) in message
    assert "\n" not in message


@pytest.mark.parametrize("key, edge", CLOSED, ids=[f"{k}={e!r}" for k, e in CLOSED])
def test_the_closed_end_of_a_bound_is_allowed(key, edge):
    cfg = load_config(overrides=ENABLE.get(key, []) + [f"{key}={edge}"])
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == edge


def test_the_defaults_pass_every_declaration():
    load_config()
    load_config(overrides=[o for extra in ENABLE.values() for o in extra])
    for key, f in _declared():  # also where `when` leaves a default unchecked
        check_value(key, _default(f), f.metadata)


@pytest.mark.parametrize("override, message", [
    ("rollout.top_p=1.5", "rollout.top_p must be in (0, 1], got 1.5"),
    ("rollout.dtype=fp8", "rollout.dtype must be one of auto | float32 | bfloat16 | float16, got 'fp8'"),
    ("algorithm.minibatches=0", "algorithm.minibatches must be > 0, got 0"),
    ("train.keep_last=-1", "train.keep_last must be >= 0, got -1"),
    ("data.max_reward_failures=1.5", "data.max_reward_failures must be in [0, 1], got 1.5"),
    ("optim.lr=.nan", "optim.lr must be > 0, got nan"),  # NaN fails every bound
    ("data.format_weight=1", "data.format_weight must be in [0, 1), got 1.0 (so that a "
                             "well-formed wrong answer never counts as solved)"),
    ("train.report_to=[wandb, neptune]", "train.report_to must be one of tensorboard | wandb | "
                                         "trackio | mlflow, got 'neptune'"),
])
def test_a_bad_value_names_the_field_what_it_allows_and_the_value(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert str(e.value) == message


@pytest.mark.parametrize("overrides", [
    ["model.lora_alpha=0", "model.lora_dropout=1.5"],  # LoRA off: its settings are unused
    ["data.task=math", f"data.path={MATH_ROWS}", f"data.eval_path={MATH_ROWS}", "data.n_eval=0",
     "data.digits=0", "data.n_train=0"],  # nothing is generated or held out
])
def test_a_field_is_checked_only_where_its_when_holds(overrides):
    load_config(overrides=overrides)


def test_registry_choices_are_read_when_checked(monkeypatch):
    from gspo.trackers import TRACKERS
    monkeypatch.setitem(TRACKERS, "toy", TRACKERS["wandb"])  # what adding a tracker amounts to
    assert load_config(overrides=["train.report_to=toy"]).train.report_to == ["toy"]
    assert "[tensorboard | wandb | trackio | mlflow | toy]" in help_text()


def test_help_shows_what_each_declared_field_allows_after_its_help():
    text = help_text()
    for key, f in _declared():  # every field with choices or bounds, whatever is added later
        entry = f"{key}={_default(f)!r}\n        {f.metadata['help']}"
        assert f"{entry}  [{allowed(f.metadata)}]" in text, key
    with_choices = {key for key, f in _declared() if f.metadata["choices"] is not None}
    assert {"model.dtype", "rollout.dtype", "data.task", "train.report_to"} <= with_choices
    assert "(float32 for fp32, bfloat16 for bf16-mixed)  [auto | float32 | bfloat16 | " \
           "float16]" in text
    assert "updates below |w| * 2^-9 vanish)  [fp32 | bf16-mixed | fp16-mixed | bf16-true]" in text
    assert "nucleus sampling threshold  [in (0, 1]]" in text
    assert "maximum response length in tokens  [> 0]" in text


def test_config_imports_and_prints_help_without_torch():
    code = "import sys, gspo.config as c; c.help_text(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_a_text_override_is_taken_as_typed():
    """A text field's override is its text, not YAML: a colon made it a mapping, 'no' a bool,
    '{prompt}' a mapping; a quoted value loses its quotes; other fields parse as YAML."""
    cfg = load_config(overrides=["data.system_prompt=Note: be brief",
                                 "data.prompt_template=Q: {prompt}"])
    assert (cfg.data.system_prompt, cfg.data.prompt_template) == ("Note: be brief", "Q: {prompt}")
    assert load_config(overrides=["data.system_prompt=no"]).data.system_prompt == "no"
    assert load_config(overrides=["data.prompt_template={prompt}"]).data.prompt_template == \
        "{prompt}"
    assert load_config(overrides=['data.system_prompt="a: b"']).data.system_prompt == "a: b"
    assert load_config(overrides=["train.steps=3"]).train.steps == 3
    with pytest.raises(ConfigError, match="train.steps: expected int"):
        load_config(overrides=["train.steps=three"])


@pytest.mark.parametrize("override, says", [
    ("model.num_heads=0", "model.num_heads must be > 0"),
    ("model.logprob_chunk_size=0", "model.logprob_chunk_size must be > 0"),
    ("optim.weight_decay=-1", "optim.weight_decay must be >= 0"),
    ("warmup.lr=-1", "warmup.lr must be > 0"),
    ("model.num_kv_heads=3", "model.num_heads=4 must be a multiple of model.num_kv_heads=3"),
    ("model.hidden_size=30", "divide model.hidden_size=30"),
    ("optim.betas=0.9", "optim.betas: expected a list ([a, b, ...]), got 0.9"),
])
def test_sizes_and_rates_out_of_range_are_config_errors(override, says):
    # each was a traceback from torch (range() step 0, a division by zero, AdamW's own check,
    # attention shapes) once the run had started
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(overrides=[override])


def test_a_config_file_error_says_where_and_what(tmp_path):
    tab = tmp_path / "tab.yaml"
    tab.write_text("train:\n  steps: 2\n\tlr: 3\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line 3, column 1: found character "
                                          r".*\(YAML indents with spaces, not tabs\)"):
        load_config(tab)
    colon = tmp_path / "colon.yaml"
    colon.write_text("train:\n  steps 2\n  eval_every: 1\n")
    with pytest.raises(ConfigError, match="at line 3, column 13: mapping values are not allowed"):
        load_config(colon)
    # dotted keys read as nested ones, and an empty section sets nothing
    dotted = tmp_path / "dotted.yaml"
    dotted.write_text("model:\ntrain.steps: 2\nrollout:\n  group_size: 4\n")
    cfg = load_config(dotted)
    assert (cfg.train.steps, cfg.rollout.group_size, cfg.model.name_or_path) == \
        (2, 4, "tiny-qwen3")


def test_a_config_file_in_another_encoding_loads_or_is_one_line(tmp_path):
    # Windows PowerShell 5's `>` writes UTF-16 with a byte-order mark, an editor's Latin-1 file
    # has bytes UTF-8 cannot decode: both were a UnicodeDecodeError traceback
    text = "data:\n  system_prompt: Réponds en français.\ntrain:\n  steps: 2\n"
    utf8, utf16, latin1 = (tmp_path / n for n in ("utf8.yaml", "utf16.yaml", "latin1.yaml"))
    utf8.write_text(text, encoding="utf-8")
    utf16.write_text(text, encoding="utf-16")  # with its BOM
    latin1.write_text(text, encoding="latin-1")
    assert load_config(utf16) == load_config(utf8)
    # "data:\n  system_prompt: R" is 24 bytes: the "é" is byte 24
    with pytest.raises(ConfigError, match=r"config file '.*latin1\.yaml' is not valid YAML: "
                                          r"byte 0xe9 at offset 24 is not utf-8 text \(invalid "
                                          r"continuation byte\); save the file as UTF-8"):
        load_config(latin1)


@pytest.mark.parametrize("key", ["data.reward_timeout", "data.reward_fn_timeout",
                                 "data.code_timeout", "train.dist_timeout_s"])
@pytest.mark.parametrize("value", ["inf", "1e10"])
def test_a_timeout_no_timer_can_wait_is_one_line_naming_the_field(key, value):
    # "no limit" written as inf broke each once the run had started: a traceback from
    # threading's join (reward_fn_timeout, 1e10 too), every math answer failing as if the data
    # were wrong (1e10 too), every program failing to start in the sandbox, timedelta under
    # torchrun; a day is the longest each takes
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be in [(\[]0, 86400\], got "
                                          rf"{float(value)!r}"):
        load_config(overrides=[f"{key}={value}"])
    assert getattr(load_config(overrides=[f"{key}=86400"]), key.split(".")[0]).__dict__[
        key.split(".")[1]] == 86400.0


def test_help_says_that_keep_last_0_keeps_every_checkpoint():
    # what checkpoint._prune does with 0 (test_checkpoint.py: test_keep_last_zero_keeps_all);
    # the help said only "older ones are deleted", so 0 read as "keep none"
    from gspo.config import TrainConfig

    keep_last = next(f for f in dataclasses.fields(TrainConfig) if f.name == "keep_last")
    assert "0 = keep every one" in keep_last.metadata["help"]  # --help prints it (above)
