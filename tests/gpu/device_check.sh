#!/usr/bin/env bash
# Every GPU check in one run, for a machine with a CUDA or ROCm GPU whose python3 already holds torch, triton,
# transformers and pytest (nothing is installed from a registry):
#   1. pytest tests/gpu (the Triton kernels compiled natively against the torch reference; the whole engine
#      against transformers);
#   2. bench/moe_kernel.py: the Triton fused-MoE MLP against the torch reference, at Qwen3-Coder's and GPT-OSS's
#      expert shapes;
#   3. bench/prefix_ttft.py: cold and cached time to first token of the `small` preset on the GPU, with the
#      Triton backend (the GPU's default) and with the torch backend;
#   4. bench/engine_throughput.py and bench/moe_throughput.py --quick: the engine against transformers, both on
#      the GPU;
#   5. bench/decode_step.py: one decode step's time with CUDA graphs, without, and transformers'.
# Each step's log, whose last line is the benchmark's JSON, lands in OUT_DIR beside machine.txt.
# Each step has its own time limit, and a failed step does not stop the later ones.
#
#   bash tests/gpu/device_check.sh OUT_DIR [WHEEL_DIR]
#
# WHEEL_DIR: wheels of the packages that machine lacks (llguidance, for the guided-decoding test), installed
# into a scratch folder first. The exit status is the number of failed steps.
set -u
out=${1:?usage: device_check.sh OUT_DIR [WHEEL_DIR]}
wheels=${2:-}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

# The repository root is the package: import it as rayturn through a link.
site=$(mktemp -d)
ln -s "$root" "$site/rayturn"
if [ -n "$wheels" ] && compgen -G "$wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

failed=0
step() {  # step NAME LIMIT_S COMMAND...: run, log to $out/NAME.log, count a failure
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s"
    tail -n 25 "$out/$name.log"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

cd "$root" || exit 99
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "device", torch.cuda.get_device_name())'
    lscpu | grep -m1 "Model name"
} | tee "$out/machine.txt"

step gpu_tests 240 python3 -m pytest -v -p no:cacheprovider -rfE --durations=15 tests/gpu
step moe_kernel 60 python3 bench/moe_kernel.py --out "$site/moe_kernel"
step prefix_ttft 60 python3 bench/prefix_ttft.py --out "$site/prefix_ttft"
step prefix_ttft_torch 60 python3 bench/prefix_ttft.py --backend torch --out "$site/prefix_ttft_torch"
step engine_throughput 90 python3 bench/engine_throughput.py --quick --out "$site/engine_throughput"
step moe_throughput 90 python3 bench/moe_throughput.py --quick --out "$site/moe_throughput"
step decode_step 90 python3 bench/decode_step.py --out "$site/decode_step"
echo "== failed steps: $failed"
exit "$failed"
