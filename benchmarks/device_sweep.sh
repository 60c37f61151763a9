#!/usr/bin/env bash
# A sweep of the PPO example's flags on the GPU machine in one call: each argument is one flag set, run for every
# seed in $SEEDS (default "1 2"), two at a time (`bench_ppo --which seeds`), each set timed out on its own
# ($SET_TIMEOUT s, default 170) so that the others and the tar still run; with $ITERATION=1 the example's
# `ppo_iteration` row at the defaults runs first, alone (its timing is the one the README quotes). Carry [".whl"]:
#
#   PHYAI_GYM_COMMIT=<sha> bash benchmarks/device_sweep.sh "--target-kl 0.5" "--num-minibatches 1"
#
# Rows (ppo_iteration per seed, ppo_seeds per set, with each run's curve CSV) end up in $OUT/sweep.tgz.
set -u
. "$(dirname "$0")/device_gym.sh" sweep
if [ "${ITERATION:-0}" = 1 ]; then
    timeout 150 python3 -m benchmarks.bench_ppo --which iteration --out "$DIR/iteration" > "$DIR/iteration.log" 2>&1
    echo "ITERATION rc=$? $(grep -ho '"final_success_deterministic": [0-9.]*' "$DIR/iteration/ppo_iteration.jsonl" 2>/dev/null)"
fi
k=0
for flags in "$@"; do
    k=$((k + 1))
    # shellcheck disable=SC2086
    timeout "${SET_TIMEOUT:-170}" python3 -m benchmarks.bench_ppo --which seeds --seeds ${SEEDS:-1 2} \
        --flags="$flags" --out "$DIR/set$k" > "$DIR/set$k.log" 2>&1
    echo "SET $k [$flags] rc=$? $(grep -ho '"final_success_deterministic": \[[^]]*\]' "$DIR/set$k/ppo_seeds.jsonl" 2>/dev/null)"
done
cd "$OUT" && tar czf sweep.tgz sweep && rm -rf sweep
