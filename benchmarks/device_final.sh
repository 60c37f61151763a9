#!/usr/bin/env bash
# The final-commit campaign on the GPU machine in one call, after `device_flash.sh stage` (call 1):
#
#   call 2: carry [".whl", ".whl_flash/call2"]
#           PHYAI_GYM_COMMIT=<sha> timeout 560 bash benchmarks/device_final.sh; cd $OUT && tar czf final.tgz final
#
# In order, each step timed out on its own and logged under $OUT/final: FlashAttention-4 installed
# (`device_flash.sh run` up to its smoke test; ATTENTION_BENCH=1 adds its attention rows and flash tests), every
# CUDA test with it installed (its own tests included), the policy target rows, the PPO example's iteration row,
# and with PROFILE=1 the per-kernel profiles (`profile_targets`).
# Tar $OUT/final afterwards: a call brings back at most 8 files.
set -u
. "$(dirname "$0")/device_gym.sh" final

if [ "${ATTENTION_BENCH:-0}" = 1 ]; then bench=90; else bench=0; fi
BENCH_TIMEOUT=$bench TEST_TIMEOUT=70 OUT="$DIR/flash" bash benchmarks/device_flash.sh run > "$DIR/flash.log" 2>&1
grep STATUS "$DIR/flash.log"
export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$ROOT"
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_cache

timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/policies tests/wrappers > "$DIR/cuda_tests.log" 2>&1
echo "STEP cuda tests rc=$? $(tail -1 "$DIR/cuda_tests.log")"

timeout 110 python3 -m benchmarks.gpu_suite --sections policy_targets --out "$DIR/policy_flash" > "$DIR/policy.log" 2>&1
echo "STEP policy (flash installed) rc=$?"

timeout 140 python3 -m benchmarks.bench_ppo --which iteration --out "$DIR" > "$DIR/ppo.log" 2>&1
echo "STEP ppo rc=$? $(grep -ho '"final_success_deterministic": [0-9.]*' "$DIR/ppo_iteration.jsonl" 2>/dev/null)"

if [ "${PROFILE:-0}" = 1 ]; then
    timeout 60 python3 -m benchmarks.gpu_suite --sections profile_targets --out "$DIR/profile_flash" > "$DIR/profile.log" 2>&1
    echo "STEP profile (flash installed) rc=$?"
fi
