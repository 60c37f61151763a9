"""The Triton attention kernel against FlashAttention-4 on keys laid out in place, per batch: where each should run.

    python -m benchmarks.bench_attention_variants [--out DIR]    # on an sm90 GPU; rows -> attention_variants.jsonl

Why: at case (a) batch 64 the expert's attention (8 x 50 folded query rows over 1,018 keys of one K/V head, width
256) was 180 calls of ~108 us in the denoise loop, 19.4 ms of the 536.7 ms call, at ~260 TFLOP/s of useful work. The
first sweep (253b626, rows with ``variant`` "shipped" / "tma") found (a) that reading K and V by TMA instead of
per-thread pointer copies made the kernel 18 % faster at the same tiles (82.2 against 100.6 us; now the shipped
kernel), and (b) that FlashAttention-4 runs the same call in 49.4 us when the valid keys are each row's first ones
(``seqused_k``, no per-call copy): what the fused expert's packed action keys (`PrefixCache.valid_first`) give it.

This sweep places the hand-over (the tuned ``flash_min_scores``): at both sites, for the three geometries of
`benchmarks.common.CASES` (the expert's horizon and prompt as the policy runs them) at batches 1 to 64, with keys
valid-first (random valid counts: prompts of a quarter to all of their bucket), it times the Triton kernel at its
own geometry rule (``triton``), at the large tiles without key splits (``triton large``, the expert), and
FlashAttention-4 reading the keys in place (``flash in place``, where installed), and reports where `attention.attend`
with "triton_flash" routes the call (``routed``).

Each row: ``site``, ``case``, ``env_batch``, ``variant``, shape, ``scores`` (batch x heads x queries x keys),
``us_per_call`` (median graph replay of 20 calls), ``tflops`` (useful FLOPs) and ``max_rel_err`` against the
float32 reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.common import CASES, graph_time_us, run_cli, write_rows
from policies.pi05 import attention, attention_kernel, tuning

BENCH = "attention_variants"
BATCHES = (1, 2, 4, 8, 16, 32, 64)


def in_place_inputs(site: str, case: str, batch: int, device: torch.device) -> dict[str, Any]:
    """bf16 q (B, 8, T, 256) token-major, k/v (B, 1, S, 256) and (B,) int32 valid counts, valid keys first."""
    from policies.pi05.config import Pi05Config

    cfg, spec = Pi05Config.pi05_base(), CASES[case]
    prefix = len(spec["cams"]) * cfg.vision.num_patches + spec["prompt"]
    gen = torch.Generator(device=device).manual_seed(batch)
    prompt = torch.randint(spec["prompt"] // 4, spec["prompt"] + 1, (batch,), generator=gen, device=device)
    num_valid = len(spec["cams"]) * cfg.vision.num_patches + prompt
    t, s = (prefix, prefix) if site == "prefix" else (spec["horizon"], prefix + spec["horizon"])
    lengths = (num_valid if site == "prefix" else num_valid + spec["horizon"]).to(torch.int32)
    llm = cfg.llm
    q = torch.randn(batch, t, llm.num_heads, llm.head_dim, generator=gen, device=device).bfloat16().transpose(1, 2)
    k, v = (torch.randn(batch, 1, s, llm.head_dim, generator=gen, device=device).bfloat16() for _ in range(2))
    valid = torch.arange(s, device=device)[None, :] < lengths[:, None]
    shape = {"heads": llm.num_heads, "queries": t, "keys": s, "head_dim": llm.head_dim}
    return {"q": q, "k": k, "v": v, "valid": valid, "lengths": lengths, "shape": shape}


def measure(site: str, case: str, batch: int, device: torch.device) -> list[dict[str, Any]]:
    """Every variant at one (site, case, batch)."""
    x = in_place_inputs(site, case, batch, device)
    q, k, v, shape = x["q"], x["k"], x["v"], x["shape"]
    scale = shape["head_dim"] ** -0.5
    with torch.no_grad():
        ref = attention.attend(q.float(), k.float(), v.float(), x["valid"], scale, "eager")
    mask = attention.additive_mask(x["valid"], torch.float32)
    scores = batch * shape["heads"] * shape["queries"] * shape["keys"]
    # every query row (the prefix's padded ones too) against each row's valid keys
    useful = 4 * shape["heads"] * shape["head_dim"] * shape["queries"] * float(x["lengths"].float().sum())
    calls = [("triton", lambda: attention_kernel.attend(q, k, v, mask, scale))]
    if site == "expert":
        large = attention_kernel.LARGE_TILES
        calls.append(("triton large", lambda: attention_kernel.attend(q, k, v, mask, scale, 1, large)))
    if attention.flash_attn_status() is None:
        calls.append(("flash in place", lambda: attention._flash_call(q, k, v, mask, scale, x["lengths"])))
    rows = []
    routed = "flash in place" if scores >= tuning.thresholds(q.device).flash_min_scores else "triton"
    for variant, call in calls:
        row = {"site": site, "case": case, "env_batch": batch, "variant": variant, **shape, "scores": scores,
               "routed": variant == routed}  # fmt: skip
        try:
            with torch.no_grad():
                out = call()
                row["max_rel_err"] = float((out.float() - ref).abs().max() / ref.abs().max())
                row["us_per_call"] = graph_time_us(call)
            row["tflops"] = useful / row["us_per_call"] / 1e6
            row["status"] = "ran"
        except Exception as err:  # noqa: BLE001 - record the exact failure and go on
            row["status"] = f"failed: {type(err).__name__}: {err}"[:800]
        print({k: row.get(k) for k in ("site", "case", "env_batch", "variant", "us_per_call", "status")}, flush=True)
        rows.append(row)
    return rows


def run(out: Path | None = None) -> list[dict[str, Any]]:
    """Both sites, the three cases, `BATCHES`; appends rows to ``attention_variants.jsonl`` under `out`."""
    device = torch.device("cuda")
    rows = []
    for site in ("expert", "prefix"):
        for case in ("a", "b", "phyai"):
            for batch in BATCHES if site == "expert" else BATCHES[:5]:
                rows += write_rows(BENCH, measure(site, case, batch, device), out)
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
