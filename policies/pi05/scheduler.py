"""The PI0.5 scheduler: static buffers, batch/prompt buckets, and CUDA graphs for the prefix and denoise loop.

`setup()` allocates every static tensor once at maximum shape (pixels, tokens, per-env seeds/counters, the
rollout switches, the prefix K/V cache with room for the H action tokens, outputs). On CUDA, graphs
  prefix graphs  keyed by (batch bucket, prompt bucket, camera set)
  denoise graphs keyed by (batch bucket, prompt bucket, camera set, K, learned noise)
are captured on first use of their shape, into one memory pool, and replayed from then on; nothing is captured
at setup unless `SchedulerConfig.warmup` asks for it. A call pads N to the smallest bucket >= N (by default
every size is a bucket, so N runs unpadded), replays, and copies the real rows out, so results never alias
static memory. N > max_batch_size is split. Without CUDA the very same staged functions run eagerly on the same
buffers (what CI exercises) and the same shape bookkeeping is kept (`SchedulerStats.graph_keys`).

Graph keys include the camera set for the denoise loop too: its K/V length depends on how many cameras are
used. Deployments declare one camera set, so this adds no graphs in practice.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from ..base import RolloutConfig
from ..checks import bad_input, check_bool, check_int, check_int_tuple
from .batch import StoredPrefix
from .inputs import ModelInputs
from .model import Pi05Model, PrefixCache
from .prompt import DEFAULT_BUCKETS
from .rollout import RolloutOutputs, RolloutTables, prefix_values, run_denoise_stage, run_prefix_stage
from .sampler import NO_NOISE_HEAD, ControlInputs, controls, draw_noise


class GraphKeyError(ValueError):
    """A request outside what `setup()` declared (K value, camera set, prompt length)."""


class CaptureError(RuntimeError):
    """CUDA graph capture failed."""


def default_batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Every size 1..max_batch_size: each N runs at its own graph, captured the first time N is met.

    Graphs are captured lazily, so a bucket costs nothing until used; a rollout at a fixed N pays no padding.
    """
    return tuple(range(1, max_batch_size + 1))


def check_warmup(name: str, warmup: object, max_batch_size: int) -> tuple[tuple[int, int], ...] | str:
    """`SchedulerConfig.warmup` (named `name`): "all" or (batch_size, prompt_length) pairs, batch_size <= the max."""
    if isinstance(warmup, str) and warmup == "all":
        return "all"
    fix = 'pairs (batch_size, prompt_length), e.g. ((64, 48),), "all", or () to capture on first use'
    if isinstance(warmup, str) or not isinstance(warmup, Sequence):
        raise TypeError(bad_input(name, "a tuple of (batch_size, prompt_length) pairs or 'all'", warmup, fix))
    out = []
    for i, pair in enumerate(warmup):
        if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(bad_input(f"{name}[{i}]", "a pair (batch_size, prompt_length)", pair, fix))
        b = check_int(f"{name}[{i}][0] (batch_size)", pair[0], 1, max_batch_size,
                      fix=f"a batch size 1..max_batch_size ({max_batch_size})")  # fmt: skip
        length = check_int(f"{name}[{i}][1] (prompt_length)", pair[1], 1, fix="a prompt length in tokens")
        out.append((b, length))
    return tuple(out)


def check_scheduler_fields(cfg: SchedulerConfig) -> None:
    """Refuse bad scheduler settings: sizes, buckets, declared K values, camera sets, the graph switch."""
    owner = type(cfg).__name__
    check_int(f"{owner}.max_batch_size", cfg.max_batch_size, 1, fix="the largest batch one replay serves, e.g. 64")
    if cfg.batch_buckets is not None:
        buckets = check_int_tuple(f"{owner}.batch_buckets", cfg.batch_buckets, 1)
        if max(buckets) > cfg.max_batch_size:
            raise ValueError(
                bad_input(f"{owner}.batch_buckets", f"sizes <= max_batch_size ({cfg.max_batch_size})", buckets,
                          "raise max_batch_size or drop the larger buckets")
            )  # fmt: skip
    check_int_tuple(f"{owner}.prompt_buckets", cfg.prompt_buckets, 1, fix="prompt lengths L, e.g. (16, 48, 112, 200)")
    check_int_tuple(f"{owner}.num_steps", cfg.num_steps, 1, fix="the K values act() may use, e.g. (10,)")
    sets = cfg.camera_sets
    if isinstance(sets, str) or not isinstance(sets, Sequence) or not sets:
        raise TypeError(bad_input(f"{owner}.camera_sets", "a non-empty tuple of slot-index tuples, e.g. ((0, 1),)",
                                  sets))  # fmt: skip
    for i, cams in enumerate(sets):
        slots = check_int_tuple(f"{owner}.camera_sets[{i}]", cams, 0, fix="slot indices, e.g. (0, 1)")
        if len(set(slots)) != len(slots):
            raise ValueError(bad_input(f"{owner}.camera_sets[{i}]", "distinct slot indices", slots))
    check_warmup(f"{owner}.warmup", cfg.warmup, cfg.max_batch_size)
    check_bool(f"{owner}.cuda_graphs", cfg.cuda_graphs)
    check_bool(f"{owner}.fused_kernels", cfg.fused_kernels)
    check_bool(f"{owner}.learned_noise", cfg.learned_noise)


@dataclass
class SchedulerConfig:
    """What `setup()` allocates, and which graph shapes exist and when they are captured.

    A graph shape is (batch bucket, prompt bucket, camera set, K). On CUDA each shape's prefix and denoise graphs
    are captured the first time a call needs them; later calls replay them. That first call pays one eager run of
    the shape (kernel compilation, cuBLAS workspaces), a device synchronisation and two captures (for pi05_base
    under a second: `first_act_s` in `benchmarks/results/ppo.jsonl`); each later call replays.
    A new shape mid-run adds its own graphs and never recaptures others; weights synced in place (`WeightSync`)
    keep every graph valid, whenever it was captured.

    Attributes:
        max_batch_size: largest batch one replay serves; larger N is split.
        batch_buckets: batch sizes with their own graphs; N pads to the smallest bucket >= N (default: every size
            1..max_batch_size, so no N is padded; give fewer, e.g. (8, 16, 32, 64), to bound how many graphs a
            varying N can create).
        prompt_buckets: captured prompt lengths (capped at the model's max_token_len).
        num_steps: declared K values (time and adaRMS tables per K).
        camera_sets: declared sets of used camera slots, e.g. ((0, 1),) for LIBERO.
        cuda_graphs: capture graphs on CUDA (False: run eagerly on the static buffers).
        fused_kernels: run the hot path's fused Triton kernels (`kernels.py`: residual add + (ada)RMSNorm, RoPE
            + K/V cache write) on CUDA in half precision, and each denoise step's sampler math as one kernel on
            the float32 action state (any model dtype; the same float32 operations as the PyTorch ops); False
            runs the unfused PyTorch ops (the A/B baseline and a fallback). Either way graph replay equals the
            eager stage bitwise; the two settings differ by rounding in half precision (the layer kernels round
            once per kernel). No effect on CPU.
        learned_noise: `warmup` also captures the denoise graphs that run the learned noise head, which only
            method "noise" reads (`Pi05Policy` sets it when its rollout method is "noise"). Other methods run
            graphs without the head, with the same outputs; either way a "noise" call at a new shape captures
            its graphs then, once.
        warmup: shapes captured at `setup()` instead of on first use: (batch_size, prompt_length) pairs, each
            captured for every declared camera set and K, or "all" for every batch bucket x prompt bucket
            (the whole declared grid: slow with the default buckets). Default (): nothing before the first call.

    Example:
        >>> cfg = SchedulerConfig(max_batch_size=64, warmup=((64, 48),))
        >>> cfg.batch_buckets[:3], cfg.batch_buckets[-1], cfg.warmup
        ((1, 2, 3), 64, ((64, 48),))
    """

    max_batch_size: int = 64
    batch_buckets: tuple[int, ...] | None = None
    prompt_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    num_steps: tuple[int, ...] = (10,)
    camera_sets: tuple[tuple[int, ...], ...] = ((0, 1, 2),)
    cuda_graphs: bool = True
    fused_kernels: bool = True
    learned_noise: bool = False
    warmup: tuple[tuple[int, int], ...] | str = ()

    def __post_init__(self) -> None:
        check_scheduler_fields(self)
        self.batch_buckets = tuple(sorted(set(self.batch_buckets or default_batch_buckets(self.max_batch_size))))
        if self.batch_buckets[-1] != self.max_batch_size:
            raise ValueError(
                f"batch_buckets: the largest bucket must equal max_batch_size ({self.max_batch_size}), "
                f"got {self.batch_buckets}."
            )
        self.prompt_buckets = tuple(sorted(set(self.prompt_buckets)))
        self.num_steps = tuple(sorted(set(self.num_steps)))
        self.camera_sets = tuple(tuple(sorted(c)) for c in self.camera_sets)
        self.warmup = check_warmup(f"{type(self).__name__}.warmup", self.warmup, self.max_batch_size)


@dataclass
class _Buffers:
    images: torch.Tensor  # (Bmax, 3 slots, 3, S, S) uint8
    image_mask: torch.Tensor  # (Bmax, 3) bool
    tokens: torch.Tensor  # (Bmax, Lmax) int32
    lengths: torch.Tensor  # (Bmax,) int32
    seeds: torch.Tensor  # (Bmax,) int64
    counters: torch.Tensor  # (Bmax,) int64
    switches: dict[str, torch.Tensor]
    keys: list[torch.Tensor]  # per layer (Bmax, Nkv, Tmax + H, hd)
    values: list[torch.Tensor]
    key_mask: torch.Tensor  # (Bmax, Tmax) bool
    num_valid: torch.Tensor  # (Bmax,) int64
    prefix_value: torch.Tensor  # (Bmax,) float32
    prefix_pooled: torch.Tensor  # (Bmax, W) float32, the prefix value's input
    chain: torch.Tensor  # (Bmax, Kmax+1, H, D) float32
    log_prob: torch.Tensor  # (Bmax, H, D) float32
    out_values: torch.Tensor  # (Bmax,) float32
    denoise_inds: torch.Tensor  # (Bmax, Kmax) int64
    valid_first: bool = False  # the prefix stage stored each row's valid K/V first (`PrefixCache.valid_first`)


@dataclass
class SchedulerStats:
    """Counters for tests and benchmarks (captures grow only when a shape is met for the first time).

    `graph_keys` lists the keys of prefix (3 fields) and denoise (5 fields) graphs in first-use order, each once;
    on CUDA each was captured then, on CPU the eager path keeps the same record (`captures` stays 0).
    """

    captures: int = 0
    replays: int = 0
    eager_calls: int = 0
    setup_seconds: float = 0.0
    capture_seconds: float = 0.0
    graph_keys: list[tuple] = field(default_factory=list)


class Pi05Scheduler:
    """Owns static buffers and graphs for one model on one device.

    Example:
        >>> from policies.pi05.config import Pi05Config
        >>> model = Pi05Model(Pi05Config.tiny())
        >>> cfg = SchedulerConfig(max_batch_size=4, batch_buckets=(2, 4), num_steps=(5,), prompt_buckets=(16,))
        >>> sched = Pi05Scheduler(model, cfg)
        >>> sched.setup()
        >>> sched.bucket_for(3), sched.stats.graph_keys  # nothing captured before the first call
        (4, [])
    """

    def __init__(self, model: Pi05Model, config: SchedulerConfig) -> None:
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device
        cap = model.config.max_token_len
        self.prompt_buckets = tuple(b for b in config.prompt_buckets if b < cap) + (cap,)
        self.use_graphs = config.cuda_graphs and self.device.type == "cuda"
        self.tables: RolloutTables | None = None
        self.buffers: _Buffers | None = None
        self.stats = SchedulerStats()
        self._prefix_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._denoise_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._met: set[tuple] = set()  # graph keys met so far (captured on CUDA; only recorded without graphs)
        self._switch_cache: dict[RolloutConfig, dict[str, torch.Tensor]] = {}
        self._camera_indices: dict[tuple[int, ...], torch.Tensor] = {}
        has_head = model.noise_head is not None
        self._noise_variants = (False, True) if has_head and config.learned_noise else (False,)

    # ------------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Allocate static buffers at maximum shape, build per-K tables, and capture the `warmup` shapes (CUDA)."""
        start = time.perf_counter()
        cfg, mcfg = self.config, self.model.config
        self.tables = RolloutTables(self.model, cfg.num_steps)
        self.model.build_fused_weights()
        dev, bmax, lmax = self.device, cfg.max_batch_size, self.prompt_buckets[-1]
        s, h, d, kmax = mcfg.vision.image_size, mcfg.action_horizon, mcfg.action_dim, max(cfg.num_steps)
        tmax = len(mcfg.camera_slots) * mcfg.vision.num_patches + lmax
        kv_shape = (bmax, mcfg.llm.num_kv_heads, tmax + h, mcfg.llm.head_dim)
        dtype = self.model.compute_dtype
        probe = ControlInputs.from_options(RolloutConfig(num_steps=kmax), h, d, False, dev)
        self.buffers = _Buffers(
            images=torch.zeros(bmax, len(mcfg.camera_slots), 3, s, s, dtype=torch.uint8, device=dev),
            image_mask=torch.ones(bmax, len(mcfg.camera_slots), dtype=torch.bool, device=dev),
            tokens=torch.zeros(bmax, lmax, dtype=torch.int32, device=dev),
            lengths=torch.ones(bmax, dtype=torch.int32, device=dev),
            seeds=torch.zeros(bmax, dtype=torch.int64, device=dev),
            counters=torch.zeros(bmax, dtype=torch.int64, device=dev),
            switches={k: v.clone() for k, v in probe.tensors().items()},
            keys=[torch.zeros(kv_shape, dtype=dtype, device=dev) for _ in range(mcfg.llm.depth)],
            values=[torch.zeros(kv_shape, dtype=dtype, device=dev) for _ in range(mcfg.llm.depth)],
            key_mask=torch.zeros(bmax, tmax, dtype=torch.bool, device=dev),
            num_valid=torch.zeros(bmax, dtype=torch.int64, device=dev),
            prefix_value=torch.zeros(bmax, device=dev),
            prefix_pooled=torch.zeros(bmax, mcfg.llm.width, device=dev),
            chain=torch.zeros(bmax, kmax + 1, h, d, device=dev),
            log_prob=torch.zeros(bmax, h, d, device=dev),
            out_values=torch.zeros(bmax, device=dev),
            denoise_inds=torch.zeros(bmax, kmax, dtype=torch.int64, device=dev),
        )
        for cams in cfg.camera_sets:
            self._camera_index(cams)
        if self.use_graphs:
            self._pool = torch.cuda.graph_pool_handle()
        assert cfg.batch_buckets is not None
        grid = [(b, length) for b in cfg.batch_buckets for length in self.prompt_buckets]
        self.warmup(grid if cfg.warmup == "all" else cfg.warmup)
        self.stats.setup_seconds = time.perf_counter() - start

    def warmup(self, shapes: Sequence[tuple[int, int]]) -> int:
        """Make the graphs of (batch_size, prompt_length) `shapes` exist now, for every declared camera set and K.

        Returns how many graph keys were new. Shapes already met are skipped; nothing is recaptured. Larger batches
        are captured first.

        Example:
            >>> from policies.pi05.config import Pi05Config
            >>> sched = Pi05Scheduler(Pi05Model(Pi05Config.tiny()), SchedulerConfig(max_batch_size=4, num_steps=(5,)))
            >>> sched.setup()
            >>> sched.warmup([(3, 20)]), sched.warmup([(3, 30)])  # prefix + denoise graph; 30 tokens: same bucket
            (2, 0)
        """
        if self.buffers is None:
            raise RuntimeError("Pi05Scheduler.setup() has not been called; call it once before warmup().")
        wanted = check_warmup("shapes", tuple(shapes), self.config.max_batch_size)
        assert not isinstance(wanted, str)
        before = len(self.stats.graph_keys)
        for b, length in sorted(dict.fromkeys(wanted), key=lambda shape: -shape[0]):  # largest first: the pool
            # then holds the largest intermediates, and smaller graphs reuse that memory
            for cams in self.config.camera_sets:
                for k in self.config.num_steps:
                    for learned in self._noise_variants:
                        self._ensure(self.bucket_for(b), self.prompt_bucket_for(length), cams, k, learned)
        return len(self.stats.graph_keys) - before

    def add_batch_buckets(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """Make every batch size in `sizes` run at its own bucket; returns the buckets added.

        A size above max_batch_size is split into max_batch_size chunks and its remainder, which gets a bucket.
        The new buckets' graphs are captured on first use, like every other shape (or now with `warmup`).
        """
        bmax = self.config.max_batch_size
        wanted: set[int] = set()
        for n in sizes:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"batch sizes: expected positive ints, got {n!r} in {list(sizes)}.")
            wanted.add(min(n, bmax))
            if n > bmax and n % bmax:
                wanted.add(n % bmax)
        assert self.config.batch_buckets is not None
        new = tuple(sorted(wanted - set(self.config.batch_buckets)))
        if new:
            self.config.batch_buckets = tuple(sorted({*self.config.batch_buckets, *new}))
        return new

    def _ensure(self, b: int, length: int, cams: tuple[int, ...], k: int | None, learned: bool = False) -> None:
        """Capture (CUDA) or record (CPU) the graphs of this shape that do not exist yet, and keep existing ones.

        The prefix graph, and the denoise graph unless k is None.

        Runs before a call loads its inputs: the eager warm-up run writes the static buffers. It runs the new
        stages once on a side stream (kernel compilation and lazy initialisation must happen outside a capture;
        the side stream is ordered after a weight commit queued on the compute stream), then captures each.
        """
        keys: list[tuple] = [(b, length, cams)] + ([] if k is None else [(b, length, cams, k, learned)])
        new = [key for key in keys if key not in self._met]
        if not new:
            return
        if not self.use_graphs:
            self._met.update(new)
            self.stats.graph_keys.extend(new)
            return
        start = time.perf_counter()
        stages = {3: self._prefix_stage, 5: self._denoise_stage}
        with torch.no_grad():
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for key in new:
                    stages[len(key)](*key)
            torch.cuda.current_stream(self.device).wait_stream(side)
            # Unreachable CUDA graphs (e.g. a dropped policy's, in a reference cycle) must not be destroyed by a
            # garbage collection that happens to run inside a capture: that invalidates it.
            gc.collect()
            try:
                for key in new:
                    registry = self._prefix_graphs if len(key) == 3 else self._denoise_graphs
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: a capture mid-run must not fail CUDA calls of other threads (envs, weight staging)
                    with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                        stages[len(key)](*key)
                    registry[key] = graph
                    self._met.add(key)
                    self.stats.captures += 1
                    self.stats.graph_keys.append(key)
            except RuntimeError as err:
                raise CaptureError(
                    f"CUDA graph capture of shape {key} failed ({err}). Remedies: (1) a smaller max_batch_size; "
                    "(2) fewer batch_buckets, prompt_buckets, num_steps or camera_sets; (3) cuda_graphs=False to "
                    "run eagerly (slower, same results)."
                ) from err
        self.stats.capture_seconds += time.perf_counter() - start

    # ------------------------------------------------------------------------------------ stage bodies
    def _prefix_stage(self, b: int, length: int, cams: tuple[int, ...]) -> None:
        """Static buffers [:b] -> prefix K/V in the cache buffers, key mask, positions, prefix value."""
        buf = self.buffers
        assert buf is not None
        if len(cams) < buf.images.shape[1]:
            index = self._camera_index(cams)
            images, image_mask = buf.images[:b].index_select(1, index), buf.image_mask[:b].index_select(1, index)
        else:
            images, image_mask = buf.images[:b], buf.image_mask[:b]
        t = len(cams) * self.model.config.vision.num_patches + length
        kv_out = [(k[:b, :, :t], v[:b, :, :t]) for k, v in zip(buf.keys, buf.values)]  # written by the LM stage
        cache = run_prefix_stage(self.model, images, image_mask, buf.tokens[:b, :length], buf.lengths[:b], kv_out,
                                 self.config.fused_kernels)  # fmt: skip
        buf.key_mask[:b, :t].copy_(cache.key_mask)
        buf.num_valid[:b].copy_(cache.num_valid)
        buf.valid_first = cache.valid_first  # the same for every stage of this model, dtype and device
        value = prefix_values(self.model, cache)
        if value is not None:
            buf.prefix_pooled[:b].copy_(value[0])
            buf.prefix_value[:b].copy_(value[1])

    def _camera_index(self, cams: tuple[int, ...]) -> torch.Tensor:
        """Device index tensor of a camera set (built once; no host copy inside a capture)."""
        index = self._camera_indices.get(cams)
        if index is None:
            index = self._camera_indices[cams] = torch.tensor(cams, dtype=torch.int64, device=self.device)
        return index

    def _cache_view(self, b: int, t: int) -> PrefixCache:
        buf = self.buffers
        assert buf is not None
        h = self.model.config.action_horizon
        keys = [k[:b, :, : t + h] for k in buf.keys]
        values = [v[:b, :, : t + h] for v in buf.values]
        return PrefixCache(keys, values, buf.key_mask[:b, :t], buf.num_valid[:b], suffix_offset=t,
                           valid_first=buf.valid_first)  # fmt: skip

    def _denoise_stage(self, b: int, length: int, cams: tuple[int, ...], k: int, learned: bool = False) -> None:
        """Static buffers [:b] -> chain, log-probs, values, denoise indices for K = k (`learned`: the noise head)."""
        buf, mcfg = self.buffers, self.model.config
        assert buf is not None and self.tables is not None
        t = len(cams) * mcfg.vision.num_patches + length
        cache = self._cache_view(b, t)
        seeds, counters = buf.seeds[:b], buf.counters[:b]
        x0, xi = draw_noise(seeds, counters, k, mcfg.action_horizon, mcfg.action_dim)
        ctrl, inds = controls(ControlInputs(**buf.switches), seeds, counters, k)
        has_prefix_value = mcfg.value_source == "prefix" and self.model.value_head is not None
        prefix_value = buf.prefix_value[:b] if has_prefix_value else None
        fused = self.config.fused_kernels
        out = run_denoise_stage(self.model, cache, self.tables[k], x0, xi, ctrl, prefix_value, fused, learned)
        buf.chain[:b, : k + 1].copy_(out.chain)
        buf.log_prob[:b].copy_(out.log_prob_elements)
        buf.out_values[:b].copy_(out.values)
        buf.denoise_inds[:b, :k].copy_(inds)

    # --------------------------------------------------------------------------------------- requests
    def bucket_for(self, n: int) -> int:
        """Smallest captured batch bucket >= n (n <= max_batch_size)."""
        buckets = self.config.batch_buckets
        assert buckets is not None
        return buckets[bisect.bisect_left(buckets, n)]

    def _chunk_buckets(self, n: int) -> set[int]:
        """Buckets of the max_batch_size chunks a call of `n` rows is split into."""
        bmax = self.config.max_batch_size
        return {self.bucket_for(min(bmax, n - start)) for start in range(0, n, bmax)}

    def prompt_bucket_for(self, length: int) -> int:
        """Smallest prompt bucket >= length."""
        i = bisect.bisect_left(self.prompt_buckets, length)
        if i == len(self.prompt_buckets):
            raise GraphKeyError(
                f"prompt length {length} exceeds the largest prompt bucket {self.prompt_buckets[-1]} "
                "(model max_token_len); the processor truncates prompts to max_token_len."
            )
        return self.prompt_buckets[i]

    def _check(self, inputs: ModelInputs, opts: RolloutConfig) -> tuple[int, ...]:
        if self.buffers is None:
            raise RuntimeError("Pi05Scheduler.setup() has not been called; call it once before act().")
        if opts.num_steps not in self.config.num_steps:
            raise GraphKeyError(
                f"num_steps={opts.num_steps} was not declared in setup(num_steps={self.config.num_steps}); "
                "declare it in SchedulerConfig.num_steps (a table and graphs are built per K)."
            )
        if opts.method == "noise" and self.model.noise_head is None:
            raise ValueError(NO_NOISE_HEAD)
        cams = tuple(inputs.slots)
        if cams not in self.config.camera_sets:
            raise GraphKeyError(
                f"camera set {cams} was not declared in setup(camera_sets={self.config.camera_sets}); "
                "add it to SchedulerConfig.camera_sets."
            )
        return cams

    def _load(self, inputs: ModelInputs, seeds, counters, opts: RolloutConfig | None, b: int, length: int) -> None:
        """Copy a chunk of <= b rows into the static buffers; pad rows get harmless values."""
        buf = self.buffers
        assert buf is not None
        n = inputs.batch_size
        slots = list(inputs.slots)
        if slots == list(range(buf.images.shape[1])):
            buf.images[:n].copy_(inputs.images)
            buf.image_mask[:n].copy_(inputs.image_mask)
        else:  # index_copy_ writes in place (a fancy-indexed view would be a copy)
            index = self._camera_index(tuple(slots))
            buf.images[:n].index_copy_(1, index, inputs.images)
            buf.image_mask[:n].index_copy_(1, index, inputs.image_mask)
        buf.tokens[:n, : inputs.tokens.shape[1]].copy_(inputs.tokens)
        buf.tokens[:n, inputs.tokens.shape[1] : length].zero_()
        buf.lengths[:n].copy_(inputs.lengths)
        buf.seeds[:n].copy_(seeds)
        buf.counters[:n].copy_(counters)
        if b > n:  # pad rows: one valid token, real images slots masked on, zero pixels
            buf.images[n:b].zero_()
            buf.image_mask[n:b].fill_(True)
            buf.tokens[n:b].zero_()
            buf.lengths[n:b].fill_(1)
            buf.seeds[n:b].zero_()
            buf.counters[n:b].zero_()
        if opts is not None:
            for name, value in self._switches(opts).items():
                buf.switches[name].copy_(value)

    def _switches(self, opts: RolloutConfig) -> dict[str, torch.Tensor]:
        """Device tensors of the per-call switches, built once per distinct options (no host copy in each call)."""
        cached = self._switch_cache.get(opts)
        if cached is None:
            mcfg = self.model.config
            inp = ControlInputs.from_options(
                opts, mcfg.action_horizon, mcfg.action_dim, mcfg.value_chunk_only, self.device
            )
            cached = self._switch_cache[opts] = inp.tensors()
        return cached

    def _run_prefix(self, b: int, length: int, cams: tuple[int, ...]) -> None:
        if self.use_graphs:
            self._prefix_graphs[(b, length, cams)].replay()
            self.stats.replays += 1
        else:
            with torch.no_grad():
                self._prefix_stage(b, length, cams)
            self.stats.eager_calls += 1

    def _run_denoise(self, b: int, length: int, cams: tuple[int, ...], k: int, learned: bool = False) -> None:
        if self.use_graphs:
            self._denoise_graphs[(b, length, cams, k, learned)].replay()
            self.stats.replays += 1
        else:
            with torch.no_grad():
                self._denoise_stage(b, length, cams, k, learned)
            self.stats.eager_calls += 1

    def rollout(
        self,
        inputs: ModelInputs,
        seeds: torch.Tensor,
        counters: torch.Tensor,
        opts: RolloutConfig,
        keep_prefix: bool = False,
    ) -> tuple[RolloutOutputs, torch.Tensor]:
        """Run a rollout for N rows (split over max_batch_size); returns fresh tensors and denoise indices.

        With `keep_prefix` the outputs carry a copy of the prefix K/V (`RolloutOutputs.prefix`).
        """
        cams = self._check(inputs, opts)
        learned = opts.method == "noise"  # `_check`: the model has the head
        length = self.prompt_bucket_for(inputs.tokens.shape[1])
        k, bmax = opts.num_steps, self.config.max_batch_size
        t = len(cams) * self.model.config.vision.num_patches + length
        for b in self._chunk_buckets(inputs.batch_size):  # before loading: a first use's warm-up writes the buffers
            self._ensure(b, length, cams, k, learned)
        parts, prefixes = [], []
        for start in range(0, inputs.batch_size, bmax):
            index = slice(start, start + bmax)
            chunk = inputs.select(index)
            n = chunk.batch_size
            b = self.bucket_for(n)
            self._load(chunk, seeds[index], counters[index], opts, b, length)
            self._run_prefix(b, length, cams)
            if keep_prefix:  # before the denoise steps write action K/V into invalid prefix rows
                prefixes.append(self._stored_prefix(n, t))
            self._run_denoise(b, length, cams, k, learned)
            buf = self.buffers
            assert buf is not None
            parts.append(
                (
                    buf.chain[:n, : k + 1].clone(),
                    buf.log_prob[:n].clone(),
                    buf.out_values[:n].clone(),
                    buf.denoise_inds[:n, :k].clone(),
                )
            )
        chain, lp, values, inds = (torch.cat(x) for x in zip(*parts))
        prefix = StoredPrefix.cat(prefixes) if prefixes else None
        return RolloutOutputs(chain, lp, values, prefix), inds

    def _stored_prefix(self, n: int, t: int) -> StoredPrefix:
        """A copy of rows [:n] of the prefix K/V (T = t tokens), key mask and pooled output."""
        buf = self.buffers
        assert buf is not None
        layers = [x[:n, :, :t] for kv in zip(buf.keys, buf.values) for x in kv]
        kv = torch.stack(layers, dim=1)  # (n, 2 * depth, Nkv, t, hd): one copy kernel
        kv = kv.view(n, len(buf.keys), 2, *kv.shape[2:])
        has_pooled = self.model.config.value_source == "prefix" and self.model.value_head is not None
        pooled = buf.prefix_pooled[:n].clone() if has_pooled else None
        return StoredPrefix(kv, buf.key_mask[:n, :t].clone(), pooled)

    def prefix_value(self, inputs: ModelInputs) -> torch.Tensor:
        """(N,) prefix-source critic values; runs only the prefix graphs."""
        cams = tuple(inputs.slots)
        if cams not in self.config.camera_sets:
            raise GraphKeyError(f"camera set {cams} was not declared in setup(camera_sets={self.config.camera_sets}).")
        length = self.prompt_bucket_for(inputs.tokens.shape[1])
        for b in self._chunk_buckets(inputs.batch_size):
            self._ensure(b, length, cams, None)
        out = []
        zeros = torch.zeros(inputs.batch_size, dtype=torch.int64, device=self.device)
        for start in range(0, inputs.batch_size, self.config.max_batch_size):
            index = slice(start, start + self.config.max_batch_size)
            chunk = inputs.select(index)
            b = self.bucket_for(chunk.batch_size)
            self._load(chunk, zeros[index], zeros[index], None, b, length)
            self._run_prefix(b, length, cams)
            assert self.buffers is not None
            out.append(self.buffers.prefix_value[: chunk.batch_size].clone())
        return torch.cat(out)

    def refresh_tables(self, names: Collection[str] | None = None) -> None:
        """Recompute the weight-derived tables and the fused weight copies in place (after a weight change).

        A weight commit calls it with the committed parameter names (`names`: only the fused copies of the stacks
        they touch are refreshed); call it without names after changing weights in place any other way. Storage
        is kept, so captured graphs stay valid and nothing is recaptured.
        """
        if self.tables is not None:
            self.tables.refresh()
        self.model.refresh_fused_weights(names)
