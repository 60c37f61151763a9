#!/usr/bin/env bash
# A kernel experiment in one call: carry nothing, or with FLASH=1 (quack-kernels' GEMMs among the candidates) the
# FlashAttention-4 wheel set in two calls (`bash benchmarks/fetch_device_wheels.sh` here first):
#
#   call 1: carry [".whl_flash/call1"]   bash benchmarks/device_flash.sh stage
#   call 2: carry [".whl_flash/call2"]   FLASH=1 PHYAI_GYM_COMMIT=<sha> timeout 560 bash benchmarks/device_kernels.sh; \
#                                        cd $OUT && tar czf kernels.tgz kernels
#
# The CUDA tests of the kernels (unless TESTS=0), then the gpu_suite sections in $SECTIONS (default: `geglu_variants`, the candidate
# schedules of the LM's gate/up + GeGLU GEMM against the shipped kernel, cuBLAS and quack's), each timed out on its own
# ($SECTION_TIMEOUT, default 300 s) and logged under $OUT/kernels.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="$OUT/kernels"
mkdir -p "$DIR"
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT"
if [ "${FLASH:-0}" = 1 ]; then  # install the staged wheels to /tmp/site, stop after the smoke test
    BENCH_TIMEOUT=0 TEST_TIMEOUT=0 OUT="$DIR/flash" bash benchmarks/device_flash.sh run > "$DIR/flash.log" 2>&1
    grep STATUS "$DIR/flash.log"
    export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$ROOT"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0: sections only
    timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/policies/pi05/test_kernels_cuda.py \
        tests/policies/pi05/test_scheduler_cuda.py > "$DIR/cuda_tests.log" 2>&1
    echo "STEP cuda tests rc=$? $(tail -1 "$DIR/cuda_tests.log")"
fi

for sec in ${SECTIONS:-geglu_variants}; do
    timeout "${SECTION_TIMEOUT:-300}" python3 -m benchmarks.gpu_suite --sections "$sec" --out "$DIR/$sec" > "$DIR/$sec.log" 2>&1
    echo "STEP $sec rc=$? $(grep -c . "$DIR/$sec.log") log lines"
done
