"""Helpers of the reliability tests: a tiny PI0.5 builder, canonical observations, and a probe that checks a
refused call left the policy exactly as it was (outputs, weight version, random streams).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from policies.pi05.config import Pi05Config
from policies.pi05.policy import Pi05Policy

ACTION_DIM = 3
STATE_DIM = 4
CAMERA = "image"


def make_tiny_policy(tokenizer_dir: Path, seed: int = 0, action_dim: int = ACTION_DIM, **kwargs: Any) -> Pi05Policy:
    """`Pi05Config.tiny()` with random weights, one camera ("image"), 3 action dims, 4 state dims."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no state statistics": expected for a random policy
        return Pi05Policy.from_config(
            Pi05Config.tiny(),
            action_dim=action_dim,
            seed=seed,
            tokenizer=str(tokenizer_dir),
            camera_map={CAMERA: "base_0_rgb"},
            state_dim=STATE_DIM,
            **kwargs,
        )


def make_obs(n: int = 2, seed: int = 0, size: int = 8) -> dict[str, Any]:
    """A canonical observation (DESIGN C1) of n envs with seeded images and states."""
    rng = np.random.default_rng(seed)
    return {
        "images": {CAMERA: rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)},
        "state": rng.standard_normal((n, STATE_DIM)).astype(np.float32),
        "task": [f"push block {i}" for i in range(n)],
    }


def outputs_of(out: Any) -> dict[str, torch.Tensor]:
    """The tensors of a `PolicyOutput` that must repeat bit for bit."""
    names = ("actions", "log_prob", "log_prob_elements", "values", "model_actions", "chains", "denoise_inds")
    return {name: getattr(out, name).detach().clone() for name in names if getattr(out, name) is not None}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} changed"


class Probe:
    """Reference `act()` before a bad call; after it, the streams, version and a repeated call must match.

    The reference call re-seeds its env ids, so repeating it with the same seeds must give the same bits if
    (and only if) the weights are unchanged; the stream table must be exactly as the reference left it.
    """

    def __init__(self, policy: Pi05Policy, seeds: tuple[int, ...] = (101, 202), env_ids: tuple[int, ...] = (7, 9)):
        self.policy = policy
        self.obs = make_obs(len(seeds), seed=sum(seeds))
        self.seeds, self.env_ids = list(seeds), list(env_ids)
        self.reference = outputs_of(self._act())
        self.streams = policy.streams.state()
        self.version = policy.weight_version

    def _act(self) -> Any:
        return self.policy.act(self.obs, seeds=self.seeds, env_ids=self.env_ids)

    def check(self) -> None:
        """Asserts the policy is unchanged by whatever ran since construction."""
        seeds, counters = self.policy.streams.state()
        assert torch.equal(seeds, self.streams[0]) and torch.equal(counters, self.streams[1]), "streams changed"
        assert self.policy.weight_version == self.version, "weight version changed"
        assert not getattr(getattr(self.policy, "weight_sync", None), "in_progress", False), "an update was left open"
        assert_same_tensors(outputs_of(self._act()), self.reference)
        seeds, counters = self.policy.streams.state()
        assert torch.equal(seeds, self.streams[0]) and torch.equal(counters, self.streams[1])


def check_message(message: str, *needles: str) -> None:
    """Every needle (argument name, expected value, received value) must appear in the error message."""
    missing = [n for n in needles if n not in message]
    assert not missing, f"message lacks {missing}: {message}"


def run_case(ctx: Any, fn: Callable[[Any], Any], exc: type[BaseException], needles: tuple[str, ...]) -> str:
    """Run a bad call between a reference act() and its repeat; check its error words; return the message.

    `ctx` carries `policy` and `capsys` (CLI errors are read from stderr).
    """
    probe = Probe(ctx.policy)
    with pytest.raises(exc) as info:
        fn(ctx)
    message = ctx.capsys.readouterr().err if isinstance(info.value, SystemExit) else str(info.value)
    check_message(message, *needles)
    probe.check()
    return message
