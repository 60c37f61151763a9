#!/usr/bin/env bash
# The final-commit campaign in ONE call, without FlashAttention-4 (when a second, consecutive call for its wheels
# cannot be counted on): carry [".whl"]
#
#   PHYAI_GYM_COMMIT=<sha> timeout 420 bash benchmarks/device_noflash.sh; cd $OUT && tar czf final.tgz final
#
# Every CUDA test, the policy target rows, the PPO example's iteration row, the per-kernel profiles; each step
# timed out on its own and logged under $OUT/final.
set -u
. "$(dirname "$0")/device_gym.sh" final

timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests/policies tests/wrappers > "$DIR/cuda_tests.log" 2>&1
echo "STEP cuda tests rc=$? $(tail -1 "$DIR/cuda_tests.log")"

timeout 110 python3 -m benchmarks.gpu_suite --sections policy_targets --out "$DIR/policy" > "$DIR/policy.log" 2>&1
echo "STEP policy rc=$?"

timeout 120 python3 -m benchmarks.bench_ppo --which iteration --out "$DIR" > "$DIR/ppo.log" 2>&1
echo "STEP ppo rc=$? $(grep -ho '"final_success_deterministic": [0-9.]*' "$DIR/ppo_iteration.jsonl" 2>/dev/null)"

timeout 60 python3 -m benchmarks.gpu_suite --sections profile_targets --out "$DIR/profile" > "$DIR/profile.log" 2>&1
echo "STEP profile rc=$?"
