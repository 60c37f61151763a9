#!/usr/bin/env bash
# A kernel experiment in one call (no wheels needed): carry nothing
#
#   PHYAI_GYM_COMMIT=<sha> timeout 560 bash benchmarks/device_kernels.sh; cd $OUT && tar czf kernels.tgz kernels
#
# The CUDA tests of the kernels and the attention backends, then the parts a kernel change can move, alone
# (`prefix_parts`: the GeGLU GEMM's launch geometries against cuBLAS + GeGLU), the Triton attention kernel's
# geometries at the vision tower's shapes (`attention_tune_vision`), and the full-size policy at case (a) and (b)
# batch 64 with the vision tower's attention on "auto" and on SDPA (`policy_vision_ab`, one run), then the
# per-kernel profiles of the policy targets. Each step timed out on its own and logged under $OUT/kernels.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="$OUT/kernels"
mkdir -p "$DIR"
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/policies/pi05/test_kernels_cuda.py \
    tests/policies/pi05/test_attention_flash_cuda.py tests/policies/pi05/test_scheduler_cuda.py > "$DIR/cuda_tests.log" 2>&1
echo "STEP cuda tests rc=$? $(tail -1 "$DIR/cuda_tests.log")"

for sec in prefix_parts attention_tune_vision policy_vision_ab profile_targets; do
    timeout "${SECTION_TIMEOUT:-110}" python3 -m benchmarks.gpu_suite --sections "$sec" --out "$DIR/$sec" > "$DIR/$sec.log" 2>&1
    echo "STEP $sec rc=$? $(grep -c . "$DIR/$sec.log") log lines"
done
