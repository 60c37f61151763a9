"""Same-run speed baseline: LeRobot's PI0.5 (`PI05Pytorch.sample_actions`), random weights, eager.

Standalone: it imports lerobot (0.6.1, with transformers 5.5.4) and of this repository only the row writer
(`benchmarks/common.py`, torch and the standard library), never the project, so it can run next to our policy
benchmarks in one GPU campaign with LeRobot's pinned packages on a private PYTHONPATH
(see `benchmarks/run_lerobot_on_device.sh`).

    PYTHONPATH=/tmp/lrsite:. python3 -m benchmarks.bench_lerobot --out $OUT          # H200; -> lerobot_baseline.jsonl
    PYTHONPATH=. /work/lerobot_venv/bin/python -m benchmarks.bench_lerobot --small --out /tmp/lr   # CPU smoke

What is measured (full geometry = published pi05_base: SigLIP So400m/14 at 224 px -> 256 tokens a camera,
Gemma 2B prefix LM, Gemma 300M action expert, vocab 257,152):

* LeRobot's `dtype="bfloat16"` mode: everything in `paligemma_with_expert` is bf16 EXCEPT the vision tower,
  the multimodal projector, the layer norms and the final norms (fp32); `action_in_proj`, `action_out_proj`
  and `time_mlp_*` stay fp32; the RoPE `inv_freq` buffers and the embedding scale are cast to bf16 too.
  Attention is eager (LeRobot forces `_attn_implementation = "eager"` in `sample_actions`), softmax fp32.
  No TF32 (LeRobot only sets `float32_matmul_precision("high")` when it compiles), so the fp32 SigLIP runs
  at full fp32 precision -- that is LeRobot's default eager behaviour and what we measure.
* case a: 3 cameras, 200-token prompt (all valid), K=10 Euler steps, H=50, batch 1/8/64.
* case b: 2 cameras + the third slot masked (image of -1, mask False, as `PI05Policy` pads a missing camera;
  LeRobot still runs SigLIP on it and keeps its 256 tokens in the prefix as padding), 48-token prompt,
  K=5, H=10 (`config.chunk_size` = 10), batch 8/40/64.
* Every parameter is randomised (LeRobot zero-initialises the adaRMS dense layers and transformers the Gemma
  RMSNorm weights; all-zero operands would flatter the matmuls).
* Timing: CUDA events around each `sample_actions` call, warm-ups first, p50 of the timed calls. Peak memory
  is `torch.cuda.max_memory_allocated()` over the case's warm-ups and timed calls (weights included).

Each JSONL row: {"bench": "lerobot_baseline", gpu, torch, commit, transformers, lerobot, case, batch, p50_ms,
samples_per_s, peak_mem_gib, ...}; a failing (case, batch) writes a row with "error" instead and the run goes
on. Rows are appended and flushed as they are produced, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

from benchmarks.common import write_rows

# Nothing here needs the Hub; never let a stray lookup wait on a network the GPU machine does not have.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# Optional packages that lerobot/transformers import only when installed (`_peft_available`, ...). The GPU image
# has some of them (peft for transformers 5.17), the LeRobot venv this script was tested in has none; hide them so
# the import chain is the tested one (sys.modules[name] = None -> find_spec() is None -> "not installed").
# Override with LEROBOT_BENCH_HIDE="" (hide nothing) or a comma-separated list.
HIDDEN = [n for n in os.environ.get("LEROBOT_BENCH_HIDE", "peft,torchdiffeq,diffusers").split(",") if n.strip()]
for _name in HIDDEN:
    if _name.strip() not in sys.modules:
        sys.modules[_name.strip()] = None  # type: ignore[assignment]

SEED = 20260601
NUM_SLOTS = 3  # LeRobot PI0.5 camera slots in these cases
ACTION_DIM = 32  # max_action_dim of pi05_base

CASES = {
    "a": dict(cams=3, prompt=200, num_steps=10, horizon=50, batches=(1, 8, 64)),
    "b": dict(cams=2, prompt=48, num_steps=5, horizon=10, batches=(8, 40, 64)),
}
SMALL_BATCHES = {"a": (1, 2), "b": (2, 3)}

# Small geometry for the CPU smoke test (same shape rules as tests/fixtures/lerobot/make_fixture.py: 8 query
# heads, 1 KV head, equal depth for both towers).
SMALL_GEOMETRY = {
    "vision": {"width": 60, "depth": 2, "mlp_dim": 96, "num_heads": 4, "patch_size": 14, "image_size": 70},
    "llm": {"width": 64, "depth": 2, "mlp_dim": 160, "num_heads": 8, "num_kv_heads": 1, "head_dim": 16},
    "expert": {"width": 48, "depth": 2, "mlp_dim": 80, "num_heads": 8, "num_kv_heads": 1, "head_dim": 16},
    "vocab_size": 1024,
}
FULL_IMAGE_SIZE = 224
FULL_VOCAB = 257152


# ----------------------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------------------
def make_config(device: str, dtype: str, image_size: int):
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    return PI05Config(
        device="cuda" if str(device).startswith("cuda") else "cpu",  # lerobot validates this name
        dtype=dtype,
        chunk_size=50,
        n_action_steps=50,
        max_action_dim=ACTION_DIM,
        max_state_dim=32,
        num_inference_steps=10,
        image_resolution=(image_size, image_size),
        compile_model=False,
        gradient_checkpointing=False,
    )


@contextlib.contextmanager
def small_lerobot_geometry(geom: dict):
    """While active, LeRobot's PI05Pytorch builds with the small geometry `geom` (LeRobot has no size options).

    Substitutes the module-level lookups construction uses (`get_gemma_config`, the PaliGemma and expert
    classes) and restores them on exit. `geom` = {"vision": {...}, "llm": {...}, "expert": {...}, "vocab_size"}.
    Shared with tests/fixtures/lerobot/make_fixture.py.
    """
    from lerobot.policies.pi05 import modeling_pi05 as m

    orig_pali = m.PaliGemmaForConditionalGenerationWithPiGemma
    orig_expert = m.PiGemmaForCausalLM
    orig_get = m.get_gemma_config
    v = geom["vision"]

    def small_gemma_config(variant: str):
        return m.GemmaConfig(**{"gemma_2b": geom["llm"], "gemma_300m": geom["expert"]}[variant])

    def small_pali(config):
        config._vocab_size = geom["vocab_size"]  # noqa: SLF001
        config.text_config.vocab_size = geom["vocab_size"]
        vc = config.vision_config
        vc.hidden_size = v["width"]
        vc.num_hidden_layers = v["depth"]
        vc.intermediate_size = v["mlp_dim"]
        vc.num_attention_heads = v["num_heads"]
        vc.patch_size = v["patch_size"]
        vc.image_size = v["image_size"]
        vc.projection_dim = geom["llm"]["width"]
        return orig_pali(config)

    def small_expert(config):
        config.vocab_size = geom["vocab_size"]
        return orig_expert(config)

    m.get_gemma_config = small_gemma_config
    m.PaliGemmaForConditionalGenerationWithPiGemma = small_pali
    m.PiGemmaForCausalLM = small_expert
    try:
        yield
    finally:
        m.get_gemma_config = orig_get
        m.PaliGemmaForConditionalGenerationWithPiGemma = orig_pali
        m.PiGemmaForCausalLM = orig_expert


def build_model(device: str, dtype: str, small: bool):
    """LeRobot PI05Pytorch: the published geometry, or the small one by substituting module-level names."""
    import torch
    from lerobot.policies.pi05 import modeling_pi05 as m

    if not small:
        cfg = make_config(device, dtype, FULL_IMAGE_SIZE)
        with torch.device(device):
            model = m.PI05Pytorch(cfg)
        return model.eval()

    cfg = make_config(device, dtype, SMALL_GEOMETRY["vision"]["image_size"])
    with small_lerobot_geometry(SMALL_GEOMETRY), torch.device(device):
        model = m.PI05Pytorch(cfg)
    return model.eval()


def randomise(model, seed: int) -> None:
    """Random value for every parameter, in place and in its own dtype (LeRobot's bf16/fp32 split is kept)."""
    import torch

    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = p.shape

            def rnd(shape=shape):
                return torch.randn(shape, generator=gen, device=dev, dtype=torch.float32)

            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                val = rnd().div_(shape[1] ** 0.5)  # x sqrt(width) in the embedding -> unit scale
            elif name.endswith("position_embedding.weight"):
                val = rnd().mul_(0.5)
            elif p.ndim >= 2:
                fan_in = 1
                for s in shape[1:]:
                    fan_in *= int(s)
                val = rnd().div_(fan_in**0.5)
            elif re.search(r"(layer_norm\d|post_layernorm)\.weight$", name):  # SigLIP LayerNorm: y*w
                val = rnd().mul_(0.2).add_(1.0)
            elif name.endswith(("layernorm.weight", "norm.weight")):  # Gemma RMSNorm: y*(1+w)
                val = rnd().mul_(0.3)
            else:  # biases (adaRMS dense bias, LayerNorm bias, ...)
                val = rnd().mul_(0.2)
            p.copy_(val.to(p.dtype))
            del val


def dtype_summary(model) -> dict:
    """Parameter count and bytes by dtype, as built (documents LeRobot's mixed bf16/fp32 mode)."""
    out: dict = {}
    for p in model.parameters():
        k = str(p.dtype).removeprefix("torch.")
        n, b = out.get(k, (0, 0))
        out[k] = (n + p.numel(), b + p.numel() * p.element_size())
    return {k: {"params": n, "gib": round(b / 2**30, 3)} for k, (n, b) in out.items()}


# ----------------------------------------------------------------------------------------------------------
# inputs and timing
# ----------------------------------------------------------------------------------------------------------
def make_inputs(case: dict, batch: int, image_size: int, vocab: int, device: str, seed: int):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    images, masks = [], []
    for slot in range(NUM_SLOTS):
        if slot < case["cams"]:
            img = torch.rand((batch, 3, image_size, image_size), generator=gen, device=device) * 2 - 1
            mask = torch.ones(batch, dtype=torch.bool, device=device)
        else:  # missing camera, padded the way PI05Policy._preprocess_images pads it
            img = torch.full((batch, 3, image_size, image_size), -1.0, device=device)
            mask = torch.zeros(batch, dtype=torch.bool, device=device)
        images.append(img)
        masks.append(mask)
    L = case["prompt"]
    tokens = torch.randint(3, vocab, (batch, L), generator=gen, device=device, dtype=torch.int64)
    tokens[:, 0] = 2  # BOS
    token_masks = torch.ones((batch, L), dtype=torch.bool, device=device)
    noise = torch.randn((batch, case["horizon"], ACTION_DIM), generator=gen, device=device)
    return images, masks, tokens, token_masks, noise


def time_calls(fn, warmup: int, iters: int, cuda: bool) -> list[float]:
    import torch

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def run_one(
    model, case: dict, row: dict, batch: int, warmup: int, iters: int, image_size: int, vocab: int, device: str
) -> dict:
    """Time `sample_actions` for one (case, batch); returns the filled row (raises on failure)."""
    import torch

    cuda = device.startswith("cuda")
    # chunk_size only slices the expert output (`suffix_out[:, -chunk_size:]`); the weights don't depend on it
    model.config.chunk_size = case["horizon"]
    model.config.n_action_steps = case["horizon"]
    images, masks, tokens, token_masks, noise = make_inputs(case, batch, image_size, vocab, device, SEED + batch)
    row = {**row, "prefix_tokens": NUM_SLOTS * (image_size // 14) ** 2 + case["prompt"]}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    result = {}

    def call():
        result["actions"] = model.sample_actions(
            images, masks, tokens, token_masks, noise=noise, num_steps=case["num_steps"]
        )

    times = time_calls(call, warmup, iters, cuda)
    actions = result["actions"]
    if tuple(actions.shape) != (batch, case["horizon"], ACTION_DIM):
        raise RuntimeError(f"unexpected actions shape {tuple(actions.shape)}")
    p50 = statistics.median(times)
    row.update(
        p50_ms=round(p50, 3),
        min_ms=round(min(times), 3),
        max_ms=round(max(times), 3),
        times_ms=[round(t, 3) for t in times],
        samples_per_s=round(batch / (p50 / 1e3), 2),
        peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
        actions_finite=bool(torch.isfinite(actions).all().item()),
        actions_dtype=str(actions.dtype).removeprefix("torch."),
    )
    return row


def env_info(device: str) -> dict:
    import importlib.metadata as md

    import torch
    import transformers

    return {
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lerobot": md.version("lerobot"),
        "python": sys.version.split()[0],
        "hidden_optional_packages": HIDDEN,
    }


# ----------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for lerobot_baseline.jsonl (default: results/)")
    ap.add_argument("--cases", default="a,b", help="comma-separated subset of: a,b")
    ap.add_argument("--small", action="store_true", help="CPU smoke test with a small geometry")
    ap.add_argument("--device", default=None, help="default: cuda, or cpu with --small")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="LeRobot dtype mode")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--big-batch", type=int, default=64, help="batches >= this use --big-warmup/--big-iters")
    ap.add_argument("--big-warmup", type=int, default=1)
    ap.add_argument("--big-iters", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=130.0, help="skip remaining (case, batch) after this")
    ap.add_argument("--batches-a", type=int, nargs="*", default=None)
    ap.add_argument("--batches-b", type=int, nargs="*", default=None)
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    device = args.device or ("cpu" if args.small else "cuda")
    cuda = device.startswith("cuda")

    def emit(row: dict) -> None:
        write_rows("lerobot_baseline", [row], args.out, echo=False)
        keys = ("case", "batch", "p50_ms", "samples_per_s", "peak_mem_gib", "actions_finite", "error")
        print("lerobot_baseline " + " ".join(f"{k}={row[k]}" for k in keys if k in row), flush=True)

    base: dict = {"bench": "lerobot_baseline"}
    try:
        import torch

        torch.manual_seed(SEED)
        base.update(env_info(device))
        t0 = time.perf_counter()
        model = build_model(device, args.dtype, args.small)
        randomise(model, SEED)
        if cuda:
            torch.cuda.synchronize()
        build_s = time.perf_counter() - t0
        n_params = sum(p.numel() for p in model.parameters())
        weights_gib = torch.cuda.memory_allocated() / 2**30 if cuda else None
        base.update(
            geometry="small" if args.small else "pi05_base",
            dtype_mode=args.dtype,
            attn="eager",
            compiled=False,
            float32_matmul_precision=torch.get_float32_matmul_precision(),
            params=n_params,
            weights_gib=None if weights_gib is None else round(weights_gib, 3),
            build_s=round(build_s, 2),
        )
        print(
            f"built LeRobot PI05Pytorch: {n_params / 1e6:.1f} M params in {build_s:.1f} s; "
            f"dtypes {json.dumps(dtype_summary(model))}",
            flush=True,
        )
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        emit({**base, "case": None, "batch": None, "error": f"build: {type(e).__name__}: {e}"[:2000]})
        return 1

    image_size = SMALL_GEOMETRY["vision"]["image_size"] if args.small else FULL_IMAGE_SIZE
    vocab = SMALL_GEOMETRY["vocab_size"] if args.small else FULL_VOCAB
    failures = 0
    for case_name in [c.strip() for c in args.cases.split(",") if c.strip()]:
        case = CASES[case_name]
        batches = getattr(args, f"batches_{case_name}")
        if batches is None:
            batches = SMALL_BATCHES[case_name] if args.small else case["batches"]
        for batch in batches:
            big = batch >= args.big_batch
            warmup = args.big_warmup if big else args.warmup
            iters = args.big_iters if big else args.iters
            row = {
                **base,
                "case": case_name,
                "batch": batch,
                "cameras": case["cams"],
                "masked_slots": NUM_SLOTS - case["cams"],
                "prompt_tokens": case["prompt"],
                "num_steps": case["num_steps"],
                "horizon": case["horizon"],
                "warmup": warmup,
                "iters": iters,
            }
            elapsed = time.perf_counter() - t_start
            if elapsed > args.budget_s:
                emit({**row, "error": f"skipped: time budget {args.budget_s:.0f} s spent ({elapsed:.0f} s)"})
                failures += 1
                continue
            try:
                emit(run_one(model, case, row, batch, warmup, iters, image_size, vocab, device))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                failures += 1
                emit({**row, "error": f"{type(e).__name__}: {e}"[:2000]})
            finally:
                if cuda:
                    torch.cuda.empty_cache()
    print(f"lerobot baseline done in {time.perf_counter() - t_start:.1f} s, {failures} failed/skipped", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
