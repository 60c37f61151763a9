#!/usr/bin/env bash
# Prepares ManiSkill3 (+ SAPIEN, gymnasium, their missing dependencies, the Vulkan/EGL loader debs) for the GPU
# machine, which has no package index and takes at most 64 MiB per call (working tree included). Run it HERE
# (a machine with PyPI and Debian's packages), then make the two device calls it prints:
#
#   bash benchmarks/device_sims.sh [REPO_ROOT] [--wristcam]     (REPO_ROOT: the checkout the device calls send)
#
# Part A (REPO_ROOT/.sims/a, ~50 MiB): SAPIEN 3.0.3 cp312 + the loader debs. Call 1 copies it to /tmp/carry.
# Part B (REPO_ROOT/.sims/b, ~25 MiB): a trimmed mani_skill 3.0.1 (benchmarks/trim_maniskill_wheel.py: Panda and
# table assets only, ~12 MiB instead of ~97), gymnasium 1.4.0 and every runtime import of mani_skill/SAPIEN that
# the machine's image lacks (KINDS.md's package list). Call 2, within ~30 s while the machine is warm, carries B
# and runs benchmarks/run_maniskill_on_device.sh: installs A+B into /tmp/site and runs the GPU tests, the
# throughput benchmark and the PPO run. Only what ManiSkill imports at run time travels: GitPython, tyro, mplib
# and imageio-ffmpeg are declared by mani_skill but unused by the env API (checked with an import trace).
# Downloads are cached in ${SIMS_CACHE:-/tmp/phyai-sims-dl}. Idempotent.
# ManiSkill's GPU simulator also needs SAPIEN's PhysX GPU library (libPhysXGpu_64.so for PhysX
# 105.1-physx-5.3.1.patch0), which SAPIEN downloads from GitHub (sapien-sim/physx-precompiled, linux-so.zip) on
# first use; no package registry has it. Give it as PHYSX_GPU=/path/to/linux-so.zip (or the .so) and it travels
# in part B (or a part C of its own, with one more call); without it run_maniskill_on_device.sh falls back to
# CPU PhysX with GPU rendering.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT="$HERE"
WRISTCAM=()
for arg in "$@"; do
  case "$arg" in
    --wristcam) WRISTCAM=(--wristcam) ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) ROOT="$(cd "$arg" && pwd)" ;;
  esac
done
git -C "$ROOT" rev-parse --show-toplevel >/dev/null 2>&1 || { echo "device_sims: $ROOT is not a git checkout" >&2; exit 2; }
PYTHON="${PYTHON:-python3}"
CACHE="${SIMS_CACHE:-/tmp/phyai-sims-dl}"
A="$ROOT/.sims/a"
B="$ROOT/.sims/b"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux1_x86_64)
# Runtime imports of `gym.make("PickCube-v1", obs_mode="rgb")` + ManiSkillVectorEnv that the image lacks, at the
# versions tested here. IPython (mani_skill.utils.visualization imports it) brings its own closure, minus
# pygments, typing_extensions and psutil, which the image has.
PART_B=(gymnasium==1.4.0 farama-notifications==0.0.6 dacite==1.9.2 defusedxml==0.7.1 transforms3d==0.4.2
  trimesh==5.2.0 pytorch_kinematics==0.7.6 arm_pytorch_utilities==0.5.0 pytorch_seed==0.2.0
  ipython==9.18.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 parso==0.8.7 traitlets==5.16.1
  prompt_toolkit==3.0.53 wcwidth==0.9.4 pexpect==4.9.0 ptyprocess==0.7.0 stack_data==0.6.3 asttokens==3.0.2
  executing==2.3.0 pure_eval==0.2.4 matplotlib_inline==0.2.2)
DEBS=(libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)

mkdir -p "$CACHE/whl" "$CACHE/trim" "$CACHE/gl" "$A" "$B"
# keep .sims/ out of git in REPO_ROOT (the device calls carry it as an ignored path)
if ! git -C "$ROOT" check-ignore -q .sims/a/probe; then
  exclude="$(git -C "$ROOT" rev-parse --path-format=absolute --git-path info/exclude)"
  mkdir -p "$(dirname "$exclude")"
  echo "/.sims/" >>"$exclude"
  echo "[device_sims] added /.sims/ to $exclude"
fi

echo "[device_sims] wheels -> $CACHE/whl"
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps "${PLAT[@]}" -d "$CACHE/whl" \
  mani_skill==3.0.1 sapien==3.0.3 "${PART_B[@]}" 2>&1 | grep -v "^WARNING: Location" || true
"$PYTHON" "$HERE/benchmarks/trim_maniskill_wheel.py" "$CACHE/whl/mani_skill-3.0.1-py3-none-any.whl" \
  -o "$CACHE/trim" "${WRISTCAM[@]}"

echo "[device_sims] Vulkan/EGL loader debs -> $CACHE/gl"
if ! ls "$CACHE"/gl/libvulkan1_*.deb >/dev/null 2>&1; then
  mkdir -p /tmp/amd64/partial
  o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64)
  apt-get "${o[@]}" update -qq
  (cd "$CACHE/gl" && apt-get "${o[@]}" download "${DEBS[@]}" 2>&1 | grep -v "unsandboxed" || true)
fi

rm -rf "$A" "$B"
mkdir -p "$A/gl" "$B"
cp "$CACHE"/whl/sapien-3.0.3-*.whl "$A/"
cp "$CACHE"/gl/*.deb "$A/gl/"
cp "$CACHE"/trim/mani_skill-3.0.1-*.whl "$B/"
for spec in "${PART_B[@]}"; do
  name="${spec%%==*}"; version="${spec##*==}"
  pattern="$(echo "$name" | tr '-' '_')-${version}-*.whl"
  found=$(find "$CACHE/whl" -maxdepth 1 -iname "$pattern" | head -1)
  [[ -n "$found" ]] || { echo "device_sims: no wheel for $spec in $CACHE/whl" >&2; exit 1; }
  cp "$found" "$B/"
done

mib() { du -sm "$1" | cut -f1; }
C="$ROOT/.sims/c"
rm -rf "$C"
PHYSX_PART=""
if [[ -n "${PHYSX_GPU:-}" ]]; then
  [[ -f "$PHYSX_GPU" ]] || { echo "device_sims: PHYSX_GPU=$PHYSX_GPU is not a file" >&2; exit 2; }
  need=$(( ($(stat -c %s "$PHYSX_GPU") + 1048575) / 1048576 ))
  if (( $(mib "$B") + need + 6 < 62 )); then PHYSX_PART="$B"; else PHYSX_PART="$C"; fi
  mkdir -p "$PHYSX_PART/physx" && cp "$PHYSX_GPU" "$PHYSX_PART/physx/"
  echo "[device_sims] PhysX GPU library ($need MiB) -> ${PHYSX_PART#"$ROOT"/}/physx"
fi
tree_mib=$(( ($(git -C "$ROOT" ls-files -z --cached --others --exclude-standard | (cd "$ROOT" && xargs -0 -r stat -c %s 2>/dev/null) | awk '{s+=$1} END{print s+0}') + 1048575) / 1048576 ))
echo "[device_sims] part A $(mib "$A") MiB, part B $(mib "$B") MiB, working tree ~${tree_mib} MiB (limit 64 MiB per call)"
for part in "$A" "$B" ${PHYSX_PART:+"$PHYSX_PART"}; do
  total=$(( $(mib "$part") + tree_mib ))
  (( total < 62 )) || { echo "device_sims: $part + the working tree = $total MiB, over the 64 MiB carry limit" >&2; exit 1; }
done

commit="$(git -C "$ROOT" rev-parse --short HEAD)"
cat <<EOF

[device_sims] ready. Make the two calls back to back (call 2 within ~30 s, while the machine is warm):

call 1: carry [".sims/a"]
  mkdir -p /tmp/carry && cp -r .sims/a/. /tmp/carry/ && ls /tmp/carry /tmp/carry/gl && nvidia-smi -L

$( [[ "$PHYSX_PART" == "$C" ]] && printf '%s\n%s\n\n' 'call 1b: carry [".sims/c"]   (right after call 1)' \
  '  mkdir -p /tmp/carry/physx && cp .sims/c/physx/* /tmp/carry/physx/ && ls -la /tmp/carry/physx' )
call 2: carry [".sims/b"]
  set -o pipefail; PHYAI_GYM_COMMIT=$commit bash benchmarks/run_maniskill_on_device.sh 2>&1 | tee \$OUT/device.log

(PHYAI_GYM_COMMIT is REPO_ROOT's HEAD now: commit first, or edit it. If call 2 says /tmp/carry is missing, the
machine went cold: make call 1 again, then call 2. Results: \$OUT/maniskill.jsonl, pytest_maniskill_gpu.log,
ppo.csv, device.log; commit the rows under benchmarks/results/.)
EOF
