r"""Prompt formats, state discretisation and on-device prompt token assembly.

Formats (DESIGN C7, reference/pi05_model.md sections 3.1 and 3.3); ids are BOS + encode(text), no EOS:

- ``"state"``: ``"Task: {task}, State: {b_1} ... {b_S};\nAction: "`` (openpi pi05 / LeRobot / phyai);
- ``"lerobot_no_state"``: ``"Task: {task};\nAction: "``;
- ``"text"``: BOS + encode(task) + encode("\n") (openpi pi0-style, used by openpi's ``pi05_libero``).

The task is cleaned (strip, ``_`` and newlines to spaces). State bins are ``digitize(s, linspace(-1, 1, 257)
[:-1]) - 1`` of the normalised state: ``floor((s + 1) * 128)`` on [-1, 1), -1 below -1, 255 from 0.9921875.

`PromptBuilder` builds the token ids on the policy's device: each distinct task is tokenised once and kept
in a device table (at most `max_cached_tasks` tasks: when a new task would exceed it, the table starts over
with the call's tasks); the tokens of every bin string (" -1" .. " 255") are tokenised once at setup, and a call
only gathers and scatters them. Setup checks that the concatenation reproduces host tokenisation of whole
prompts; if it does not (a tokenizer that merges across the bins), it falls back to host tokenisation with a
warning. The prompt bucket is chosen on the host from an upper bound, so a call never copies device data
to the host (except to check truncation when even the upper bound exceeds ``max_token_len``).

Example:
    >>> import tempfile, torch
    >>> from policies.pi05.tokenizer import build_standin_tokenizer, load_tokenizer
    >>> tok = load_tokenizer(build_standin_tokenizer(tempfile.mkdtemp()))
    >>> builder = PromptBuilder(tok, "state", max_token_len=48)
    >>> tokens, lengths = builder(["pick up the bowl"], torch.tensor([[0.0, -1.0]]))
    >>> tokens.shape[1] in builder.buckets, tokens[0, 0].item() == tok.bos_id
    (True, True)
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from policies.checks import check_int
from policies.pi05.tokenizer import PromptTokenizer

PROMPT_FORMATS: tuple[str, ...] = ("state", "lerobot_no_state", "text")
"""Supported prompt formats."""
DEFAULT_BUCKETS: tuple[int, ...] = (16, 32, 48, 64, 80, 96, 112, 144, 200)
"""Default prompt-length buckets (capped at ``max_token_len``): steps of 16 up to 112 tokens, so a prompt pads at most
15 tokens there (under 3 % of a 2-camera prefix of 512 image tokens). A LIBERO task with the state in the prompt
(53-62 tokens with the stand-in tokenizer) lands in 64, not 112 (50 of its 624 prefix tokens were padding)."""
NUM_BINS = 256
"""State bins 0..255 (plus -1 below the range)."""
MAX_CACHED_TASKS = 1024
"""Default bound on the distinct tasks a `PromptBuilder` keeps tokenised."""

_STATE_HEAD = ", State:"
_STATE_TAIL = ";\nAction: "


def clean_task(task: str) -> str:
    """Clean a task like openpi: strip, ``_`` -> space, newline -> space (no lowercasing)."""
    return task.strip().replace("_", " ").replace("\n", " ")


def state_bin_edges(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 256 left bin edges ``linspace(-1, 1, 257)[:-1]`` (exact in float32: multiples of 1/128).

    Computed on `device` itself (no host-to-device copy on the step path).
    """
    return torch.linspace(-1.0, 1.0, NUM_BINS + 1, dtype=torch.float64, device=device)[:-1].to(dtype)


def discretize_state(state: torch.Tensor) -> torch.Tensor:
    """(N, S) normalised state -> (N, S) int64 bins in [-1, 255], on the state's device (np.digitize - 1)."""
    dtype = state.dtype if state.dtype in (torch.float32, torch.float64) else torch.float32
    edges = state_bin_edges(state.device, dtype)
    return torch.bucketize(state.to(dtype), edges, right=True) - 1


def discretize_state_np(state: np.ndarray) -> np.ndarray:
    """Host reference of `discretize_state` with numpy's digitize (openpi's formula)."""
    edges = np.linspace(-1, 1, NUM_BINS + 1)[:-1]
    return np.digitize(np.asarray(state), bins=edges) - 1


def prompt_text(task: str, fmt: str, bins: Sequence[int] | None = None) -> str:
    """The prompt string (without BOS) of `fmt` for a raw task and, for ``"state"``, its bins."""
    clean = clean_task(task)
    if fmt == "state":
        if bins is None:
            raise ValueError("prompt_text: the 'state' format needs the state bins.")
        return f"Task: {clean}, State: {' '.join(str(int(b)) for b in bins)};\nAction: "
    if fmt == "lerobot_no_state":
        return f"Task: {clean};\nAction: "
    if fmt == "text":
        return f"{clean}\n"
    raise ValueError(f"prompt format must be one of {PROMPT_FORMATS}, got {fmt!r}.")


def host_tokenize(tokenizer: PromptTokenizer, task: str, fmt: str, bins: Sequence[int] | None = None) -> list[int]:
    """Reference tokenisation of one prompt on the host: BOS + ids (openpi's ``"text"`` encodes the newline apart)."""
    if fmt == "text":
        return [tokenizer.bos_id, *tokenizer.encode(clean_task(task)), *tokenizer.encode("\n")]
    return [tokenizer.bos_id, *tokenizer.encode(prompt_text(task, fmt, bins))]


def capped_buckets(buckets: Sequence[int], max_token_len: int) -> tuple[int, ...]:
    """Sorted buckets below `max_token_len`, plus `max_token_len` itself."""
    if max_token_len < 2:
        raise ValueError(f"max_token_len must be >= 2 (BOS and one token), got {max_token_len}.")
    return tuple(sorted({b for b in buckets if 0 < b < max_token_len} | {max_token_len}))


class PromptBuilder:
    """Builds (N, L) int32 prompt ids and (N,) int32 lengths for a batch of tasks (and states) on a device.

    Attributes:
        buckets: prompt lengths L a call can return.
        device_state_tokens: True when state tokens are assembled on the device (verified at setup).

    Example:
        >>> import tempfile
        >>> from policies.pi05.tokenizer import build_standin_tokenizer, load_tokenizer
        >>> tok = load_tokenizer(build_standin_tokenizer(tempfile.mkdtemp()))
        >>> tokens, lengths = PromptBuilder(tok, "text", max_token_len=48)(["open the drawer"], None)
        >>> tokens[0, : lengths[0]].tolist() == host_tokenize(tok, "open the drawer", "text")
        True
    """

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        fmt: str,
        max_token_len: int = 200,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        device: torch.device | str = "cpu",
        max_cached_tasks: int = MAX_CACHED_TASKS,
    ) -> None:
        if fmt not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {fmt!r}.")
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.max_token_len = int(max_token_len)
        self.buckets = capped_buckets(buckets, self.max_token_len)
        self.device = torch.device(device)
        self.truncation_warned = False
        fix = "how many distinct task strings to keep tokenised, e.g. 1024"
        self.max_cached_tasks = check_int("max_cached_tasks", max_cached_tasks, 1, fix=fix)
        # Per-task table (device) and its host mirror; replaced as a whole when tasks are added.
        self._task_index: dict[str, int] = {}
        self._task_len: list[int] = []
        self._task_ids = torch.zeros(0, 1, dtype=torch.int32, device=self.device)
        self._task_len_dev = torch.zeros(0, dtype=torch.int32, device=self.device)
        self.device_state_tokens = False
        if self.uses_state:
            self._setup_state_tokens()

    @property
    def uses_state(self) -> bool:
        """Whether the format puts the discretised state into the prompt."""
        return self.fmt == "state"

    @property
    def num_cached_tasks(self) -> int:
        """Distinct tasks tokenised so far."""
        return len(self._task_index)

    # ------------------------------------------------------------------------------------------ setup
    def _setup_state_tokens(self) -> None:
        """Tokenise every bin string once; verify that concatenation equals host tokenisation."""
        pieces = [self.tokenizer.encode(f" {b}") for b in range(-1, NUM_BINS)]
        self.max_bin_len = max(len(p) for p in pieces)
        table = np.zeros((len(pieces), self.max_bin_len), dtype=np.int32)
        for i, p in enumerate(pieces):
            table[i, : len(p)] = p
        self._bin_ids = torch.from_numpy(table).to(self.device)  # (257, Tb); row b+1 holds bin b
        self._bin_len = torch.tensor([len(p) for p in pieces], dtype=torch.int64, device=self.device)
        self._edges = {dt: state_bin_edges(self.device, dt) for dt in (torch.float32, torch.float64)}
        self._bin_offsets = torch.arange(self.max_bin_len, device=self.device)
        self._bin_len_host = [len(p) for p in pieces]
        self._bin_pieces = pieces
        self._tail = self.tokenizer.encode(_STATE_TAIL)
        self._tail_offsets = torch.arange(len(self._tail), device=self.device)
        rng = np.random.default_rng(0)
        probes = [list(range(-1, NUM_BINS)), [0], [255, -1]] + [
            list(rng.integers(-1, NUM_BINS, size=int(rng.integers(1, 33)))) for _ in range(16)
        ]
        self.device_state_tokens = all(self._verify_task("pick up the black bowl", p) for p in probes)
        if not self.device_state_tokens:
            warnings.warn(
                f"PromptBuilder: tokenizer {self.tokenizer.name!r} does not tokenise state bins independently "
                "of their neighbours; building 'state' prompts on the host (one device-to-host copy in each call).",
                stacklevel=2,
            )

    def _task_head(self, task: str) -> list[int]:
        """Ids of everything before the bins: BOS + encode("Task: {clean}, State:")."""
        return [self.tokenizer.bos_id, *self.tokenizer.encode(f"Task: {clean_task(task)}{_STATE_HEAD}")]

    def _verify_task(self, task: str, bins: Sequence[int]) -> bool:
        """True when head + bin pieces + tail equals host tokenisation of the whole prompt."""
        joined = self._task_head(task) + [i for b in bins for i in self._bin_pieces[int(b) + 1]] + self._tail
        return joined == host_tokenize(self.tokenizer, task, self.fmt, bins)

    def _add_tasks(self, tasks: Sequence[str]) -> None:
        """Tokenise unseen tasks and publish a new task table (all or nothing; bounded by `max_cached_tasks`)."""
        new = [t for t in dict.fromkeys(tasks) if t not in self._task_index]
        if not new:
            return
        kept_index, kept_len, old = self._task_index, self._task_len, self._task_ids
        restart = len(kept_index) + len(new) > self.max_cached_tasks
        if restart:  # start over with this call's tasks
            kept_index, kept_len, old = {}, [], old[:0, :1]
            new = list(dict.fromkeys(tasks))
        if self.uses_state:
            rows = [self._task_head(t) for t in new]
            if self.device_state_tokens and not all(self._verify_task(t, [-1, 0, 128, 255]) for t in new):
                warnings.warn(
                    "PromptBuilder: a task's prompt tokenises differently when split at the state; building "
                    "'state' prompts on the host from now on.",
                    stacklevel=3,
                )
                fallback = True
            else:
                fallback = False
        else:
            rows = [host_tokenize(self.tokenizer, t, self.fmt) for t in new]
            fallback = False
        lengths = kept_len + [len(r) for r in rows]
        width = max(lengths)
        table = torch.zeros(len(lengths), width, dtype=torch.int32, device=self.device)
        table[: old.shape[0], : old.shape[1]] = old
        new_rows = np.zeros((len(rows), width), dtype=np.int32)
        for i, r in enumerate(rows):
            new_rows[i, : len(r)] = r
        table[old.shape[0] :] = torch.from_numpy(new_rows).to(self.device)
        len_dev = torch.tensor(lengths, dtype=torch.int32, device=self.device)
        # Commit: nothing above mutated the builder.
        index = dict(kept_index)
        for t in new:
            index[t] = len(index)
        self._task_ids, self._task_len_dev, self._task_len, self._task_index = table, len_dev, lengths, index
        if restart:
            self.__dict__.pop("_row_index_cache", None)  # it indexes rows of the dropped table
        if fallback:
            self.device_state_tokens = False

    # ------------------------------------------------------------------------------------------- call
    def bucket_for(self, length: int) -> int:
        """Smallest bucket >= `length` (the largest bucket when none is)."""
        i = bisect.bisect_left(self.buckets, length)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def __call__(self, tasks: Sequence[str], state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (N, L) int32 and lengths (N,) int32 on the builder's device.

        Args:
            tasks: N raw task strings.
            state: (N, S) normalised state on the builder's device (required by the ``"state"`` format).
        """
        if self.uses_state and (state is None or state.ndim != 2 or state.shape[1] < 1):
            got = None if state is None else tuple(state.shape)
            raise ValueError(
                f"prompt format 'state' needs a (N, S>=1) state; got {got}. Pass obs['state'] or use "
                "prompt_format='text' / 'lerobot_no_state'."
            )
        self._add_tasks(tasks)
        rows = [self._task_index[t] for t in tasks]
        if not self.uses_state:
            return self._task_only(rows)
        if not self.device_state_tokens:
            return self._host_state_prompts(tasks, state)
        return self._device_state_prompts(rows, state)

    def _warn_truncated(self, longest: int) -> None:
        if not self.truncation_warned:
            self.truncation_warned = True
            warnings.warn(
                f"PromptBuilder: a prompt of {longest} tokens was truncated to max_token_len="
                f"{self.max_token_len} (warned once); raise max_token_len or shorten the task.",
                stacklevel=3,
            )

    def _row_index(self, rows: list[int]) -> torch.Tensor:
        """Device index of task-table rows, cached per row tuple.

        A repeated batch of tasks (the usual case in a rollout) then costs no host-to-device copy.
        """
        cache = self.__dict__.setdefault("_row_index_cache", {})
        key = tuple(rows)
        index = cache.get(key)
        if index is None:
            if len(cache) >= 256:
                cache.clear()
            index = cache[key] = torch.tensor(rows, dtype=torch.int64).to(self.device)
        return index

    def _tail_ids(self) -> torch.Tensor:
        """The state prompt's tail token ids on the device (built once)."""
        tail = self.__dict__.get("_tail_dev")
        if tail is None:
            tail = self.__dict__["_tail_dev"] = torch.tensor(self._tail, dtype=torch.int32, device=self.device)
        return tail

    def _head_offsets(self, width: int) -> torch.Tensor:
        """``arange(width)`` on the device, kept for the task table's current width."""
        offsets = self.__dict__.get("_head_offsets_dev")
        if offsets is None or offsets.shape[0] != width:
            offsets = self.__dict__["_head_offsets_dev"] = torch.arange(width, device=self.device)
        return offsets

    def _task_only(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(self._task_len[r] for r in rows)
        length = self.bucket_for(longest)
        if longest > length:
            self._warn_truncated(longest)
        index = self._row_index(rows)
        ids = self._task_ids.index_select(0, index)
        width = ids.shape[1]
        tokens = ids[:, :length] if width >= length else torch.nn.functional.pad(ids, (0, length - width))
        lengths = torch.clamp(self._task_len_dev.index_select(0, index), max=length)
        return tokens.contiguous(), lengths

    def _device_state_prompts(self, rows: list[int], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Shapes: N rows, S state dims, Tb tokens per bin at most, P task-table width, L bucket.
        n, s = state.shape
        upper = max(self._task_len[r] for r in rows) + s * self.max_bin_len + len(self._tail)
        length = self.bucket_for(upper)
        dev = self.device
        index = self._row_index(rows)
        head_ids = self._task_ids.index_select(0, index)  # (N, P)
        head_len = self._task_len_dev.index_select(0, index).to(torch.int64)  # (N,)
        edges = self._edges.get(state.dtype, self._edges[torch.float32])
        bins = torch.bucketize(state.to(edges.dtype), edges, right=True)  # (N, S): discretize_state + 1, in [0, 256]
        bin_ids = self._bin_ids[bins]  # (N, S, Tb)
        bin_len = self._bin_len[bins]  # (N, S)
        ends = head_len[:, None] + torch.cumsum(bin_len, dim=1)  # (N, S)
        tail_start = ends[:, -1]  # (N,)
        total = tail_start + len(self._tail)  # (N,)
        trash = length  # scatter target of every invalid / truncated piece
        p = self._head_offsets(head_ids.shape[1])
        head_pos = torch.where(p < head_len[:, None], p, trash)
        k = self._bin_offsets
        bin_pos = (ends - bin_len)[..., None] + k  # (N, S, Tb)
        bin_pos = torch.where(k < bin_len[..., None], bin_pos, trash).reshape(n, -1)
        tail_ids = self._tail_ids().expand(n, -1)
        tail_pos = tail_start[:, None] + self._tail_offsets
        pos = torch.cat([head_pos, bin_pos, tail_pos], dim=1).clamp_(max=trash)
        ids = torch.cat([head_ids, bin_ids.reshape(n, -1), tail_ids], dim=1)
        tokens = torch.zeros(n, length + 1, dtype=torch.int32, device=dev)
        tokens.scatter_(1, pos, ids)
        if upper > length:  # only possible at the largest bucket: check (one sync) and warn once
            longest = int(total.max())
            if longest > length:
                self._warn_truncated(longest)
        lengths = torch.clamp(total, max=length).to(torch.int32)
        return tokens[:, :length].contiguous(), lengths

    def _host_state_prompts(self, tasks: Sequence[str], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bins = discretize_state(state).cpu().tolist()  # fallback path: one device-to-host copy
        seqs = [host_tokenize(self.tokenizer, t, "state", b) for t, b in zip(tasks, bins)]
        longest = max(len(q) for q in seqs)
        length = self.bucket_for(longest)
        if longest > length:
            self._warn_truncated(longest)
        out = np.zeros((len(seqs), length), dtype=np.int32)
        for i, q in enumerate(seqs):
            q = q[:length]
            out[i, : len(q)] = q
        lengths = torch.tensor([min(len(q), length) for q in seqs], dtype=torch.int32)
        return torch.from_numpy(out).to(self.device), lengths.to(self.device)
