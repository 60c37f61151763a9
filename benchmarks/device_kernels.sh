#!/usr/bin/env bash
# A kernel experiment in one call (no wheels needed): carry nothing
#
#   PHYAI_GYM_COMMIT=<sha> timeout 560 bash benchmarks/device_kernels.sh; cd $OUT && tar czf kernels.tgz kernels
#
# The CUDA tests of the kernels, then the gpu_suite sections in $SECTIONS (default: `geglu_variants`, the candidate
# schedules of the LM's gate/up + GeGLU GEMM against the shipped kernel and cuBLAS), each timed out on its own
# ($SECTION_TIMEOUT, default 300 s) and logged under $OUT/kernels.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="$OUT/kernels"
mkdir -p "$DIR"
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/policies/pi05/test_kernels_cuda.py \
    tests/policies/pi05/test_scheduler_cuda.py > "$DIR/cuda_tests.log" 2>&1
echo "STEP cuda tests rc=$? $(tail -1 "$DIR/cuda_tests.log")"

for sec in ${SECTIONS:-geglu_variants}; do
    timeout "${SECTION_TIMEOUT:-300}" python3 -m benchmarks.gpu_suite --sections "$sec" --out "$DIR/$sec" > "$DIR/$sec.log" 2>&1
    echo "STEP $sec rc=$? $(grep -c . "$DIR/$sec.log") log lines"
done
