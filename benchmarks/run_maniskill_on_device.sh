#!/usr/bin/env bash
# The ManiSkill3-on-GPU campaign in one device call (call 2 of benchmarks/device_sims.sh), from the repo root:
#   set -o pipefail; bash benchmarks/run_maniskill_on_device.sh 2>&1 | tee $OUT/device.log
# Needs /tmp/carry (part A: SAPIEN + loader debs, left there by call 1) and .sims/b (part B, this call's carry).
# Installs both into /tmp/site, then runs, each under its own timeout and never failing the call:
#   1. a smoke test (import, one physx_cuda env, one rendered step),      -> stdout
#   2. the CUDA tests of the ManiSkill GPU path,                           -> $OUT/pytest_maniskill_gpu.log
#   3. benchmarks/bench_maniskill_gpu.py (rollout N sweep, device proof),  -> $OUT/maniskill.jsonl
#   4. examples/ppo_pi05.py on PickCube-v1 (3 iterations, N=64),           -> $OUT/maniskill.jsonl, ppo.csv
# Environment: MS_STEPS (which of smoke,tests,bench,ppo to run; default all), MS_BENCH_ARGS (extra flags).
set -u
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PHYAI_GYM_COMMIT="${PHYAI_GYM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
STEPS="${MS_STEPS:-smoke,tests,bench,ppo}"
want() { [[ ",$STEPS," == *",$1,"* ]]; }
T0=$(date +%s)
stamp() { echo "[run_maniskill $(( $(date +%s) - T0 ))s] $*"; }
# each step gets at most its cap and never more than what is left of MS_BUDGET_S (the call's 600 s limit)
BUDGET="${MS_BUDGET_S:-570}"
cap() { local left=$(( BUDGET - ($(date +%s) - T0) )); (( left < $1 )) && echo $(( left > 10 ? left : 10 )) || echo "$1"; }

if [[ ! -d /tmp/carry ]] || ! ls /tmp/carry/sapien-*.whl >/dev/null 2>&1; then
  echo "run_maniskill: /tmp/carry/sapien-*.whl is missing: the machine went cold after call 1 (or call 1 was not made)."
  echo "Fix: make call 1 (carry .sims/a) again, then this call within ~30 s."
  exit 3
fi
stamp "loaders"
for f in /tmp/carry/gl/*.deb; do [[ -f "$f" ]] && dpkg -x "$f" /; done
ldconfig
stamp "install -> /tmp/site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  /tmp/carry/*.whl .sims/b/*.whl || { echo "run_maniskill: pip install failed"; exit 4; }
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# SAPIEN renders through Vulkan: point the loader at the NVIDIA driver where the image keeps it.
for icd in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json \
  /etc/vulkan/icd.d/nvidia_icd.json; do
  if [[ -f "$icd" ]]; then export VK_ICD_FILENAMES="$icd" VK_DRIVER_FILES="$icd"; break; fi
done
egl=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
[[ -f "$egl" ]] && export __EGL_VENDOR_LIBRARY_FILENAMES="$egl"
export XDG_RUNTIME_DIR=/tmp/xdg && mkdir -p -m 700 /tmp/xdg
stamp "VK_ICD_FILENAMES=${VK_ICD_FILENAMES:-unset}; $(ldconfig -p | grep -c libvulkan) libvulkan entries"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# ManiSkill's GPU simulator needs SAPIEN's PhysX GPU library, which SAPIEN downloads from GitHub on first use (no
# network here). Take it from the carries (device_sims.sh PHYSX_GPU=...) if they hold it; else fall back to CPU
# PhysX in subprocesses with SAPIEN still rendering on the GPU (rows maniskill_cpusim_rollout; no PPO, no GPU tests).
SIM=gpu
if ! timeout 60 python3 - <<'EOF'
import pathlib, shutil, sys, zipfile
import sapien.physx as physx
target = pathlib.Path.home() / ".sapien" / "physx" / physx.version()
target.mkdir(parents=True, exist_ok=True)
for folder in (pathlib.Path("/tmp/carry/physx"), pathlib.Path(".sims/b/physx")):
    if (target / "libPhysXGpu_64.so").is_file():
        break
    for zipped in sorted(folder.glob("*.zip")):
        zipfile.ZipFile(zipped).extractall(target)
    if (folder / "libPhysXGpu_64.so").is_file():
        shutil.copy(folder / "libPhysXGpu_64.so", target)
found = (target / "libPhysXGpu_64.so").is_file()
print(f"PhysX GPU library {physx.version()}: {'found' if found else 'MISSING'} at {target}")
sys.exit(0 if found else 1)
EOF
then
  SIM=cpu
  echo "run_maniskill: BLOCKER: no libPhysXGpu_64.so, so no ManiSkill GPU simulation; falling back to CPU PhysX"
fi

if want smoke; then
  stamp "smoke"
  MS_SIM=$SIM timeout -k 5 "$(cap 60)" python3 - <<'EOF' || echo "run_maniskill: smoke test failed (rc=$?)"
import time, torch, gymnasium as gym, sapien, mani_skill, mani_skill.envs  # noqa: F401
print("sapien", sapien.__version__, "mani_skill", mani_skill.__version__, "torch", torch.__version__)
t = time.perf_counter()
import os
gpu = os.environ["MS_SIM"] == "gpu"
env = gym.make("PickCube-v1", num_envs=4 if gpu else 1, obs_mode="rgb", sim_backend="physx_cuda" if gpu else "physx_cpu",
               render_backend="gpu", control_mode="pd_ee_delta_pose", sensor_configs={"width": 224, "height": 224})
obs, _ = env.reset(seed=0)
obs, *_ = env.step(torch.zeros(env.action_space.shape, device=env.unwrapped.device))
rgb = obs["sensor_data"]["base_camera"]["rgb"]
print("smoke ok:", tuple(rgb.shape), rgb.dtype, rgb.device, "mean", float(rgb.float().mean()),
      f"{time.perf_counter() - t:.1f}s")
env.close()
EOF
fi
if want tests; then
  stamp "tests"
  timeout -k 5 "$(cap 120)" python3 -m pytest -q -m cuda -p no:cacheprovider tests/wrappers/adapters/test_maniskill_gpu.py \
    >"$OUT/pytest_maniskill_gpu.log" 2>&1
  echo "pytest rc=$?"; tail -5 "$OUT/pytest_maniskill_gpu.log"
fi
if want bench; then
  stamp "bench"
  # shellcheck disable=SC2086
  fallback=(); [[ $SIM == cpu ]] && fallback=(--sim-backend cpu --num-envs 16 --overlap-envs 16 --which rollout overlap)
  timeout -k 5 "$(cap 250)" python3 benchmarks/bench_maniskill_gpu.py --out "$OUT/maniskill.jsonl" ${fallback[@]+"${fallback[@]}"} \
    ${MS_BENCH_ARGS:-} \
    || echo "run_maniskill: bench rc=$?"
fi
if want ppo && [[ $SIM == cpu ]]; then
  echo "run_maniskill: PPO skipped: examples/ppo_pi05.py builds PickCube-v1 on the GPU simulator (no PhysX GPU library)"
elif want ppo; then
  stamp "ppo"
  timeout -k 5 "$(cap 170)" python3 benchmarks/bench_maniskill_gpu.py --which ppo --out "$OUT/maniskill.jsonl" \
    --ppo-csv "$OUT/ppo.csv" || echo "run_maniskill: ppo rc=$?"
fi
stamp "done"
exit 0
