#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has torch, triton, numpy; no index) into the git-ignored folders the
# device scripts carry, for its Python 3.12 on x86_64:
#
#   bash benchmarks/fetch_device_wheels.sh      # on this machine, once per checkout
#
# .whl/                 gymnasium and its two dependencies (device_gym.sh installs them)
# .whl_flash/call1/     the first 50,000,000 bytes of nvidia_cutlass_dsl_libs_cu13 (.part00) + SHA256SUMS
# .whl_flash/call2/     the rest of it (.part01), FlashAttention-4, the CuTe DSL, quack-kernels and their small
#                       dependencies + SHA256SUMS: a call carries at most 64 MiB, so device_flash.sh stages call1 in
#                       /tmp in one call and the next call (within the ~30 s the machine stays warm) reassembles it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform any)
get() { python3 -m pip download -q --disable-pip-version-check --no-deps "${PLAT[@]}" -d "$1" "${@:2}"; }

mkdir -p .whl
get .whl gymnasium==1.4.0 farama-notifications==0.0.6 cloudpickle==3.1.3

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
get "$TMP" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
    apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops
rm -rf .whl_flash && mkdir -p .whl_flash/call1 .whl_flash/call2
(cd "$TMP" && sha256sum ./*.whl | sed 's#\./##' > SHA256SUMS)
big="$(basename "$TMP"/nvidia_cutlass_dsl_libs_cu13-*.whl)"
split -b 50000000 -d -a 2 "$TMP/$big" "$TMP/$big.part"
mv "$TMP/$big.part00" .whl_flash/call1/
mv "$TMP/$big.part01" .whl_flash/call2/
rm "$TMP/$big"
mv "$TMP"/*.whl .whl_flash/call2/
cp "$TMP/SHA256SUMS" .whl_flash/call1/
cp "$TMP/SHA256SUMS" .whl_flash/call2/
du -sh .whl .whl_flash/call1 .whl_flash/call2
