#!/usr/bin/env bash
# Sets up the Mooncake store (its transfer engine's non-CUDA build: the Python
# store client and the mooncake_master binary) in its own virtual environment
# outside the repository, as the peer of bench/kvstore_bandwidth.py
# (`--peer mooncake`). Never a dependency of rayturn or of its tests.
#
#   bash bench/peers/setup_mooncake.sh            # venv at ~/.cache/rayturn/peers/mooncake
#   RAYTURN_PEERS_DIR=/some/dir bash bench/peers/setup_mooncake.sh
#
# Its libraries link against libibverbs (RDMA), which a host without RDMA
# lacks: then that library and its libnl dependencies are fetched as Debian
# packages (`apt-get download`, nothing installed on the host) and unpacked
# into $VENV/syslib, which the benchmark puts on LD_LIBRARY_PATH.
# Idempotent: a stamp file records a finished setup.
set -euo pipefail

MOONCAKE_VERSION="0.3.13.post1"
PEERS_DIR="${RAYTURN_PEERS_DIR:-$HOME/.cache/rayturn/peers}"
VENV="$PEERS_DIR/mooncake"
STAMP="$VENV/.setup-mooncake-non-cuda-$MOONCAKE_VERSION"
PYTHON="${PYTHON:-python3}"

if [[ -f "$STAMP" ]]; then
    echo "mooncake peer: ready at $VENV"
    exit 0
fi

echo "mooncake peer: creating venv at $VENV"
mkdir -p "$PEERS_DIR"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip wheel

echo "mooncake peer: installing mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION and numpy"
"${PIP[@]}" install "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" numpy

SYSLIB="$VENV/syslib"
mkdir -p "$SYSLIB"
if ! ldconfig -p | grep -q "libibverbs.so.1 "; then
    echo "mooncake peer: no libibverbs on this host; unpacking libibverbs1, libnl-3-200, libnl-route-3-200 into $SYSLIB"
    DEBS="$(mktemp -d)"
    trap 'rm -rf "$DEBS"' EXIT
    (cd "$DEBS" && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200)
    for deb in "$DEBS"/*.deb; do
        dpkg-deb -x "$deb" "$DEBS/root"
    done
    find "$DEBS/root" -name "*.so*" -exec cp -a {} "$SYSLIB/" \;
fi

echo "mooncake peer: checking the store client and mooncake_master"
LD_LIBRARY_PATH="$SYSLIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$VENV/bin/python" -c "from mooncake.store import MooncakeDistributedStore; print('mooncake peer: store client imports')"
test -x "$VENV/bin/mooncake_master"
touch "$STAMP"
echo "mooncake peer: ready at $VENV"
