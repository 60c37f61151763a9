#!/usr/bin/env bash
# FlashAttention-4 on the GPU machine in two calls (the wheel set is ~103 MB, a call carries at most 64 MiB).
#
#   call 1: carry [".whl_flash/call1"]   bash benchmarks/device_flash.sh stage
#   call 2: carry [".whl_flash/call2"]   bash benchmarks/device_flash.sh run
#
# `.whl_flash/` (git-ignored) holds the wheels: call1/ the first 50,000,000 bytes of
# nvidia_cutlass_dsl_libs_cu13-4.8.1 (.part00), call2/ the rest (.part01) and the small wheels; SHA256SUMS in both.
# `stage` copies the parts it has to /tmp/flash_parts. `run` copies its own, reassembles with cat, checks the sums,
# installs to /tmp/site, puts nvidia_cutlass_dsl/dsl_packages on PYTHONPATH (a --target folder does not read .pth
# files), then: smoke import, one tiny attention, benchmarks.bench_attention_backend, the flash CUDA tests.
# Each step is timed out and its failure recorded (STATUS lines, $OUT/device_flash_status.txt); nothing aborts the
# rest; BENCH_TIMEOUT=0 stops after the smoke test. Idempotent: parts already in /tmp/flash_parts and an install
# already in /tmp/site are reused.
set -u
MODE="${1:-run}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/flash_out}"
PARTS=/tmp/flash_parts
WHEELS=/tmp/flash_wheels
SITE=/tmp/site
PY="${PYTHON:-python3}"
mkdir -p "$OUT" "$PARTS" "$WHEELS"
status() { echo "STATUS $*" | tee -a "$OUT/device_flash_status.txt"; }

copy_parts() {
    local found=0
    for dir in "$ROOT"/.whl_flash/call1 "$ROOT"/.whl_flash/call2; do
        [ -d "$dir" ] || continue
        cp -f "$dir"/* "$PARTS"/ && found=1
    done
    [ "$found" = 1 ] && status "staged: $(ls "$PARTS" | tr '\n' ' ')" || status "staged: nothing carried (.whl_flash/call1 or call2 missing)"
}

if [ "$MODE" = stage ]; then
    copy_parts
    ls -l "$PARTS"
    exit 0
fi

copy_parts
cd "$WHEELS" || exit 1
for first in "$PARTS"/*.part00; do  # reassemble every split wheel
    [ -e "$first" ] || break
    name="$(basename "${first%.part00}")"
    if cat "$PARTS/$name".part?? > "$WHEELS/$name"; then status "reassembled $name ($(stat -c %s "$WHEELS/$name") bytes)"; fi
done
cp -f "$PARTS"/*.whl "$WHEELS"/ 2>/dev/null
if sha256sum -c "$PARTS/SHA256SUMS" > "$OUT/sha256.txt" 2>&1; then
    status "sha256 ok"
else
    status "sha256 FAILED: $(grep -v ': OK' "$OUT/sha256.txt" | tr '\n' ' ') (call 1 run on this machine? /tmp is per machine)"
fi

if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl > "$OUT/pip.log" 2>&1; then
    status "installed to $SITE"
else
    status "pip install FAILED: $(tail -3 "$OUT/pip.log" | tr '\n' ' ')"
fi
export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_cache
cd "$ROOT" || exit 1
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>&1 | sed 's/^/gpu: /'

timeout 120 "$PY" - > "$OUT/smoke.log" 2>&1 <<'EOF'
import importlib.metadata as md, torch
for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl-libs-cu13",
             "quack-kernels", "apache-tvm-ffi", "cuda-bindings"):
    try:
        print("version", dist, md.version(dist))
    except md.PackageNotFoundError:
        print("version", dist, "MISSING")
import cutlass, cutlass.cute
print("cutlass.cute ok", cutlass.__file__)
import flash_attn.cute
from flash_attn.cute import flash_attn_func
q = torch.randn(1, 64, 8, 256, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 64, 1, 256, device="cuda", dtype=torch.bfloat16)
out, _ = flash_attn_func(q, k, k, softmax_scale=256**-0.5)
ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                                       k.transpose(1, 2).float(), enable_gqa=True).transpose(1, 2)
err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
print("tiny attention (1, 64, 8/1 heads, 256) max_rel_err", err)
from policies.pi05 import attention
print("flash_device_status", attention.flash_device_status(torch.device("cuda")))
for geo in ((16, 16, 72, False), (8, 1, 256, True)):
    print("probe", geo, attention.flash_probe_result(torch.device("cuda"), torch.bfloat16, *geo))
EOF
rc=$?; cat "$OUT/smoke.log" | tail -20; status "smoke rc=$rc: $(grep -E 'max_rel_err|Error|error' "$OUT/smoke.log" | tail -2 | tr '\n' ' ')"

[ "${BENCH_TIMEOUT:-300}" -gt 0 ] || { status "bench and flash tests skipped (BENCH_TIMEOUT=0)"; exit 0; }
timeout "${BENCH_TIMEOUT:-300}" "$PY" -m benchmarks.bench_attention_backend --out "$OUT" > "$OUT/bench.log" 2>&1
rc=$?; status "bench rc=$rc ($(grep -c '"bench": "attention_backend"' "$OUT/bench.log") rows in $OUT/attention_backend.jsonl)"
"$PY" - "$OUT/attention_backend.jsonl" <<'EOF' 2>&1 | tee "$OUT/bench_table.txt"
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except OSError as err:
    sys.exit(f"no rows: {err}")
for r in rows:
    print(r.get("site"), r.get("case"), r.get("env_batch"), r.get("backend"), r.get("status", "")[:90], "|",
          r.get("kernel"), "| err", r.get("max_rel_err"), "| us", r.get("us_per_call"), r.get("timing", ""))
EOF

timeout "${TEST_TIMEOUT:-120}" "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/policies/pi05/test_attention_flash_cuda.py tests/policies/pi05/test_attention.py > "$OUT/pytest_flash.log" 2>&1
rc=$?; status "cuda tests rc=$rc: $(tail -1 "$OUT/pytest_flash.log")"
exit 0
