"""Reward models: `data.reward=model:PATH` scores completions with a sequence-classification
checkpoint, as TRL's GRPOTrainer does with an `AutoModelForSequenceClassification` among its
reward functions.

The text scored is what TRL 1.16 scores: the prompt and the completion through the reward
model's own tokenizer. With a chat template the whole conversation is rendered (system turn
`data.system_prompt` where set, the user turn as the policy saw it, the completion as the
assistant turn; no generation prompt), without one prompt and completion are joined as they
are; tokenized without special tokens (the template holds them) and padded on the right. The
classifier pools the last token that is not padding, so the padding token is set in the model's
config, as TRL does; right padding keeps every real token's position as in a batch of one (left
padding would shift them in a model that takes positions from the index, not the mask). The
reward is the logit of the head's one label.

Where gspo differs from TRL: TRL renders the chat template when the dataset's prompts are
conversations (and fails when the reward tokenizer has no template); gspo's prompts are text, so
the reward tokenizer decides. A head with several labels is refused (TRL loads every reward
model with num_labels=1, which fails on a checkpoint saved with more).

It is a batched reward (see gspo.data.score): `batch(completions, rows)` scores up to
`batch_size` (data.reward_batch_size) completions in one forward pass on data.reward_device in
data.reward_dtype. Building one reads and checks the config and tokenizer (a run's start and
the dry run fail there); the weights are read by `prepare`, before the first batch is scored, so
the dry run never reads them.
"""

from __future__ import annotations

import hashlib
import os
import threading

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from gspo.errors import ConfigError, ModelLoadError, first_line
from gspo.hub import cached_snapshot, hub_unreachable, in_hub_cache
from gspo.models import TOKENIZER_FILES
from gspo.rewards import MODEL_PREFIX

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class RewardModel:
    """A sequence-classification reward model as a batched reward:
    `batch(completions, rows) -> list[float]`, each row holding its 'prompt'. Built from
    data.reward=model:PATH and the data.reward_* settings, or from Python (`reward_fn=` of
    `gspo.train`, alone or in a list), where `system_prompt` should be data.system_prompt."""

    def __init__(self, path: str, *, device: str = "cpu", dtype: str = "auto",
                 batch_size: int = 16, system_prompt: str = ""):
        self.path, self.device_spec, self.dtype_spec = path, device, dtype
        self.batch_size, self.system_prompt = batch_size, system_prompt
        self.__name__ = MODEL_PREFIX + path  # how messages and logs name it
        self.source = _locate(path)
        self.config = _classifier_config(self.source, self.__name__)
        self.tokenizer = _tokenizer(self.source, self.__name__)
        self.model, self.device = None, None
        self._lock = threading.Lock()  # the sampler's thread and the trainer's may both score

    def describe(self) -> str:
        """One line for the dry run: what was checked, and how it will score."""
        template = ("its chat template" if getattr(self.tokenizer, "chat_template", None)
                    else "prompt + completion as text (no chat template)")
        with torch.device("meta"):  # counted on the meta device: no memory, no weights read
            n = sum(p.numel() for p in
                    AutoModelForSequenceClassification.from_config(self.config).parameters())
        return (f"{self.__name__}: {', '.join(self.config.architectures)} of {n:,} "
                f"parameters, 1 label, scores "
                f"{template} in batches of {self.batch_size} on {self.device_spec} "
                f"(checked from its config and tokenizer, no weights read)")

    def text(self, completion: str, prompt: str) -> str:
        """What the reward model reads for one completion to `prompt` (the user turn)."""
        if not getattr(self.tokenizer, "chat_template", None):
            return prompt + completion
        messages = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": completion}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def prepare(self) -> None:
        """Read the weights onto the device, once (gspo.data.score calls this before the first
        batch, outside the per-call timeout). A failure is a ModelLoadError: no batch could
        score."""
        with self._lock:
            if self.model is not None:
                return
            device = reward_device(self.device_spec)
            dtype = (getattr(torch, self.dtype_spec) if self.dtype_spec != "auto"
                     else torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported()
                     else torch.float32)
            try:
                model = AutoModelForSequenceClassification.from_pretrained(self.source,
                                                                           dtype=dtype)
            except (OSError, ValueError, KeyError, RuntimeError, ImportError) as err:
                raise ModelLoadError(f"could not load the reward model {self.__name__} "
                                     f"({first_line(err, None)}); check the checkpoint's weights"
                                     ) from err
            # the classifier pools the last token that is not this one (TRL sets it alike)
            model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
            self.model = model.to(device).eval().requires_grad_(False)
            self.device = device

    def batch(self, completions: list[str], rows: list[dict]) -> list[float]:
        """The reward of each completion to its row's prompt, in one forward pass."""
        self.prepare()
        texts = [self.text(c, row["prompt"]) for c, row in zip(completions, rows)]
        inputs = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False).to(self.device)
        # the training step may run under autocast; the reward model keeps its own dtype
        with torch.inference_mode(), torch.autocast(self.device.type, enabled=False):
            logits = self.model(input_ids=inputs["input_ids"],
                                attention_mask=inputs["attention_mask"]).logits  # (B, 1)
        return logits[:, 0].float().tolist()

    def close(self) -> None:
        """Free the weights; the next batch reads them again."""
        with self._lock:
            on_gpu = self.device is not None and self.device.type == "cuda"
            self.model = self.device = None
        if on_gpu:
            torch.cuda.empty_cache()


def reward_device(spec: str) -> torch.device:
    """data.reward_device as a device: 'cuda' (and 'auto' where CUDA is) is this rank's GPU,
    cuda:LOCAL_RANK, as train.device's is."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"data.reward_device={spec} but this torch ({torch.__version__}) "
                              f"sees no CUDA device; use data.reward_device=cpu")
        if spec == "cuda":
            spec = f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % torch.cuda.device_count()}"
        if int(spec.split(":")[1]) >= torch.cuda.device_count():
            raise ConfigError(f"data.reward_device={spec}, but only {torch.cuda.device_count()} "
                              f"CUDA device(s) are visible")
    return torch.device(spec)


def _locate(path: str) -> str:
    """What from_pretrained loads model:PATH from: the local directory, or the hub id where it
    is cached or the hub can be reached (a ConfigError at once, not after the hub's retries)."""
    local = os.path.expanduser(path)
    what = f"data.reward {MODEL_PREFIX}{path}"
    if os.path.isdir(local):
        return local
    if os.path.exists(local):
        raise ConfigError(f"{what}: '{path}' is a file; give the directory the reward model "
                          f"and its tokenizer were saved to (save_pretrained)")
    if not in_hub_cache(path):
        why = hub_unreachable()
        if why:
            raise ConfigError(f"{what}: '{path}' is neither a local directory nor in the Hugging "
                              f"Face cache, and {why}; give a local reward model directory")
    return path


def _classifier_config(source: str, name: str):
    """The checkpoint's config, which must be a 1-label sequence classifier's."""
    what = f"data.reward {name}"
    config = _load(AutoConfig, source, what, "config", ("config.json",),
                   "it is no saved model; give the directory model.save_pretrained(DIR) wrote")
    archs = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        held = f"a {', '.join(archs)}" if archs else "a config that names no architecture"
        raise ConfigError(f"{what}: it holds {held}, not a sequence classifier; a reward model "
                          f"is an AutoModelForSequenceClassification checkpoint with one label "
                          f"(e.g. trained with TRL's RewardTrainer)")
    if config.num_labels != 1:
        raise ConfigError(f"{what}: its classifier head has {config.num_labels} labels "
                          f"(num_labels={config.num_labels}), and a reward model scores with "
                          f"one, whose logit is the reward; use a reward model saved with "
                          f"num_labels=1")
    if os.path.isdir(source) and not any(os.path.isfile(os.path.join(source, f))
                                         for f in WEIGHT_FILES):
        raise ConfigError(f"{what}: {source} has no weights ({', '.join(WEIGHT_FILES[:3])}); "
                          f"save the model there with save_pretrained")
    return config


def _tokenizer(source: str, name: str):
    """The reward model's tokenizer, padding with eos where it has no pad token (as TRL)."""
    what = f"data.reward {name}"
    tokenizer = _load(AutoTokenizer, source, what, "tokenizer", TOKENIZER_FILES,
                      "save the reward model's tokenizer beside it (tokenizer.save_pretrained)")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"{what}: its tokenizer has neither a pad nor an eos token, so "
                              f"a batch cannot be padded; set one and save it again")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load(auto_class, source: str, what: str, thing: str, files: tuple[str, ...], fix: str):
    """auto_class.from_pretrained(source), where a local directory must hold one of `files`:
    one ConfigError line naming what is missing or unreadable otherwise."""
    if os.path.isdir(source) and not any(os.path.isfile(os.path.join(source, f)) for f in files):
        raise ConfigError(f"{what}: {source} has no {thing} files ({', '.join(files[:2])}); "
                          f"{fix}")
    try:
        return auto_class.from_pretrained(source)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"{what}: cannot load its {thing} ({first_line(err, None)})") from None


_FINGERPRINTS: dict[tuple, str] = {}


def fingerprint(path: str) -> str | None:
    """SHA-256 of the reward model's files (its directory's, or a hub id's cached snapshot's):
    what a checkpoint records and a resume compares. None where no copy is on this machine.
    Hashed once per process for the same files (sizes and modification times)."""
    local = os.path.expanduser(path)
    folder = local if os.path.isdir(local) else cached_snapshot(path)
    if folder is None:
        return None
    files = sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f)))
    stats = tuple((f, os.stat(os.path.join(folder, f)).st_size,
                   os.stat(os.path.join(folder, f)).st_mtime_ns) for f in files)
    key = (os.path.realpath(folder), stats)
    if key not in _FINGERPRINTS:
        h = hashlib.sha256()
        for f in files:
            h.update(f.encode() + b"\0")
            with open(os.path.join(folder, f), "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            h.update(b"\0")
        _FINGERPRINTS[key] = h.hexdigest()
    return _FINGERPRINTS[key]
