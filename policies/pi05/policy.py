"""`Pi05Policy`: processor -> scheduler (graphs on CUDA, eager on CPU) -> env-space action chunks.

The policy owns per-env random streams (DESIGN C3), the rollout settings, and a `WeightSync` (C6,
`weight_sync.py`, `broadcast.py`) that holds the weight version and the update transaction. `act()` is
serialised by a lock; on CUDA it returns once the replays are queued, and a weight commit is ordered after
them on the compute stream (C6).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from ..base import PolicyOutput, RolloutConfig
from ..checks import bad_input, check_bool, check_device, check_int, integer_tensor, seed_tensor
from ..rng import StreamTable, explicit_counters
from .attention import AttentionConfig
from .batch import RolloutBatch, StoredPrefix
from .broadcast import broadcast_weights
from .checkpoint import LoadReport, checkpoint_folder, load_config, load_weights, save_weights
from .config import Pi05Config
from .evaluate import EvalOutput, GraphedEvaluate, evaluate_rollout
from .inputs import ModelInputs
from .model import Pi05Model, randomize_parameters_, torch_dtype
from .prompt import DEFAULT_BUCKETS
from .rollout import run_prefix_stage
from .scheduler import Pi05Scheduler, SchedulerConfig
from .weight_sync import WeightSource, WeightSync, WeightUpdateReport


class Pi05Policy:
    """PI0.5 policy over canonical observations (DESIGN C1), usable without Gymnasium.

    Example:
        >>> import numpy as np
        >>> from policies.pi05 import Pi05Config, Pi05Policy
        >>> policy = Pi05Policy.from_config(Pi05Config.tiny(), action_dim=7, seed=0)  # doctest: +SKIP
        >>> obs = {"images": {"image": np.zeros((2, 64, 64, 3), np.uint8)},
        ...        "state": np.zeros((2, 8), np.float32), "task": ["push", "push"]}  # doctest: +SKIP
        >>> policy.act(obs).actions.shape  # doctest: +SKIP
        torch.Size([2, 5, 7])
    """

    def __init__(
        self,
        model: Pi05Model,
        processor: Any,
        rollout: RolloutConfig | None = None,
        scheduler: SchedulerConfig | None = None,
    ) -> None:
        self.model = model
        self.processor = processor
        self.device = next(model.parameters()).device
        self.rollout = rollout or RolloutConfig(num_steps=model.config.num_steps)
        if self.rollout.action_chunk > model.config.action_horizon:
            raise ValueError(
                f"rollout.action_chunk: expected <= action_horizon ({model.config.action_horizon}), "
                f"got {self.rollout.action_chunk}. Fix: RolloutConfig(action_chunk=C) with C <= "
                f"{model.config.action_horizon}."
            )
        if scheduler is None:
            scheduler = SchedulerConfig(
                max_batch_size=64,
                num_steps=(self.rollout.num_steps,),
                camera_sets=(tuple(processor.slots),),
                prompt_buckets=tuple(getattr(processor, "prompt_buckets", DEFAULT_BUCKETS)),
            )
        if self.rollout.num_steps not in scheduler.num_steps:
            raise ValueError(
                f"rollout.num_steps: expected one of the scheduler's declared num_steps {tuple(scheduler.num_steps)}, "
                f"got {self.rollout.num_steps}; declare it in SchedulerConfig.num_steps."
            )
        if self.rollout.method == "noise" and not scheduler.learned_noise:
            scheduler = replace(scheduler, learned_noise=True)  # its graphs run the noise head
        self.scheduler = Pi05Scheduler(model, scheduler)
        self.streams = StreamTable(self.device)
        self._lock = threading.RLock()
        self._closed = False
        self._graphed_evaluate: GraphedEvaluate | None = None  # the trainer's captured update graphs (evaluate)
        self.weight_sync = WeightSync(model, lambda names: self.scheduler.refresh_tables(names), self._lock)
        self.model.eval()
        self.set_trainable(self.rollout.trainable)
        self.scheduler.setup()

    # ------------------------------------------------------------------------------------ properties
    @property
    def config(self) -> Pi05Config:
        """The model geometry."""
        return self.model.config

    @property
    def action_horizon(self) -> int:
        """H: the largest action chunk C a call can return."""
        return self.model.config.action_horizon

    @property
    def action_dim(self) -> int:
        """A: env action dims."""
        return int(self.processor.action_dim)

    # ---------------------------------------------------------------------------------- construction
    @classmethod
    def from_config(
        cls,
        config: Pi05Config,
        processor: Any = None,
        *,
        action_dim: int = 7,
        device: str | torch.device = "cpu",
        dtype: str | None = None,
        seed: int | None = 0,
        rollout: RolloutConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        attention: AttentionConfig | None = None,
        **processor_kwargs: Any,
    ) -> Pi05Policy:
        """A policy with fresh weights (all randomised with `seed` unless seed is None)."""
        from .processor import Pi05Processor

        check_device(device)
        if seed is not None:
            check_int("seed", seed, fix="an integer weight seed, or None to keep the initialisation")
        for name, value, kind in (("config", config, Pi05Config), ("rollout", rollout, RolloutConfig),
                                  ("scheduler", scheduler, SchedulerConfig)):  # fmt: skip
            if value is not None and not isinstance(value, kind):
                raise TypeError(bad_input(name, f"a {kind.__name__}", value))
        with torch.device(device):
            model = Pi05Model(config, attention)
        if seed is not None:
            randomize_parameters_(model, seed)
        model.set_precision(torch_dtype(dtype or config.dtype))
        if processor is None:
            processor = Pi05Processor.for_config(config, action_dim=action_dim, device=device, **processor_kwargs)
        return cls(model, processor, rollout, scheduler)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        preset: str | None = None,
        device: str | torch.device = "cpu",
        dtype: str | None = None,
        max_batch_size: int = 64,
        warmup: tuple[tuple[int, int], ...] | str = (),
        strict: bool = True,
        rollout: RolloutConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        attention: AttentionConfig | None = None,
    ) -> Pi05Policy:
        """Load a safetensors checkpoint folder (ours, LeRobot or openpi-PyTorch layout) plus its processor.

        `max_batch_size` and `warmup` build the default `SchedulerConfig` (ignored when `scheduler` is given).
        """
        from .processor import Pi05Processor

        check_device(device)
        for name, value, kind in (("rollout", rollout, RolloutConfig), ("scheduler", scheduler, SchedulerConfig)):
            if value is not None and not isinstance(value, kind):
                raise TypeError(bad_input(name, f"a {kind.__name__} or None", value))
        path = checkpoint_folder(path, "path")
        config = load_config(path)
        processor = Pi05Processor.from_pretrained(path, preset=preset, device=device)
        preset_h = getattr(processor, "action_horizon", None)
        if preset_h and preset_h != config.action_horizon:
            config = replace(config, action_horizon=int(preset_h))
        with torch.device(device):
            model = Pi05Model(config, attention)
        model.set_precision(torch_dtype(dtype or config.dtype))
        report = load_weights(model, path, strict=strict)
        policy_file = Path(path) / "policy_config.json"
        if rollout is None and policy_file.exists():
            rollout = RolloutConfig(**json.loads(policy_file.read_text())["rollout"])
        if rollout is None:
            chunk = int(getattr(processor, "action_chunk", None) or min(5, config.action_horizon))
            rollout = RolloutConfig(num_steps=config.num_steps, action_chunk=chunk)
        if scheduler is None:
            scheduler = SchedulerConfig(
                max_batch_size=max_batch_size,
                num_steps=(rollout.num_steps,),
                camera_sets=(tuple(processor.slots),),
                warmup=warmup,
            )
        policy = cls(model, processor, rollout, scheduler)
        policy.load_report = report
        return policy

    def save_pretrained(self, path: str | Path) -> Path:
        """Write config.json, model.safetensors, the processor files and the rollout settings."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        self.config.save(root / "config.json")
        save_weights(self.model, root)
        self.processor.save_pretrained(root)
        (root / "policy_config.json").write_text(json.dumps({"rollout": asdict(self.rollout)}, indent=2) + "\n")
        return root

    load_report: LoadReport | None = None

    # -------------------------------------------------------------------------------------- settings
    def set_trainable(self, which: str) -> None:
        """Mark the trainable subset: "expert" (expert, projections, time MLP, heads) or "all"."""
        self.rollout = replace(self.rollout, trainable=which)
        m = self.model
        expert_side = [m.expert, m.action_in_proj, m.action_out_proj, m.time_mlp_in, m.time_mlp_out]
        expert_side += [h for h in (m.value_head, m.noise_head) if h is not None]
        for p in m.parameters():
            p.requires_grad_(which == "all")
        for module in expert_side:
            for p in module.parameters():
                p.requires_grad_(True)

    def trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of the trainable subset."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def sampling_options(self, deterministic: bool = False, action_chunk: int | None = None) -> RolloutConfig:
        """The per-call options `act()` would use: the settings with the call's method, C and A."""
        r = self.rollout
        check_bool("deterministic", deterministic)  # "no" would silently mean True
        chunk = r.action_chunk if action_chunk is None else action_chunk
        chunk = check_int("action_chunk", chunk, 1, self.action_horizon,
                          fix=f"pass 1..{self.action_horizon} (the model horizon H) env steps a call")  # fmt: skip
        return replace(r, method="ode" if deterministic else r.method, action_chunk=chunk, action_dim=self.action_dim)

    @property
    def value_source(self) -> str:
        """Where the critic reads: the config's value source, or "none" without a value head."""
        return self.config.value_source if self.model.value_head is not None else "none"

    def header(self, opts: RolloutConfig) -> RolloutConfig:
        """The header a call with `opts` carries: the options, the weight version and the value source."""
        return replace(opts, weight_version=self.weight_version, value_source=self.value_source)

    # ------------------------------------------------------------------------------------------- act
    def _env_ids(self, n: int, env_ids: Sequence[int] | torch.Tensor | None) -> tuple[torch.Tensor, int]:
        if env_ids is None:
            return torch.arange(n, device=self.device), n
        ids = integer_tensor(env_ids, n, "env_ids", f"{n} ids (one per observation row)")
        upper = None
        if ids.device.type == "cpu":  # device ids are not checked: that would sync the host
            if int(ids.min()) < 0:
                raise ValueError(f"env_ids: expected ids >= 0 (stream table rows), got {ids.tolist()}.")
            upper = int(ids.max()) + 1
        return ids.to(self.device), upper or n

    def _streams(self, n: int, seeds, env_ids, counters=None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(seeds, counters) a call draws from, and a `commit()` that records the call in the table.

        Nothing in the table changes until `commit()` (after the call succeeded): a refused call leaves every
        stream as it was (C3). With explicit `counters` (`StreamPolicy`) the call draws from them and
        `commit()` changes nothing.
        """
        ids, upper = self._env_ids(n, env_ids)
        if counters is not None:
            explicit = explicit_counters("Pi05Policy.act", counters, n, self.device, seeds)
            return self.streams.take(ids, upper, advance=False)[0], explicit, lambda: None
        seed_t = None if seeds is None else seed_tensor(seeds, n).to(self.device)
        current, counters = self.streams.take(ids, upper, advance=False)
        if seed_t is not None:
            current, counters = seed_t, torch.zeros_like(counters)

        def commit() -> None:
            if seed_t is not None:
                self.streams.set_seeds(ids, seed_t, upper)
            self.streams.advance(ids, counters, upper)

        return current, counters, commit

    def stream_state(self, env_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the (seeds, counters) of `env_ids` (`StreamPolicy`); changes no stream."""
        with self._lock:
            seeds, counters, _ = self._streams(len(env_ids), None, env_ids)
            return seeds.clone(), counters.clone()

    def advance_streams(self, env_ids: Sequence[int] | torch.Tensor, counters: torch.Tensor) -> None:
        """Records a call made with explicit `counters`: theirs become ``counters + 1`` (`StreamPolicy`)."""
        with self._lock:
            ids, upper = self._env_ids(len(env_ids), env_ids)
            explicit = explicit_counters("Pi05Policy.advance_streams", counters, len(ids), self.device)
            self.streams.advance(ids, explicit, upper)

    def act_inputs(
        self,
        inputs: ModelInputs,
        *,
        deterministic: bool = False,
        seeds: Sequence[int] | torch.Tensor | None = None,
        env_ids: Sequence[int] | torch.Tensor | None = None,
        action_chunk: int | None = None,
        counters: torch.Tensor | None = None,
    ) -> PolicyOutput:
        """`act()` on already processed inputs."""
        self._check_open()
        opts = self.sampling_options(deterministic, action_chunk)
        with self._lock:
            seeds_t, counters, commit_streams = self._streams(inputs.batch_size, seeds, env_ids, counters)
            with self._weights_in_use():  # weight sync (C6): ordered after the last commit, before the next
                out, inds = self.scheduler.rollout(inputs, seeds_t, counters, opts, self.rollout.keep_prefix)
            commit_streams()
            model_actions = out.chain[:, -1]
            actions = self.processor.postprocess(model_actions, opts.action_chunk)
            elements = out.log_prob_elements[:, : opts.action_chunk, : opts.action_dim]
            return PolicyOutput(
                actions=actions,
                log_prob=elements.sum(dim=(1, 2)),
                log_prob_elements=elements,
                values=out.values,
                model_actions=model_actions,
                chains=out.chain,
                denoise_inds=inds,
                inputs=inputs,
                header=self.header(opts),
                prefix=out.prefix,
            )

    def act(
        self,
        obs: Mapping[str, Any],
        *,
        deterministic: bool = False,
        seeds: Sequence[int] | torch.Tensor | None = None,
        env_ids: Sequence[int] | torch.Tensor | None = None,
        action_chunk: int | None = None,
        counters: torch.Tensor | None = None,
    ) -> PolicyOutput:
        """Actions (N, C, A), log-probs, values and what `evaluate()` needs, for N canonical observations.

        With `counters` ((N,) ints) the call draws from them and changes no stream (`StreamPolicy`).
        """
        self._check_open()
        with self._lock:
            inputs = self.processor(obs)
            return self.act_inputs(
                inputs,
                deterministic=deterministic,
                seeds=seeds,
                env_ids=env_ids,
                action_chunk=action_chunk,
                counters=counters,
            )

    def value(
        self, obs: Mapping[str, Any], *, env_ids: Sequence[int] | torch.Tensor | None = None
    ) -> torch.Tensor:
        """(N,) critic values: prefix only for the prefix source, the ODE chain from the env's stream for suffix."""
        self._check_open()
        with self._lock:
            inputs = self.processor(obs)
            n = inputs.batch_size
            self._env_ids(n, env_ids)  # validated for every value source, used by the suffix source
            if self.model.value_head is None:
                return torch.zeros(n, device=self.device)
            if self.config.value_source == "prefix":
                with self._weights_in_use():  # weight sync (C6)
                    return self.scheduler.prefix_value(inputs)
            seeds_t, counters, _ = self._streams(n, None, env_ids)  # value() consumes no stream
            with self._weights_in_use():  # weight sync (C6)
                out, _ = self.scheduler.rollout(inputs, seeds_t, counters, self.sampling_options(deterministic=True))
            return out.values

    # -------------------------------------------------------------------------------------- evaluate
    def evaluate(self, batch: RolloutBatch | PolicyOutput, *, cuda_graphs: bool = False) -> EvalOutput:
        """Differentiable log-probs, values and entropy of a stored rollout batch (for the PPO ratio).

        `batch` is a `RolloutBatch` (e.g. ``RolloutBatch.cat(...)`` of a rollout's calls, then ``.select(mb)``)
        or one `act()` output. Its header must match this policy's settings (method, K, a, C, A, value source,
        joint); the weight version may differ (that is the point of the ratio). A batch that kept the prefix K/V
        is not recomputed there unless the prefix is trainable. `cuda_graphs` replays the forward and backward of
        kept-prefix batches as CUDA graphs on a GPU (`GraphedEvaluate`; captured once per batch shape), else eager.
        """
        if isinstance(batch, PolicyOutput):
            lacking = [name for name in ("chains", "denoise_inds", "inputs") if getattr(batch, name) is None]
            if lacking:
                raise ValueError(
                    f"evaluate(batch): expected a batch with chains, denoise_inds and inputs (what act() returns), "
                    f"got None for {lacking}; pass act() outputs."
                )
            batch = RolloutBatch.from_output(batch)
        if not isinstance(batch, RolloutBatch):
            raise TypeError(
                f"evaluate(batch): expected a RolloutBatch or a PolicyOutput from act(), got {type(batch).__name__}."
            )
        h = batch.header
        mine = self.sampling_options()
        expected = {
            "method": (mine.method, h.method),
            "num_steps": (mine.num_steps, h.num_steps),
            "noise_level": (mine.noise_level, h.noise_level),
            "value_source": (self.value_source, h.value_source),
            "action_dim": (self.action_dim, h.action_dim),
        }
        if h.method != "ode":
            expected["joint"] = (mine.is_joint, h.is_joint)
        for name, (want, got) in expected.items():
            if (abs(want - got) > 1e-12) if isinstance(want, float) else (want != got):
                raise ValueError(
                    f"evaluate(batch): header {name} is {got!r} but this policy uses {want!r}; evaluate with "
                    "the settings the rollout used (or re-collect the batch)."
                )
        if batch.prefix is not None and batch.prefix.kv.dtype != self.model.compute_dtype:
            raise ValueError(
                f"evaluate(batch): the batch's prefix K/V are {batch.prefix.kv.dtype} but this model computes in "
                f"{self.model.compute_dtype}; build the trainer in the rollout's dtype (the default) or drop the "
                "prefix (batch.prefix = None) to recompute it."
            )
        train_prefix = self.rollout.trainable == "all"
        graphs = cuda_graphs and self.device.type == "cuda" and batch.prefix is not None and not train_prefix
        with self._weights_in_use():  # weight sync (C6): no commit interleaves with this forward
            if graphs:
                if self._graphed_evaluate is None:
                    self._graphed_evaluate = GraphedEvaluate(self.model)
                return self._graphed_evaluate(batch, h)
            return evaluate_rollout(self.model, batch, h, train_prefix=train_prefix)

    @torch.no_grad()
    def encode_prefix(self, batch: RolloutBatch) -> RolloutBatch:
        """`batch` with the prefix K/V computed by this policy's model (no autograd), in max_batch_size chunks.

        For a trainer whose prefix is frozen and whose batches did not keep the rollout's K/V (e.g. they came from
        another process): encode once per rollout batch, then every epoch and minibatch reuses it.
        """
        parts = []
        step = self.scheduler.config.max_batch_size
        with self._weights_in_use():
            for start in range(0, batch.batch_size, step):
                x = batch.inputs.select(slice(start, start + step))
                cache = run_prefix_stage(self.model, x.images, x.image_mask, x.tokens, x.lengths)
                kv = torch.stack([t for kv in zip(cache.keys, cache.values) for t in kv], dim=1)
                kv = kv.view(kv.shape[0], len(cache.keys), 2, *kv.shape[2:])
                pooled = self.model.prefix_pooled(cache) if cache.output is not None else None
                parts.append(StoredPrefix(kv, cache.key_mask, pooled))
        return replace(batch, prefix=StoredPrefix.cat(parts))

    def declare_batch_sizes(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """Give each batch size a call will use its own bucket; returns those added (graphs: on first use).

        `PolicyVectorEnv` declares N (or each env group's size), so a deployment never pays for a larger bucket
        than its own batch. With the default buckets (every size up to max_batch_size) only the remainder of a
        size above max_batch_size, which is split, can be new.
        """
        self._check_open()
        with self._lock:
            return self.scheduler.add_batch_buckets(list(sizes))

    # ------------------------------------------------------------------------------- weight sync (C6)
    @property
    def weight_version(self) -> int:
        """Version of the served weights: 0 at construction, then what the last committed update set."""
        return self.weight_sync.version

    def begin_weight_update(self, expected: str | Sequence[str] = "trainable") -> None:
        """Open an update that must deliver `expected`: "trainable", "all" or a list of names (`WeightSync`)."""
        self.weight_sync.begin(expected)

    def update_weights(self, named_tensors: WeightSource) -> int:
        """Validate and stage (name, tensor) pairs or a mapping; returns how many; `act()` keeps serving."""
        return self.weight_sync.stage(named_tensors)

    def finish_weight_update(self, *, version: int | None = None) -> WeightUpdateReport:
        """Check (complete, finite, version increasing), then commit in place behind the last replay."""
        return self.weight_sync.commit(version)

    def abort_weight_update(self) -> None:
        """Drop the open update; the weights stay bit-identical."""
        self.weight_sync.abort()

    def sync_weights(self, source: WeightSource, expected: str | Sequence[str] = "trainable") -> WeightUpdateReport:
        """One-call update from a module, a state dict or pairs; parameters outside `expected` are skipped."""
        return self.weight_sync.sync(source, expected)

    def broadcast_weights(self, source: WeightSource | None = None, **options: Any) -> WeightUpdateReport:
        """`broadcast.broadcast_weights` into this policy: every rank of the group commits, or every rank aborts.

        `options`: src, group, expected, bucket_bytes, version, device, as there.
        """
        return broadcast_weights(self.weight_sync, source, **options)

    def _weights_in_use(self) -> Any:
        return self.weight_sync.reading()

    # --------------------------------------------------------------------------------------- lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Pi05Policy is closed; create a new policy.")

    def close(self) -> None:
        """Release graphs and buffers; further calls raise. A weight update in flight is aborted."""
        with self._lock:
            self.weight_sync.close()  # weight sync (C6): same lock, so no race with finish
            self._closed = True
            self.scheduler = None  # type: ignore[assignment]
