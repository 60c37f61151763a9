#!/usr/bin/env bash
# LeRobot PI0.5 same-run baseline on the GPU machine (no network). Call it from the repository root with
# `.whl_lerobot` in the run's carry list:   bash benchmarks/run_lerobot_on_device.sh || echo "lerobot baseline failed";
# `.whl_lerobot/` (git-ignored, ~16 MiB) holds what the GPU image lacks: lerobot 0.6.1, transformers 5.5.4,
# tokenizers 0.22.2, huggingface_hub 1.33.0, draccus, mergedeep, gymnasium, farama_notifications (the rest of
# LeRobot's pi05 import chain -- torchvision, cv2, einops, yaml, regex, httpx, ... -- comes from the image).
# They go to /tmp/lrsite (minus draccus's top-level tests/ and examples/, which would shadow ours) and are put on
# PYTHONPATH for this one python3 only: nothing else in the command sees them. Rows go to
# ${OUT}/lerobot_baseline.jsonl. Never fails the caller.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lrsite .whl_lerobot/*.whl \
  && rm -rf /tmp/lrsite/tests /tmp/lrsite/examples \
  && PYTHONPATH=/tmp/lrsite:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 timeout -k 10 200 \
     python3 -m benchmarks.bench_lerobot --out "${OUT:-.}" \
  || echo "lerobot baseline failed (rc=$?)"
exit 0
