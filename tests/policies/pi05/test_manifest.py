"""Every key of LeRobot's full-size PI05Pytorch maps onto our pi05_base() model with the same shape.

The manifest (`policies/pi05/data/lerobot_pi05_base_manifest.json`, made by
tests/fixtures/lerobot/make_manifest.py) lists LeRobot's state-dict keys and shapes. Our model is built on
the meta device, so the 3.4 B-parameter geometry costs no memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from policies.pi05.checkpoint import DEAD_KEYS, RL_HEAD_PREFIXES, TIED_EMBEDDING, to_internal_name
from policies.pi05.config import Pi05Config
from policies.pi05.model import Pi05Model

MANIFEST = Path(__file__).resolve().parents[3] / "policies" / "pi05" / "data" / "lerobot_pi05_base_manifest.json"

pytestmark = pytest.mark.skipif(
    not MANIFEST.exists(),
    reason=f"{MANIFEST} missing; generate it with tests/fixtures/lerobot/make_manifest.py in the LeRobot venv",
)


@pytest.fixture(scope="module")
def manifest() -> dict[str, tuple[int, ...]]:
    data = json.loads(MANIFEST.read_text())
    return {k: tuple(v) for k, v in data.items() if not k.startswith("_")}


@pytest.fixture(scope="module")
def params() -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = Pi05Model(Pi05Config.pi05_base())
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("prefix", ["", "model."])
def test_every_manifest_key_maps_to_a_parameter_of_the_same_shape(manifest, params, prefix: str) -> None:
    unmapped, mismatched, dead = [], [], []
    for key, shape in manifest.items():
        name = to_internal_name(prefix + key)
        if name is None:
            dead.append(key)
        elif name not in params:
            unmapped.append(key)
        elif params[name] != shape:
            mismatched.append((key, name, shape, params[name]))
    assert not unmapped, f"manifest keys with no parameter: {unmapped[:10]}"
    assert not mismatched, f"shape mismatches: {mismatched[:10]}"
    assert sorted(dead) == sorted(k for k in manifest if k in DEAD_KEYS)


def test_every_parameter_except_rl_heads_is_covered(manifest, params) -> None:
    covered = {to_internal_name(k) for k in manifest} - {None}
    uncovered = sorted(n for n in params if n not in covered and not n.startswith(RL_HEAD_PREFIXES))
    assert not uncovered, f"parameters no LeRobot key provides: {uncovered[:10]}"
    # the tied embedding alone (as in the published file) covers llm.embed_tokens.weight
    assert to_internal_name(TIED_EMBEDDING) == "llm.embed_tokens.weight"
    assert manifest[TIED_EMBEDDING] == params["llm.embed_tokens.weight"]


def test_published_parameter_count(manifest, params) -> None:
    """Our model without RL heads is the reference's 3,353,433,872 used parameters (pi05_model.md 1.10)."""
    used = sum(torch.Size(s).numel() for n, s in params.items() if not n.startswith(RL_HEAD_PREFIXES))
    assert used == 3_353_433_872
    dead = sum(torch.Size(manifest[k]).numel() for k in DEAD_KEYS if k in manifest)
    assert dead == 263_323_648
