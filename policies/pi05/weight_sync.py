"""Weight sync (DESIGN C6): transactional, in-place weight updates of a running `Pi05Policy`.

One update is a transaction::

    begin_weight_update(expected)        fix the names this update must deliver
    update_weights(named_tensors)  ...   validate names / shapes / duplicates, stage copies on a side stream
    finish_weight_update()               check completeness and finiteness, then commit in place
    abort_weight_update()                drop the staging buffers

Nothing is written into a parameter before `finish_weight_update` has validated everything, so an abort or
any failure leaves the weights bit-identical and the policy serving them. Staged tensors live in one flat
buffer per dtype (the parameter's dtype: fp32 islands stay fp32), filled on a dedicated CUDA stream with
non-blocking copies from GPU or pinned host memory.

Host cost per update is kept low: a plan per expected set (per-dtype names, buffer sizes, shapes) is built
once and reused while the parameters are the same objects with the same dtype, shape and device; staging
views are made in one call per dtype; the per-tensor checks are plain compares against the plan (the full
check with its message runs only for a tensor that fails them); plain tensors are read without detach;
copies in both directions are multi-tensor calls; the table refresh is one GEMM for all adaRMS norms and one
multi-tensor copy for the fused expert weights.

The commit is queued on the compute stream (the current stream of the thread calling `finish`, which is the
stream `act()` replays on): it waits on the staging stream and on the stream of every earlier weight reader,
copies into the existing parameter storage (never rebinding `.data`), refreshes the weight-derived tables in
place (`Pi05Scheduler.refresh_tables`) and records a commit event that the next reader waits on. Captured
CUDA graphs read parameters and tables by address, so they stay valid and nothing is recaptured; `act()`
serves the old weights until the commit, and the host never waits for the compute stream (finish waits for
the staging stream only: one min/max reduction per dtype checks finiteness). On CPU it all degenerates to
plain copies.

Locking: every step that touches the transaction, the commit included, holds the policy's `_lock` (the lock
`act()` holds), so `act()` and a commit never interleave on the host; a source iterator is consumed outside
it, so `act()` keeps serving while a trainer streams tensors. `close()` aborts an update in flight.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
import time
import weakref
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch._utils import _unflatten_dense_tensors

from .checkpoint import TIED_EMBEDDING, to_internal_name
from .model import aliases

if TYPE_CHECKING:
    from .model import Pi05Model
    from .scheduler import Pi05Scheduler

WeightSource = Mapping[str, Any] | Iterable[tuple[str, Any]] | torch.nn.Module
"""A mapping name -> tensor, an iterable of (name, tensor) pairs, or an `nn.Module` (its named_parameters)."""

_GROUP_TENSORS = 128
"""Tensors of one `update_weights` call are validated and staged in groups of at most this many ..."""
_GROUP_BYTES = 256 << 20
"""... or this many source bytes (bounds what a generator's materialised tensors may pin)."""
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
"""Name segments that FSDP1, activation checkpointing and torch.compile insert into module names."""


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
"""Source value types staged without `materialize` (no `.full_tensor()` to call, no detach needed)."""


class WeightSyncError(ValueError):
    """A weight update was refused; the message names the tensor, what was expected, what came, and the fix.

    Whenever it is raised the update has ended and the weights are unchanged.
    """


class WeightSyncStateError(WeightSyncError, RuntimeError):
    """A weight-sync call out of order: finish/update/abort without begin, begin twice, use after close."""


@dataclass
class WeightUpdateReport:
    """What one committed weight update did.

    Attributes:
        version: the policy's weight version after the commit (what `PolicyOutput.header` reports from now on).
        names: our parameter names written, in arrival order.
        num_tensors: len(names).
        num_bytes: bytes written into parameters (in the parameters' dtypes).
        source_bytes: bytes read from the sources (in the sources' dtypes).
        skipped: source names not written: known dead keys, and (`sync_weights` only) parameters outside
            the expected set.
        duration_s: host seconds from `begin_weight_update` to the queued commit.
        expected: the expected set: "all", "trainable" or "list".
    """

    version: int
    names: list[str]
    num_tensors: int
    num_bytes: int
    source_bytes: int
    skipped: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    expected: str = "trainable"


class _ParamTable:
    """The model's named parameters, walked once and re-walked only when the module tree changed.

    `named_parameters()` is a generator walk over every module (about 1 ms for pi05_base's 800 modules on this
    machine's CPU, more on a slower host). `valid()` instead flattens every module's `_parameters` and
    `_modules` dicts with C-level iteration and compares keys and objects (by identity) with those seen at
    the walk (about 0.15 ms on the same CPU). A parameter or submodule added, removed, renamed or replaced
    anywhere in the tree invalidates the table; a parameter whose `.data` changed dtype, shape or device keeps
    its identity and is caught by `_Plan.valid_for`.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.dicts = [d for m in model.modules() for d in (m._parameters, m._modules)]
        self.sizes = list(map(len, self.dicts))
        self.full = [d for d in self.dicts if d]  # about half are empty (leaf modules' children, containers' params)
        self.keys = list(itertools.chain.from_iterable(self.full))
        self.values = list(itertools.chain.from_iterable(map(dict.values, self.full)))

    def valid(self) -> bool:
        return (
            list(map(len, self.dicts)) == self.sizes  # an entry added anywhere, or one removed
            and all(map(operator.is_, itertools.chain.from_iterable(map(dict.values, self.full)), self.values))
            and list(itertools.chain.from_iterable(self.full)) == self.keys
        )


class _Plan:
    """What an expected set needs per update, built once and reused.

    Valid while the parameters are the same objects with the same dtype, shape and device: per dtype the
    names, parameters and buffer size, per name the shape and whether it is floating point (the checks
    `_stage` runs per tensor as plain compares).
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], expected: list[str]) -> None:
        self.expected = expected
        self.plist = [params[n] for n in expected]
        self.signature = _signature(self.plist)
        self.device = self.plist[0].device
        by_dtype: dict[torch.dtype, tuple[list[str], list[torch.nn.Parameter]]] = {}
        for name, p in zip(expected, self.plist):
            names, ps = by_dtype.setdefault(p.dtype, ([], []))
            names.append(name)
            ps.append(p)
        self.groups = [(dt, names, ps, sum(p.numel() for p in ps)) for dt, (names, ps) in by_dtype.items()]
        self.shapes = {n: p.shape for n, p in zip(expected, self.plist)}
        self.floating = {n: p.is_floating_point() for n, p in zip(expected, self.plist)}
        self.nbytes = {n: p.numel() * p.element_size() for n, p in zip(expected, self.plist)}
        # check_weight_manifest results of passed manifests, valid for the parameter table they were checked with
        self.manifest_checks: dict[tuple, list[bool]] = {}
        self.manifest_table: dict[str, torch.nn.Parameter] | None = None
        # staging buffers (per dtype) and their slot views, kept between updates; see `staging`
        self._staging: tuple[dict[torch.dtype, torch.Tensor], dict[str, torch.Tensor]] | None = None
        self._commit: tuple[Any, _CopyGroups] | None = None  # (fused rows it was built for, the copy groups)
        self._prepare: tuple[Any, Any, dict[int, torch.Tensor] | None] | None = None  # (tables, graph, its outputs)

    def staging(self, stream: Any) -> tuple[dict[torch.dtype, torch.Tensor], dict[str, torch.Tensor]]:
        """The flat staging buffer of each dtype and the slot view of each name, allocated on first use.

        Kept for the next update of this set (allocating and viewing 1 GB in ~220 slots cost ~1 ms of host time
        per update on the H200 host); an update's writes are ordered after the previous commit read them.
        """
        if self._staging is None:
            arenas: dict[torch.dtype, torch.Tensor] = {}
            slots: dict[str, torch.Tensor] = {}
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for dt, names, ps, numel in self.groups:
                    arena = arenas[dt] = torch.empty(numel, dtype=dt, device=self.device)
                    slots.update(zip(names, _unflatten_dense_tensors(arena, ps)))  # views, one C++ call
            self._staging = (arenas, slots)
        return self._staging

    @property
    def kept(self) -> list[tuple[torch.dtype, torch.Tensor, list[str]]] | None:
        """The staging layout kept for the next update (per dtype: buffer, slot names), None when not allocated."""
        if self._staging is None:
            return None
        arenas = self._staging[0]
        return [(dt, arenas[dt], list(names)) for dt, names, _, _ in self.groups]

    def release_staging(self) -> None:
        """Drop the staging buffers (freed once the commits that read them ran; see `_commit`)."""
        self._staging = None
        self._commit = None
        self._prepare = None

    def prepare_tables(self, tables: Any, stream: Any) -> dict[int, torch.Tensor]:
        """`tables.prepare` from the staged values, queued on `stream` (the current stream).

        On CUDA the second update of a plan captures the preparation into a CUDA graph (it reads the staging slots,
        whose addresses the plan keeps, and the constant step tables), and later updates replay it: one launch
        instead of ~10 kernels and their host work, which a receiver of a broadcast must finish before the data
        lands. The graph's outputs are reused; each update's commit has copied them out before the next update
        writes its staging buffers (`begin_weight_update` orders the staging stream after the last commit).
        """
        assert self._staging is not None
        slots = self._staging[1]
        cached = self._prepare
        if stream is None or (cached is not None and cached[0] is tables and cached[1] is None):
            return tables.prepare(slots)  # CPU, or a capture that failed: eager
        if cached is not None and cached[0] is tables:
            cached[1].replay()
            return cached[2]
        out = tables.prepare(slots)  # eager, and the warm-up of the capture below
        graph = torch.cuda.CUDAGraph()
        try:
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                captured = tables.prepare(slots)
            finally:
                graph.capture_end()
            self._prepare = (tables, graph, captured)
        except Exception:  # not capturable here: stay eager for this plan
            self._prepare = (tables, None, None)
        return out

    def commit_groups(self, fused_rows: list[tuple[str, torch.Tensor]]) -> _CopyGroups:
        """The copies of a complete update, grouped for `_foreach_copy_`, built once per set of fused buffers.

        Every (parameter <- its slot), and (fused row <- the slot of its parameter) for each fused row that is not
        the parameter's own storage (`Pi05Model.build_fused_expert` makes them one; the plan is rebuilt when a
        parameter's storage moves, see `valid_for`).
        """
        assert self._staging is not None
        if self._commit is None or self._commit[0] is not fused_rows:
            slots, params = self._staging[1], dict(zip(self.expected, self.plist))
            stale = [(name, row) for name, row in fused_rows if name in slots and not aliases(params[name], row)]
            dsts = list(self.plist) + [row for _, row in stale]
            srcs = [slots[n] for n in self.expected] + [slots[name] for name, _ in stale]
            self._commit = (fused_rows, _group_pairs(dsts, srcs))
        return self._commit[1]

    def valid_for(self, params: dict[str, torch.nn.Parameter]) -> bool:
        """True while every planned name is still the same parameter with the same dtype, shape, device and storage."""
        try:
            plist = [params[n] for n in self.expected]
        except KeyError:
            return False
        return all(a is b for a, b in zip(plist, self.plist)) and _signature(plist) == self.signature


def _signature(plist: list[torch.nn.Parameter]) -> list[tuple[Any, ...]]:
    return [(p.dtype, p.shape, p.device, p.data_ptr()) for p in plist]


class _Transaction:
    """The state of one open update: expected names, the staging buffers, what has arrived."""

    def __init__(self, params: dict[str, torch.nn.Parameter], plan: _Plan, mode: str, stream: Any) -> None:
        self.params = params
        self.plan = plan
        self.expected = plan.expected
        self.expected_set = frozenset(plan.expected)
        self.mode = mode
        self.started = time.perf_counter()
        self.stream: torch.cuda.Stream | None = stream  # the policy's staging stream (None on CPU)
        # the plan's flat staging buffers (one per dtype, reused) and their views (one per expected parameter)
        self.arenas, self.slots = plan.staging(stream)
        self.received: dict[str, tuple[str, int]] = {}  # our name -> (source name, source bytes)
        self.skipped: list[str] = []
        self.validated = False
        self.flag_issued = False  # `weight_update_ok` returned a finiteness flag for what is staged now
        self.prepared: dict[int, torch.Tensor] | None = None  # tables computed from the staged values
        self.staged_event: Any = None  # on the staging stream: the staged values (and their check) are complete

    def staged_more(self) -> None:
        """New data arrived: a passed check, a finiteness flag and the prepared tables no longer cover it."""
        self.validated = self.flag_issued = False
        self.prepared = self.staged_event = None

    def ours(self, name: str) -> str | None:
        """Our name for a source name (ours pass through without the prefix mapping)."""
        return name if name in self.params else to_internal_name(name)

    def on_stream(self) -> contextlib.AbstractContextManager:
        """Context that makes the staging stream current (nothing on CPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()


_CopyGroups = tuple[list[tuple[list[torch.Tensor], list[torch.Tensor]]], list[tuple[torch.Tensor, torch.Tensor]]]
"""(per (device, dtype): destinations and sources, for one `_foreach_copy_` each; the other pairs, one by one)."""


def _group_pairs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> _CopyGroups:
    """Copy pairs grouped by (device, dtype) where both sides agree; the rest (casts, cross-device) apart.

    The fused CUDA route of `_foreach_copy_` needs one dtype across the whole list; a mixed list (bf16 blocks
    and float32 islands) falls back to one copy per tensor.
    """
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    slow = []
    for d, s in zip(dsts, srcs):
        if d.device == s.device and d.dtype == s.dtype and hasattr(torch, "_foreach_copy_"):
            gd, gs = groups.setdefault((d.device, d.dtype), ([], []))
            gd.append(d)
            gs.append(s)
        else:
            slow.append((d, s))
    return list(groups.values()), slow


def _copy_groups(copies: _CopyGroups, non_blocking: bool) -> None:
    groups, slow = copies
    for gd, gs in groups:
        torch._foreach_copy_(gd, gs, non_blocking=non_blocking)
    for d, s in slow:
        d.copy_(s, non_blocking=non_blocking)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    """dst.copy_(src) for every pair; same-device same-dtype pairs in one multi-tensor call per dtype."""
    _copy_groups(_group_pairs(dsts, srcs), non_blocking)


def materialize(tensor: Any, name: str, where: str) -> torch.Tensor:
    """A plain detached tensor; DTensors (FSDP2 trainers) are materialised with `.full_tensor()`.

    `.full_tensor()` is a collective over the DTensor's mesh: every rank of that mesh must call it in order.
    """
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    if not isinstance(tensor, torch.Tensor):
        raise WeightSyncError(
            f"{where}: the value for {name!r} is a {type(tensor).__name__}, expected a torch.Tensor (or a DTensor); "
            "pass (name, tensor) pairs."
        )
    return tensor.detach()


def iter_named_tensors(source: Any, where: str) -> Iterator[tuple[str, Any]]:
    """(name, value) pairs of a mapping or an iterable of pairs; values are not materialised yet."""
    if isinstance(source, (str, bytes, torch.Tensor)) or not isinstance(source, (Mapping, Iterable)):
        raise WeightSyncError(
            f"{where}: expected a mapping name -> tensor or an iterable of (name, tensor) pairs, "
            f"got {type(source).__name__}."
        )
    items = source.items() if isinstance(source, Mapping) else source
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise WeightSyncError(
                f"{where}: expected (name, tensor) pairs, got an item of type {type(item).__name__}; pass a "
                "mapping or e.g. model.named_parameters()."
            )
        yield item[0], item[1]


def source_pairs(source: WeightSource, where: str, trainable_only: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, value) pairs of any weight source, with module-wrapper prefixes removed from module names.

    For a mapping that holds both the token embedding and LeRobot's tied `lm_head` copy of it, the tied copy
    is left out (they are one tensor). `trainable_only` keeps an `nn.Module`'s `requires_grad` parameters.
    """
    if isinstance(source, torch.nn.Module):
        yield from zip(*source_lists(source, where, trainable_only))
        return
    tied_dup = isinstance(source, Mapping) and _tied_duplicate(list(source))
    for name, value in iter_named_tensors(source, where):
        if tied_dup and name.removeprefix("model.") == TIED_EMBEDDING:
            continue
        yield name, value


def source_lists(source: WeightSource, where: str, trainable_only: bool = False) -> tuple[list[str], list[Any]]:
    """`source_pairs` as (names, values) lists, without per-pair Python for a module or a dict.

    A module's named parameters come from a cached `_ParamTable` (re-walked only when its module tree changed);
    a dict's from its keys and values lists. A trainer's sync calls this every iteration on the same source.
    """
    if isinstance(source, torch.nn.Module):
        cached = _MODULE_TABLES.get(source)
        if cached is None or not cached[0].valid():
            table = _ParamTable(source)
            names = []
            for name in table.params:
                for segment in _WRAPPER_SEGMENTS:
                    name = name.replace(segment, "")
                names.append(name[len("module.") :] if name.startswith("module.") else name)
            cached = _MODULE_TABLES[source] = (table, names, list(table.params.values()))
        _, names, params = cached
        if not trainable_only:
            return list(names), list(params)
        keep = [p.requires_grad for p in params]
        return list(itertools.compress(names, keep)), list(itertools.compress(params, keep))
    if type(source) is dict and all(type(k) is str for k in source):
        names, values = list(source), list(source.values())
        if _tied_duplicate(names):
            keep = [n.removeprefix("model.") != TIED_EMBEDDING for n in names]
            return list(itertools.compress(names, keep)), list(itertools.compress(values, keep))
        return names, values
    pairs = list(source_pairs(source, where, trainable_only))
    return [n for n, _ in pairs], [v for _, v in pairs]


_MODULE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per source module: its `_ParamTable`, the names with wrapper segments removed, the parameters."""


def _tied_duplicate(names: list[str]) -> bool:
    """The names hold both the token embedding and LeRobot's tied `lm_head` copy of it (memoised per names)."""
    key = tuple(names)
    if _TIED.get("key") != key:
        _TIED.update(key=key, value=sum(to_internal_name(k) == "llm.embed_tokens.weight" for k in names) > 1)
    return _TIED["value"]


_TIED: dict[str, Any] = {}


class WeightSyncMixin:
    """Transactional in-place weight updates for `Pi05Policy` (DESIGN C6).

    `expected` fixes what an update must deliver: "trainable" (default: the parameters with
    `requires_grad`, RLinf's sync set), "all", or a list of names. Names may be ours or LeRobot / openpi
    names (`checkpoint.to_internal_name`, the mapping checkpoint loading uses); DTensors are materialised
    with `.full_tensor()`. Values are cast to each parameter's dtype. `update_weights` refuses unknown
    names, names outside the expected set, a name sent twice and wrong shapes at once; `finish` refuses
    missing names and non-finite values. Every refusal raises `WeightSyncError`, ends the update and
    leaves the weights bit-identical. Source tensors must stay unchanged until `finish` returns.

    Example:
        >>> policy = Pi05Policy.from_config(Pi05Config.tiny(), action_dim=7)  # doctest: +SKIP
        >>> trainer = copy.deepcopy(policy.model)  # doctest: +SKIP
        >>> policy.begin_weight_update(expected="trainable")  # doctest: +SKIP
        >>> for name, p in trainer.named_parameters():  # doctest: +SKIP
        ...     if p.requires_grad:
        ...         policy.update_weights([(name, p)])
        >>> policy.finish_weight_update().version  # doctest: +SKIP
        1
        >>> policy.sync_weights(trainer).version  # the same in one call  # doctest: +SKIP
        2
    """

    # Provided by Pi05Policy.
    model: Pi05Model
    scheduler: Pi05Scheduler
    device: torch.device
    weight_version: int
    _lock: threading.RLock

    # Weight-sync state (class defaults; instances assign their own under `_lock`).
    _weight_update: _Transaction | None = None
    _last_update_end: str | None = None
    _weights_poisoned: str | None = None
    _commit_event: torch.cuda.Event | None = None
    _reader_events: dict[int, torch.cuda.Event] | None = None
    _staging_stream: torch.cuda.Stream | None = None  # one per policy: the allocator reuses its staging memory
    _sync_plans: dict[tuple[str, ...], _Plan] | None = None  # per expected set, reused while still valid
    _param_table: _ParamTable | None = None  # the model's named parameters, reused while the tree is unchanged

    # ------------------------------------------------------------------------------------- public API
    @property
    def weight_update_in_progress(self) -> bool:
        """True between `begin_weight_update` and the end of that update."""
        return self._weight_update is not None

    def begin_weight_update(self, expected: str | Sequence[str] = "trainable") -> None:
        """Open an update that must deliver `expected`: "trainable", "all", or a list of names."""
        with self._lock:
            if getattr(self, "_closed", False):
                raise WeightSyncStateError("begin_weight_update: the policy is closed; create a new policy.")
            if self._weight_update is not None:
                txn = self._weight_update
                raise WeightSyncStateError(
                    f"begin_weight_update: an update (expected={txn.mode!r}, {len(txn.received)} tensors staged, "
                    f"begun {time.perf_counter() - txn.started:.1f} s ago) is already in progress; "
                    "finish_weight_update() or abort_weight_update() it first."
                )
            table = self._param_table
            if table is None or not table.valid():
                table = self._param_table = _ParamTable(self.model)
            params = table.params
            names, mode = _resolve_expected(expected, params)
            if self.device.type == "cuda" and self._staging_stream is None:
                self._staging_stream = torch.cuda.Stream(self.device)
            plan = self._plan(params, names)
            for other in self._sync_plans.values():  # one set of staging buffers at a time
                if other is not plan:
                    other.release_staging()
            if self._commit_event is not None:  # staging buffers are reused: write after the last commit read them
                self._staging_stream.wait_event(self._commit_event)  # type: ignore[union-attr]
                torch.cuda.current_stream(self.device).wait_event(self._commit_event)
            self._weight_update = _Transaction(params, plan, mode, self._staging_stream)

    def update_weights(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> int:
        """Validate and stage tensors (a mapping or (name, tensor) pairs); returns how many were staged.

        May be called any number of times in any order. Known dead keys (the expert's unused LM head) are
        skipped. The source is read outside the policy lock, so `act()` keeps serving the old weights.
        """
        with self._lock:
            txn = self._require("update_weights")
        return self._update(txn, iter_named_tensors(named_tensors, "update_weights"), skip_outside=False)

    def _update(self, txn: _Transaction, pairs: Iterator[tuple[str, Any]], skip_outside: bool) -> int:
        """`update_weights` on (name, value) pairs.

        `skip_outside` (sync_weights) skips and reports parameters outside the expected set before they are
        materialised, instead of refusing them in validation.
        """
        staged, group, group_bytes = 0, [], 0
        txn.staged_more()
        # the first groups are small so the first copies start early; then up to the bounds
        limit_tensors, limit_bytes = 8, 16 << 20
        params, expected_set = txn.params, txn.expected_set
        try:
            for name, value in pairs:
                ours = name if name in params else to_internal_name(name)
                if skip_outside and ours is not None and ours in params and ours not in expected_set:
                    txn.skipped.append(name)
                    continue
                # plain tensors are used as they are (only read as copy sources under no_grad); else materialize
                tensor = value if type(value) in _PLAIN_TENSOR_TYPES else materialize(value, name, "update_weights")
                nbytes = tensor.numel() * tensor.element_size()
                group.append((name, ours, tensor, nbytes))
                group_bytes += nbytes
                if len(group) >= limit_tensors or group_bytes >= limit_bytes:
                    staged += self._stage(txn, group)
                    group, group_bytes = [], 0
                    limit_tensors = min(2 * limit_tensors, _GROUP_TENSORS)
                    limit_bytes = min(2 * limit_bytes, _GROUP_BYTES)
            staged += self._stage(txn, group)
        except WeightSyncStateError:
            raise
        except WeightSyncError as err:
            self._end(txn, f"failed: {err}")
            raise
        except Exception as err:
            self._end(txn, f"the source raised {type(err).__name__}")
            raise WeightSyncError(
                f"update_weights: reading or staging the source raised {type(err).__name__}: {err}. The update was "
                "aborted and the weights are unchanged; fix the source and begin a new update."
            ) from err
        except BaseException:
            self._end(txn, "interrupted")
            raise
        return staged

    def validate_weight_update(self) -> None:
        """Run finish's checks (every expected name arrived, all values finite) without committing.

        On failure the update ends and `WeightSyncError` is raised. `finish` does not repeat a passed check.
        """
        with self._lock:
            txn = self._require("validate_weight_update")
            try:
                self._validate(txn, "validate_weight_update")
            except BaseException as err:
                self._end(txn, f"failed: {err}")
                raise

    def weight_update_ok(self, checked: Collection[torch.dtype] = ()) -> torch.Tensor:
        """`validate_weight_update` without waiting for the device: for a vote taken on the device.

        The completeness check runs now (a failure ends the update and raises, as in `validate_weight_update`);
        the finiteness reduction is only queued, and so are the weight-derived tables from the staged values (the
        commit then copies them in instead of computing them). Returns a 0-d bool tensor on the policy's device,
        True when every staged value is finite, ready for use on the current stream. Staging buffers of the dtypes in
        `checked` are left out (the caller reduced their bytes already). When the flag came back True,
        ``finish_weight_update(checked=True)`` commits without reducing again; a later `update_weights` or
        `mark_staged` voids the flag. On False, `validate_weight_update` names the tensors.

        Example:
            >>> # ok = policy.weight_update_ok(); dist.all_reduce(ok_as_int, MIN); then finish or abort
        """
        with self._lock:
            txn = self._require("weight_update_ok")
            try:
                _raise_missing(txn, [n for n in txn.expected if n not in txn.received], "weight_update_ok")
            except BaseException as err:
                self._end(txn, f"failed: {err}")
                raise
            flag = _finite_flag(txn, frozenset(checked))
            if txn.stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(txn.stream)
                txn.staged_event = torch.cuda.Event()
                txn.staged_event.record(txn.stream)
            txn.flag_issued = True
            if self.scheduler.tables is not None:  # after the wait above: a vote on the flag does not wait for these
                with txn.on_stream():
                    txn.prepared = txn.plan.prepare_tables(self.scheduler.tables, txn.stream)
            return flag

    def finish_weight_update(self, *, version: int | None = None, checked: bool = False) -> WeightUpdateReport:
        """Validate, then commit in place; returns the report.

        `version` (> the current one) sets the new version explicitly (the distributed protocol uses it so
        that every rank agrees); the default is the current version + 1. ``checked=True``: the flag of the last
        `weight_update_ok` was True (the caller read it, e.g. in a vote), so the finiteness reduction is skipped.
        """
        with self._lock:
            txn = self._require("finish_weight_update")
            if checked and not txn.flag_issued:
                raise WeightSyncStateError(
                    "finish_weight_update: checked=True needs the flag of weight_update_ok() for the staged data "
                    "(none was taken since the last update_weights / mark_staged); call weight_update_ok() and "
                    "commit only when it is True, or pass checked=False."
                )
            txn.validated = txn.validated or checked
            try:
                self._validate(txn, "finish_weight_update")
                new_version = self.weight_version + 1 if version is None else int(version)
                if new_version <= self.weight_version:
                    raise WeightSyncError(
                        f"finish_weight_update: version must increase: expected > {self.weight_version}, "
                        f"received {new_version}; pass a larger version or None."
                    )
            except BaseException as err:
                self._end(txn, f"failed: {err}")
                raise
            self._commit(txn)
            self.weight_version = new_version
            self._end(txn, f"committed version {new_version}")
            names = list(txn.received)
            return WeightUpdateReport(
                version=new_version,
                names=names,
                num_tensors=len(names),
                num_bytes=sum(txn.plan.nbytes[n] for n in names),
                source_bytes=sum(b for _, b in txn.received.values()),
                skipped=list(txn.skipped),
                duration_s=time.perf_counter() - txn.started,
                expected=txn.mode,
            )

    def abort_weight_update(self) -> None:
        """Drop the open update; the weights stay as they are (nothing was written yet)."""
        with self._lock:
            self._end(self._require("abort_weight_update"), "aborted by abort_weight_update()")

    def sync_weights(self, source: WeightSource, expected: str | Sequence[str] = "trainable") -> WeightUpdateReport:
        """One-call update from an `nn.Module` (its named_parameters), a state dict, or (name, tensor) pairs.

        Takes from `source` what the update expects: source parameters outside the expected set (e.g. the
        frozen VLM of a full trainer model) are skipped and reported; unknown names are refused.
        """
        self.begin_weight_update(expected)
        with self._lock:
            txn = self._weight_update
        assert txn is not None
        try:
            with self._lock:
                self._require("update_weights")
            self._update(txn, source_pairs(source, "sync_weights"), skip_outside=True)
            return self.finish_weight_update()
        except BaseException:
            with self._lock:
                if self._weight_update is txn:
                    self._end(txn, "sync_weights failed")
            raise

    def check_weight_manifest(self, entries: Sequence[tuple[str, Sequence[int], torch.dtype]]) -> list[bool]:
        """Check (name, shape, dtype) entries against the open update before any data arrives.

        Returns per entry whether it will be staged (False: a dead key or a parameter outside the expected
        set). Unknown names, duplicates, wrong shapes or dtypes, and expected names the manifest lacks raise
        `WeightSyncError` and end the update. Used by the distributed protocol to refuse early.
        """
        with self._lock:
            txn = self._require("check_weight_manifest")
            # a manifest this plan passed before, checked against an update with nothing received yet, passes again
            key = tuple((name, tuple(shape), dtype) for name, shape, dtype in entries)
            plan = txn.plan
            if plan.manifest_table is not txn.params:
                plan.manifest_checks, plan.manifest_table = {}, txn.params
            cached = plan.manifest_checks.get(key) if not txn.received else None
            if cached is not None:
                return list(cached)
            try:
                keep, seen = [], {}
                for name, shape, dtype in entries:
                    ours = txn.ours(name)
                    if ours is not None and ours in txn.params and ours not in txn.expected_set:
                        keep.append(False)
                        continue
                    if ours is not None and ours in seen:
                        raise WeightSyncError(
                            f"check_weight_manifest: {ours!r} is listed twice (as {seen[ours]!r} and {name!r}); "
                            "send every parameter once per update."
                        )
                    checked = self._check_entry(txn, name, shape, dtype, "check_weight_manifest")
                    keep.append(checked is not None)
                    if checked is not None:
                        seen[checked] = name
                missing = [n for n in txn.expected if n not in seen and n not in txn.received]
                _raise_missing(txn, missing, "check_weight_manifest")
                if not txn.received:
                    if len(plan.manifest_checks) >= 4:
                        plan.manifest_checks.clear()
                    plan.manifest_checks[key] = list(keep)
                return keep
            except BaseException as err:
                self._end(txn, f"failed: {err}")
                raise

    def staging_layout(self) -> list[tuple[torch.dtype, torch.Tensor, list[str]]]:
        """The open update's staging buffers: per dtype the flat buffer and the names of its slots, in order.

        A sender that lays out a dtype's tensors in this order can write them straight into the buffer (the
        distributed protocol receives its buckets there); `mark_staged` then records them as received.
        """
        with self._lock:
            layout = self._require("staging_layout").plan.kept
            assert layout is not None  # an open update's plan holds its staging buffers
            return layout

    @contextlib.contextmanager
    def kept_weight_staging(self) -> Iterator[list[tuple[torch.dtype, torch.Tensor, list[str]]] | None]:
        """Hold the policy lock and yield the staging buffers kept from the last update, before any update opens.

        Yields the layout `staging_layout()` gives (per dtype the flat buffer and its slot names), or None when
        no buffers are kept, an update is open (its buffers are not to be touched) or the policy is closed. The
        current stream is ordered after the last commit (which read them), so writes queued on it may start
        at once: a broadcast receiver writes its buckets there while `begin_weight_update`, called inside the
        block, checks the parameters. Nothing is visible before a commit, and every update rewrites all its slots,
        so writing the buffers without an update changes nothing. An update that then stages into other buffers
        (its plan was rebuilt) is told apart by the buffers' identity.

        Example:
            >>> with policy.kept_weight_staging() as kept:  # doctest: +SKIP
            ...     post_receives(kept)  # queue receives into the kept buffers
            ...     policy.begin_weight_update("trainable")
        """
        with self._lock:
            layout = None
            if self._weight_update is None and not getattr(self, "_closed", False):
                layout = next((kept for plan in (self._sync_plans or {}).values() if (kept := plan.kept)), None)
                if layout is not None and self._commit_event is not None:
                    torch.cuda.current_stream(self.device).wait_event(self._commit_event)
            yield layout

    def mark_staged(self, names: Sequence[str]) -> None:
        """Record `names` as received after their bytes were written into `staging_layout()` buffers.

        Only for names the manifest check accepted (`check_weight_manifest`); the writes must be queued on the
        current stream (validation and commit are ordered after them).
        """
        with self._lock:
            txn = self._require("mark_staged")
            for name in names:
                if name not in txn.expected_set or name in txn.received:
                    raise WeightSyncError(f"mark_staged: {name!r} is not expected or was already received.")
                txn.received[name] = (name, txn.plan.nbytes[name])
            txn.staged_more()
            if txn.stream is not None:
                txn.stream.wait_stream(torch.cuda.current_stream(self.device))

    # ----------------------------------------------------------------------------- hooks for the policy
    @contextlib.contextmanager
    def _weights_in_use(self) -> Iterator[None]:
        """Wrap every read of the weights (act, value, evaluate); holds `_lock` while reading.

        Orders the read after the last commit and lets the next commit wait for it, without host sync.
        """
        with self._lock:
            if self._weights_poisoned is not None:
                raise WeightSyncStateError(
                    f"the policy's weights are inconsistent ({self._weights_poisoned}); it refuses to serve until "
                    "a complete update (begin_weight_update(expected='all')) commits."
                )
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            if stream is not None and self._commit_event is not None:
                stream.wait_event(self._commit_event)
            try:
                yield
            finally:
                if stream is not None:
                    if self._reader_events is None:
                        self._reader_events = {}
                    event = self._reader_events.setdefault(stream.cuda_stream, torch.cuda.Event())
                    event.record(stream)

    def release_weight_staging(self) -> None:
        """Give back the staging buffers kept between updates (the size of the last expected set's parameters).

        The next update allocates them again. Refused while an update is open.

        Example:
            >>> # after the last sync of a run: policy.release_weight_staging(); torch.cuda.empty_cache()
        """
        with self._lock:
            if self._weight_update is not None:
                raise WeightSyncStateError(
                    "release_weight_staging: an update is in progress and stages into these buffers; "
                    "finish_weight_update() or abort_weight_update() it first."
                )
            for plan in (self._sync_plans or {}).values():
                plan.release_staging()

    def _abort_weight_update_for_close(self) -> None:
        """Called by `close()` under `_lock`: abort an update in flight (its later calls raise), drop staging."""
        with self._lock:
            if self._weight_update is not None:
                self._end(self._weight_update, "aborted by close()")
            for plan in (self._sync_plans or {}).values():
                plan.release_staging()

    # -------------------------------------------------------------------------------------- internals
    def _plan(self, params: dict[str, torch.nn.Parameter], names: list[str]) -> _Plan:
        """The cached plan of this expected set, rebuilt when a parameter was replaced or changed dtype/shape/device."""
        if self._sync_plans is None:
            self._sync_plans = {}
        key = tuple(names)
        plan = self._sync_plans.get(key)
        if plan is None or not plan.valid_for(params):
            if len(self._sync_plans) >= 8:
                self._sync_plans.clear()
            plan = self._sync_plans[key] = _Plan(params, names)
        return plan

    def _require(self, where: str) -> _Transaction:
        txn = self._weight_update
        if txn is not None:
            return txn
        if getattr(self, "_closed", False):
            raise WeightSyncStateError(f"{where}: the policy is closed; no weight update can run.")
        last = f" (the last one {self._last_update_end})" if self._last_update_end else ""
        raise WeightSyncStateError(f"{where}: no weight update in progress{last}; call begin_weight_update() first.")

    def _end(self, txn: _Transaction, reason: str) -> None:
        if self._weight_update is txn:
            self._weight_update = None
            self._last_update_end = reason if len(reason) < 300 else reason[:297] + "..."
        txn.slots, txn.arenas, txn.prepared = {}, {}, None  # the plan keeps the staging buffers for the next update

    def _check_entry(
        self, txn: _Transaction, name: str, shape: Sequence[int], dtype: torch.dtype, where: str
    ) -> str | None:
        """Our name for a source entry, None for a dead key; raises WeightSyncError for anything invalid."""
        ours = txn.ours(name)
        if ours is None:
            return None
        param = txn.params.get(ours)
        if param is None:
            sample = next(iter(txn.expected))
            raise WeightSyncError(
                f"{where}: {name!r} names no parameter of this model (mapped to {ours!r}); expected our names "
                f"(e.g. {sample!r}) or LeRobot / openpi names. Remove peft/LoRA or wrapper prefixes on the sender."
            )
        if ours not in txn.expected_set:
            raise WeightSyncError(
                f"{where}: {name!r} is a parameter but not part of this update (expected={txn.mode!r}); "
                "begin_weight_update(expected='all') or a list that includes it, or do not send it."
            )
        if ours in txn.received:
            raise WeightSyncError(
                f"{where}: {ours!r} was already sent in this update (as {txn.received[ours][0]!r}, now as "
                f"{name!r}); send every parameter once per update."
            )
        if tuple(shape) != tuple(param.shape):
            raise WeightSyncError(
                f"{where}: {name!r}: expected shape {list(param.shape)}, received {list(shape)}; the sender's "
                "model geometry differs from this policy's config."
            )
        if param.is_floating_point() and not dtype.is_floating_point:
            raise WeightSyncError(
                f"{where}: {name!r}: expected a floating-point tensor (cast to {param.dtype}), received {dtype}."
            )
        return ours

    def _stage(self, txn: _Transaction, group: list[tuple[str, str | None, torch.Tensor, int]]) -> int:
        """Validate a group under the lock, then queue its copies into the staging buffers."""
        if not group:
            return 0
        with self._lock:
            if self._weight_update is not txn:
                raise WeightSyncStateError(
                    f"update_weights: the update ended while this call was staging ({self._last_update_end}); "
                    "begin a new update."
                )
            dsts, srcs = [], []
            received, slots = txn.received, txn.slots
            expected_set, shapes, floating = txn.expected_set, txn.plan.shapes, txn.plan.floating
            for name, ours, tensor, nbytes in group:
                # the common case as plain compares; anything else goes through the full check (which raises)
                if not (
                    ours in expected_set
                    and ours not in received
                    and tensor.shape == shapes[ours]
                    and (tensor.dtype.is_floating_point or not floating[ours])
                ):
                    ours = self._check_entry(txn, name, tensor.shape, tensor.dtype, "update_weights")
                    if ours is None:
                        txn.skipped.append(name)
                        continue
                received[ours] = (name, nbytes)
                dsts.append(slots[ours])
                srcs.append(tensor)
            cuda_bases: dict[int, torch.Tensor] = {}  # CUDA sources by storage owner (views of one flat: one)
            if txn.stream is not None:
                for src in srcs:
                    if src.is_cuda:
                        base = src if src._base is None else src._base
                        cuda_bases[id(base)] = base
                # sources produced on their devices' current streams come first
                for dev in {b.device for b in cuda_bases.values()}:
                    txn.stream.wait_stream(torch.cuda.current_stream(dev))
            with txn.on_stream(), torch.no_grad():
                _copy_all(dsts, srcs, non_blocking=txn.stream is not None)
            if txn.stream is not None:
                # the caller may drop them; keep their memory until the staging copies ran (record_stream marks
                # the whole allocation, so once per storage owner covers every view of it)
                for base in cuda_bases.values():
                    base.record_stream(txn.stream)
            return len(dsts)

    def _validate(self, txn: _Transaction, where: str) -> None:
        if txn.validated:
            return
        _raise_missing(txn, [n for n in txn.expected if n not in txn.received], where)
        bad = _nonfinite(txn)
        if bad:
            raise WeightSyncError(
                f"{where}: non-finite values (NaN/Inf, after casting to the parameter dtype) in {bad[:10]}; "
                "expected finite weights. The trainer diverged or a cast overflowed; the weights are unchanged."
            )
        txn.validated = True

    def _commit(self, txn: _Transaction) -> None:
        """Queue the in-place copies and the table refresh on the compute stream; poison on a failure midway."""
        names = list(txn.received)
        compute = torch.cuda.current_stream(self.device) if txn.stream is not None else None
        try:
            whole = len(names) == len(txn.plan.expected)
            if compute is not None and txn.stream is not None:
                # the weight copies need the staged values only; the tables prepared from them may still be computing
                if whole and txn.prepared is not None and txn.staged_event is not None:
                    compute.wait_event(txn.staged_event)
                else:
                    compute.wait_stream(txn.stream)
                for event in (self._reader_events or {}).values():
                    compute.wait_event(event)  # readers on other streams finish with the old weights first
            with torch.no_grad():  # no_grad: parameters are written in place without detach
                if whole:  # the whole set: the plan's copy lists, fused rows too
                    _copy_groups(txn.plan.commit_groups(self.model.fused_rows()), non_blocking=False)
                    if compute is not None and txn.stream is not None:
                        compute.wait_stream(txn.stream)  # the prepared tables
                    self.scheduler.refresh_tables(fused=False, prepared=txn.prepared)
                else:
                    params, slots = txn.params, txn.slots
                    _copy_all([params[n] for n in names], [slots[n] for n in names], non_blocking=False)
                    self.scheduler.refresh_tables()
            if compute is not None:
                event = torch.cuda.Event()
                event.record(compute)
                self._commit_event = event
                for arena in (*txn.arenas.values(), *(txn.prepared or {}).values()):
                    arena.record_stream(compute)  # freed only after the commit copies ran
        except BaseException as err:
            self._weights_poisoned = f"a commit failed after writing began ({type(err).__name__}: {err})"
            self._end(txn, "commit failed")
            raise WeightSyncError(
                f"finish_weight_update: the commit failed midway ({type(err).__name__}: {err}); the weights are "
                "inconsistent and the policy refuses to serve until a complete update commits."
            ) from err
        if self._weights_poisoned is not None and set(names) == set(txn.params):
            self._weights_poisoned = None


def _resolve_expected(expected: str | Sequence[str], params: dict[str, torch.nn.Parameter]) -> tuple[list[str], str]:
    """Our names of the expected set, in model order, and the mode label."""
    if isinstance(expected, str):
        if expected == "all":
            return list(params), "all"
        if expected == "trainable":
            names = [n for n, p in params.items() if p.requires_grad]
            if not names:
                raise WeightSyncError(
                    "begin_weight_update: expected='trainable' but no parameter requires grad; call "
                    "policy.set_trainable('expert' or 'all') or pass expected='all'."
                )
            return names, "trainable"
        raise WeightSyncError(
            f"begin_weight_update: expected must be 'all', 'trainable' or a list of names, got {expected!r}."
        )
    chosen: dict[str, str] = {}
    for name in expected:
        ours = to_internal_name(name) if isinstance(name, str) else None
        if ours is None or ours not in params:
            raise WeightSyncError(
                f"begin_weight_update: expected names a non-parameter {name!r}; list parameter names "
                "(ours or LeRobot / openpi)."
            )
        if ours in chosen:
            raise WeightSyncError(
                f"begin_weight_update: expected lists {ours!r} twice (as {chosen[ours]!r} and {name!r}); list it once."
            )
        chosen[ours] = name
    if not chosen:
        raise WeightSyncError("begin_weight_update: expected is an empty list; name at least one parameter.")
    return [n for n in params if n in chosen], "list"


def _raise_missing(txn: _Transaction, missing: list[str], where: str) -> None:
    if missing:
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise WeightSyncError(
            f"{where}: {len(missing)} of the {len(txn.expected)} expected parameters (expected={txn.mode!r}) were "
            f"not sent: {missing[:10]}{more}. Send them, or begin with expected=[...] listing what you send."
        )


def _finite_flag(txn: _Transaction, skip: frozenset[torch.dtype] = frozenset()) -> torch.Tensor:
    """0-d bool tensor: every value in the floating-point staging buffers is finite.

    Buffers of the dtypes in `skip` are left out; one min/max reduction per buffer, queued on the staging stream.
    """
    flags = []
    with txn.on_stream(), torch.no_grad():
        for dt, arena in txn.arenas.items():
            if dt not in skip and arena.numel() and arena.is_floating_point():
                lo, hi = torch.aminmax(arena)
                flags.append(torch.isfinite(lo) & torch.isfinite(hi))
        if not flags:
            return torch.ones((), dtype=torch.bool, device=txn.plan.device)
        return flags[0] if len(flags) == 1 else torch.stack(flags).all()


def _nonfinite(txn: _Transaction) -> list[str]:
    """Names whose staged values are not all finite.

    One min/max reduction per dtype buffer on the staging stream and one wait for that stream; the per-tensor
    scan runs only when something is wrong.
    """
    with txn.on_stream(), torch.no_grad():  # the flag is read on the stream that computed it
        if bool(_finite_flag(txn)):
            return []
        slots = txn.slots
        return [n for n in txn.received if slots[n].is_floating_point() and not bool(torch.isfinite(slots[n]).all())]
