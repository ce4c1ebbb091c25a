"""gspo's public API: every name in gspo.__all__ resolves, and everything benchmarks/,
experiments/ and scripts/ import from gspo is declared there (so the API cannot drift from its
users)."""

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gspo

ROOT = Path(__file__).resolve().parents[1]


def _python_sources(folder: Path) -> list[str]:
    """The .py files under folder, and the Python its shell scripts feed python on stdin
    (`"$PY" - <<'PYEOF'` ... `PYEOF`)."""
    sources = [path.read_text() for path in folder.rglob("*.py")]
    for path in folder.rglob("*.sh"):
        sources += re.findall(r"<<'(PY\w*)'\n(.*?)\n\1\n", path.read_text(), re.S)
    return [s if isinstance(s, str) else s[1] for s in sources]


def _imports_from_gspo(folder: Path) -> set[tuple[str, str]]:
    found = set()
    for source in _python_sources(folder):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gspo":
                found |= {(node.module, a.name) for a in node.names}
    return found


def _module_imports(folder: Path) -> set[str]:
    """`import gspo.trainer` and the like: a module object through which a script could call
    internals or replace the module's globals."""
    return {a.name for source in _python_sources(folder) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Import) for a in node.names if a.name.startswith("gspo.")}


@pytest.mark.parametrize("name", gspo.__all__)
def test_each_public_name_is_the_defining_modules_object(name):
    assert getattr(gspo, name) is getattr(importlib.import_module(gspo._API[name]), name)


@pytest.mark.parametrize("folder", ["benchmarks", "experiments", "scripts"])
def test_what_the_scripts_import_is_public(folder):
    used = _imports_from_gspo(ROOT / folder)
    undeclared = sorted(f"{m}.{n}" for m, n in used if n not in gspo.__all__)
    assert not undeclared, f"declare these in gspo/__init__.py (_API): {undeclared}"


@pytest.mark.parametrize("folder", ["benchmarks", "experiments", "scripts"])
def test_the_scripts_import_no_gspo_module(folder):
    # benchmarks observe a run through gspo.Callback, not by patching gspo.trainer's globals
    assert not _module_imports(ROOT / folder)


def test_the_python_in_shell_scripts_is_checked_too():
    assert ("gspo", "rl_step") in _imports_from_gspo(ROOT / "scripts")


def test_import_gspo_stays_light():
    # the CLI imports the package first: torch and transformers load only when needed
    code = "import sys, gspo; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'trainn'"):
        gspo.trainn


def _readme_python_blocks() -> list[str]:
    """The ```python blocks of the README's "Python API" section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Python API"):]
    section = section[:section.index("\n## ", 1)]
    return [block.split("```", 1)[0] for block in section.split("```python\n")[1:]]


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_the_readme_python_example_runs(tmp_path):
    out = _run(_readme_python_blocks()[0], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("held-out accuracy ") and " -> " in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["0", "1", "2", "3"]
    assert (tmp_path / "runs" / "api-example" / "checkpoints" / "step_000003").is_dir()


def test_the_readme_example_with_a_python_reward_and_python_rows_runs(tmp_path):
    code = _readme_python_blocks()[1]
    assert "reward_fn=" in code and "train_data=" in code and len(code.splitlines()) <= 12
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("held-out accuracy ") and " -> " in out.stdout
    run = tmp_path / "runs" / "api-objects"
    assert (run / "checkpoints" / "step_000002").is_dir()
    import yaml
    data = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert data["path"] == "" and data["reward"] == ""  # the rows and reward came from Python


def test_the_readme_layout_matches_the_package_tree():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Layout"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    listed = {line.split()[0].rstrip("/") for line in section.splitlines()
              if line.strip().startswith("src/gspo/")}
    package = ROOT / "src" / "gspo"
    tree = {f"src/gspo/{p.name}" for p in package.iterdir()
            if (p.suffix == ".py" and p.name != "__main__.py") or (p / "__init__.py").is_file()}
    assert sorted(tree - listed) == [], "modules missing from the README's Layout section"
    assert sorted(listed - tree) == [], "the README's Layout section lists what is not there"


def test_the_readme_callback_example_prints_every_phase_of_every_step(tmp_path):
    code = _readme_python_blocks()[2]
    assert "callbacks=[" in code
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line.split(":")[0] for line in out.stdout.splitlines()]
    assert said == [f"step {s} {p}" for s in (0, 1) for p in ("rollout", "old_logp", "update")]
