"""Attention alone at every PI0.5 call site and full-size shape: FlashAttention-4, the Triton kernel, SDPA, "gemm".

    python -m benchmarks.bench_attention_backend [--out DIR]   # on a GPU; rows -> attention_backend.jsonl

Sites (`Pi05Config.pi05_base()` geometry, bf16):
- ``vision``: SigLIP, batch x cameras images of 256 tokens, 16 heads of 72, no mask;
- ``prefix``: the LM over [cameras x 256 | prompt], 8 query heads on 1 K/V head of 256, key padding (a short prompt
  per row, and in case (a) a missing camera on every other row: valid keys with holes);
- ``expert``: 50 action queries over [prefix | own 50 keys], same heads, the prefix's key padding.

Cases are the DESIGN C8 camera/prompt settings (`benchmarks.common.CASES`: (a) 3 cameras + 200 tokens, (b) the LIBERO
RL setting, 2 cameras + 48 tokens) at batch 1 and 64. One row per (site, case, batch, backend): ``status`` "ran" or
"failed: <exact error>", ``kernel`` (what `attention.served_by` says ran: a hand-over names its target),
``max_rel_err`` = max |out - ref| / max |ref| against the float32 eager reference on the same inputs, and
``us_per_call``: median GPU time of one call of 20 captured in one CUDA graph (``timing`` "cuda_graph"), or between
CUDA events when capture fails (``timing`` "events", with ``graph_error``). At the expert site and batch 1 the
Triton kernel is also timed at forced key splits and block widths (``splits``, ``block_n``; rows without them
are `attention_kernel`'s defaults).
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import CASES, cuda_time_ms, graph_time_us, run_cli, write_rows

BENCH = "attention_backend"
BACKENDS = ("flash", "sdpa", "gemm", "triton")
SPLITS = (1, 4, 8, 16, 32)
BATCHES = (1, 64)
HORIZON = 50
"""Expert queries: the action horizon of PI0.5 (50 action tokens)."""


def site_inputs(site: str, case: str, batch: int, device: torch.device) -> dict[str, Any]:
    """Random bf16 q (B, Nh, T, hd), k/v (B, Nkv, S, hd) and (B, S) bool key validity (None for vision)."""
    from policies.pi05.config import Pi05Config

    cfg = Pi05Config.pi05_base()
    cams, prompt = len(CASES[case]["cams"]), CASES[case]["prompt"]
    patches = cfg.vision.num_patches
    gen = torch.Generator(device=device).manual_seed(batch)
    if site == "vision":
        b, heads, hd, mask = batch * cams, cfg.vision.num_heads, cfg.vision.head_dim, None
        kv_heads, t, s = heads, patches, patches
    else:
        llm = cfg.llm if site == "prefix" else cfg.expert
        b, heads, kv_heads, hd = batch, llm.num_heads, llm.num_kv_heads, llm.head_dim
        image = torch.ones(batch, cams, dtype=torch.bool, device=device)
        if case == "a":
            image[1::2, 1] = False  # a missing camera: a hole in the middle of the valid keys
        lengths = torch.randint(prompt // 4, prompt + 1, (batch, 1), generator=gen, device=device)
        text = torch.arange(prompt, device=device)[None, :] < lengths
        mask = torch.cat([image.repeat_interleave(patches, dim=1), text], dim=1)
        t = mask.shape[1] if site == "prefix" else HORIZON
        if site == "expert":
            mask = torch.cat([mask, torch.ones(batch, HORIZON, dtype=torch.bool, device=device)], dim=1)
        s = mask.shape[1]
    # q token-major as the projections leave it: (B, T, Nh, hd) seen as (B, Nh, T, hd)
    q = torch.randn(b, t, heads, hd, generator=gen, device=device).bfloat16().transpose(1, 2)
    k = torch.randn(b, kv_heads, s, hd, generator=gen, device=device).bfloat16()
    v = torch.randn(b, kv_heads, s, hd, generator=gen, device=device).bfloat16()
    shape = {"batch": b, "heads": heads, "kv_heads": kv_heads, "queries": t, "keys": s, "head_dim": hd}
    return {"q": q, "k": k, "v": v, "mask": mask, "shape": shape}


def _mask_for(backend: str, mask: torch.Tensor | None, shape: dict[str, int]) -> torch.Tensor | None:
    """The additive mask as the model prebuilds it for `backend` (float32 for "triton" and where "gemm" serves, else
    bf16)."""
    from policies.pi05 import attention

    if mask is None:
        return None
    s = shape
    gemm = attention.gemm_serves(s["batch"], s["heads"], s["kv_heads"], s["queries"], s["keys"], device=mask.device)
    return attention.additive_mask(mask, attention.mask_dtype(backend, torch.bfloat16, gemm))


def measure(site: str, case: str, batch: int, device: torch.device) -> list[dict[str, Any]]:
    """One row per backend at one (site, case, batch); each backend inside its own try/except."""
    from policies.pi05 import attention

    x = site_inputs(site, case, batch, device)
    q, k, v, shape = x["q"], x["k"], x["v"], x["shape"]
    scale = shape["head_dim"] ** -0.5
    with torch.no_grad():
        ref = attention.attend(q.float(), k.float(), v.float(), x["mask"], scale, "eager")
    ref_max = ref.abs().max()
    rows = []
    for backend in BACKENDS:
        row: dict[str, Any] = {"site": site, "case": case, "env_batch": batch, "backend": backend, **shape}
        row["kernel"] = attention.served_by(backend, device, q.dtype, **shape)
        try:
            mask = _mask_for(backend, x["mask"], shape)
            with torch.no_grad():
                if row["kernel"] == attention.flash_kernel_name():  # also runs the probe call (cached)
                    probe = attention.flash_probe_result(
                        device, q.dtype, shape["heads"], shape["kv_heads"], shape["head_dim"], mask is not None
                    )
                    row["flash_probe"] = probe or "ok"
                    if probe is not None:
                        row["kernel"] = f"sdpa (flash: {probe})"

                def call(q=q, k=k, v=v, mask=mask, backend=backend):
                    return attention.attend(q, k, v, mask, scale, backend)

                out = call()
                torch.cuda.synchronize()
                row["max_rel_err"] = float((out.float() - ref).abs().max() / ref_max)
                row["finite"] = bool(torch.isfinite(out).all())
                try:
                    row["us_per_call"], row["timing"] = graph_time_us(call), "cuda_graph"
                except Exception as err:  # noqa: BLE001 - capture failed: time eagerly, keep the reason
                    row["graph_error"] = f"{type(err).__name__}: {err}"[:500]
                    times = cuda_time_ms(call, iters=20)
                    row["us_per_call"], row["timing"] = sorted(times)[len(times) // 2] * 1e3, "events"
            row["status"] = "ran" if not row["kernel"].startswith("sdpa (flash") else f"failed: {row['kernel']}"
        except Exception as err:  # noqa: BLE001 - record the exact failure and go on
            row["status"] = f"failed: {type(err).__name__}: {err}"[:800]
            row["traceback"] = traceback.format_exc()[-1500:]
        rows.append(row)
    if site != "vision" and not attention.triton_shape_status(device, q.dtype, shape["kv_heads"], shape["head_dim"]):
        rows += _triton_direct(x, scale, ref, site, case, batch, sweep=site == "expert" and batch == 1)
    return rows


def _triton_direct(
    x: dict[str, Any], scale: float, ref: torch.Tensor, site: str, case: str, batch: int, sweep: bool
) -> list:
    """The Triton kernel called directly (whatever "triton"'s size routing says) on the same inputs: at its default
    key splits (``kernel`` "triton (direct)"), and with `sweep` also at forced splits (`SPLITS`) and block widths."""
    from policies.pi05 import attention, attention_kernel

    mask = attention.additive_mask(x["mask"], torch.float32)
    rows = []
    for splits, block_n in [(None, None)] + [(s, n) for s in SPLITS for n in (32, 64)] * sweep:
        forced = {} if splits is None else {"splits": splits, "block_n": block_n}
        tiles = None if block_n is None else attention_kernel.Tiles(block_n=block_n)
        row: dict[str, Any] = {"site": site, "case": case, "env_batch": batch, "backend": "triton",
                               "kernel": "triton" if forced else "triton (direct)", **forced, **x["shape"]}  # fmt: skip
        rows.append(_time_triton(row, x, mask, scale, ref, splits, tiles))
    return rows


def _time_triton(row: dict, x: dict, mask: torch.Tensor, scale: float, ref: torch.Tensor, splits, tiles) -> dict:
    """`row` with the Triton kernel's error and graph-replay time at (`splits`, `tiles`), or its exact failure."""
    from policies.pi05 import attention_kernel

    def call():
        return attention_kernel.attend(x["q"], x["k"], x["v"], mask, scale, splits, tiles)

    try:
        with torch.no_grad():
            out = call()
            row["max_rel_err"] = float((out.float() - ref).abs().max() / ref.abs().max())
            row["us_per_call"], row["timing"], row["status"] = graph_time_us(call), "cuda_graph", "ran"
    except Exception as err:  # noqa: BLE001 - record the exact failure and go on (e.g. out of shared memory)
        row["status"] = f"failed: {type(err).__name__}: {err}"[:800]
    return row


TUNE_SHAPES = (("expert", "a", 1), ("expert", "b", 1), ("expert", "a", 64), ("expert", "b", 64),
               ("prefix", "a", 1), ("prefix", "b", 1), ("prefix", "a", 64), ("prefix", "b", 64))  # fmt: skip


def tune(out: Path | None = None, shapes: tuple = TUNE_SHAPES) -> list[dict[str, Any]]:
    """The Triton kernel at every launch geometry (`attention_kernel.Tiles`) on each (site, case, batch) of `shapes`.

    Rows carry ``block_m``, ``block_n``, ``num_warps``, ``num_stages`` and ``tune: true``; geometries that do not
    compile (shared memory) are rows with the exact failure. The SDPA time of the same inputs is a row with
    ``backend`` "sdpa".
    """
    import itertools

    from policies.pi05 import attention, attention_kernel

    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    grid = itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3))
    tiles_grid = [attention_kernel.Tiles(m, n, w, st) for m, n, w, st in grid]
    for site, case, batch in shapes:
        x = site_inputs(site, case, batch, device)
        scale = x["shape"]["head_dim"] ** -0.5
        with torch.no_grad():
            ref = attention.attend(x["q"].float(), x["k"].float(), x["v"].float(), x["mask"], scale, "eager")
        mask = attention.additive_mask(x["mask"], torch.float32)
        base = {"site": site, "case": case, "env_batch": batch, "tune": True, **x["shape"]}
        measured = []
        for tiles in tiles_grid:
            row = {**base, "backend": "triton", "kernel": "triton", **vars(tiles)}
            measured.append(_time_triton(row, x, mask, scale, ref, None, tiles))
        sdpa_mask = attention.additive_mask(x["mask"], torch.bfloat16)

        def sdpa(x=x, sdpa_mask=sdpa_mask, scale=scale):
            return attention.attend(x["q"], x["k"], x["v"], sdpa_mask, scale, "sdpa")

        with torch.no_grad():
            measured.append({**base, "backend": "sdpa", "kernel": "sdpa", "status": "ran",
                             "us_per_call": graph_time_us(sdpa), "timing": "cuda_graph"})  # fmt: skip
        rows += write_rows(BENCH, measured, out)
        best = min((r for r in measured if r["status"] == "ran"), key=lambda r: r["us_per_call"])
        print(site, case, batch, "best", {k: best.get(k) for k in ("block_m", "block_n", "num_warps", "num_stages",
                                                                  "us_per_call", "kernel")}, flush=True)  # fmt: skip
        del x, ref
        torch.cuda.empty_cache()
    return rows


def run(
    out: Path | None = None,
    batches: tuple[int, ...] = BATCHES,
    sites: tuple[str, ...] = ("vision", "prefix", "expert"),
    cases: tuple[str, ...] = ("a", "b"),
) -> list[dict[str, Any]]:
    """Every (site, case, batch) row; appends to ``attention_backend.jsonl``."""
    from policies.pi05 import attention

    if not torch.cuda.is_available():
        return write_rows(BENCH, [{"site": "all", "backend": "flash", "status": "failed: no CUDA device"}], out)
    device = torch.device("cuda")
    status = attention.flash_device_status(device)
    header = {"site": "all", "backend": "flash", "kernel": attention.flash_kernel_name()}
    rows = write_rows(BENCH, [{**header, "status": "available" if status is None else f"failed: {status}"}], out)
    for site in sites:
        for case in cases:
            for batch in batches:
                try:
                    measured = measure(site, case, batch, device)
                except Exception as err:  # noqa: BLE001 - e.g. out of memory building the inputs
                    measured = [{"site": site, "case": case, "env_batch": batch, "backend": "all",
                                 "status": f"failed: {type(err).__name__}: {err}"[:800]}]  # fmt: skip
                rows += write_rows(BENCH, measured, out)
                torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
