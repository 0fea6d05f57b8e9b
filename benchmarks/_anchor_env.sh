#!/usr/bin/env bash
# Builds .venv-bench: a separate, git-ignored venv for the anchor benchmarks.
# MosaicML Streaming and LitData pull torchvision, which must never land in .venv.
# torch/torchvision are pinned to the wheels on local disk (see /etc/xdg/pip caps) so pip
# never fetches a multi-GB CUDA build. Re-running is cheap: pip skips what is installed.
# Usage: bash benchmarks/_anchor_env.sh   (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-bench
PY=${PYTHON:-python3}
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.14.1 torchvision==0.29.1
# The constraint keeps the anchors from replacing torch with another build.
CONS=$(mktemp)
trap 'rm -f "$CONS"' EXIT
printf 'torch==2.14.1\ntorchvision==0.29.1\n' >"$CONS"
"$VENV/bin/pip" install -q -c "$CONS" mosaicml-streaming litdata webdataset numpy xxhash \
    fsspec tokenizers tqdm s3fs "moto[server]" s3torchconnector tenacity
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import torch, streaming, litdata, webdataset, s3torchconnector; print('bench venv ok: torch', torch.__version__)"
