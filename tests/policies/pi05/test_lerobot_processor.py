"""LeRobot normalisation parity: our processor reads LeRobot's processor files and reproduces its normaliser.

The fixture (`tests/fixtures/lerobot/make_norm_fixture.py`) holds, for every mode LeRobot 0.6.1 defines, for
mixed STATE/ACTION modes, a non-default eps and a norm_map without STATE, the processor files LeRobot saved and
the outputs of LeRobot's own (re-loaded) normaliser on the state and un-normaliser on the actions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from policies.pi05.lerobot_processor import LEROBOT_MODES, read_lerobot_normalization
from policies.pi05.processor import Pi05Processor
from policies.pi05.tokenizer import PromptTokenizer

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "lerobot"
PAYLOAD = json.loads((FIXTURES / "normalization_parity.json").read_text())
TENSORS = load_file(str(FIXTURES / "normalization_parity.safetensors"))
CASES = sorted(PAYLOAD["cases"])


def write_case(case: str, folder: Path) -> Path:
    """The folder LeRobot wrote for `case`: its JSON files byte for byte and its sidecar tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in PAYLOAD["cases"][case]["files"].items():
        (folder / name).write_text(text)
    sidecars: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in TENSORS.items():
        parts = key.split("/")  # "<case>/<sidecar file>/<tensor>" or "<case>/output.<vector>"
        if len(parts) == 3 and parts[0] == case:
            sidecars.setdefault(parts[1], {})[parts[2]] = value
    for file, tensors in sidecars.items():
        save_file(tensors, str(folder / file))
    return folder


def load_processor(folder: Path, tokenizer: PromptTokenizer) -> Pi05Processor:
    return Pi05Processor.from_pretrained(
        folder, preset="lerobot_pi05", tokenizer=tokenizer, camera_map={"image": "base_0_rgb"}, image_size=16,
        action_dim=3,
    )  # fmt: skip


def test_fixture_covers_every_lerobot_mode_on_state_and_actions() -> None:
    """Every LeRobot mode appears on the state and on the actions, and some case mixes two modes."""
    maps = [PAYLOAD["cases"][c]["norm_map"] for c in CASES]
    assert {m.get("STATE", "IDENTITY") for m in maps} == set(LEROBOT_MODES)
    assert {m["ACTION"] for m in maps} == set(LEROBOT_MODES)
    assert any(m.get("STATE") not in (None, m["ACTION"]) for m in maps)


@pytest.mark.parametrize("case", CASES)
def test_state_and_actions_match_lerobot(case: str, tmp_path: Path, standin_tok: PromptTokenizer) -> None:
    """State normalised and actions un-normalised as LeRobot's own pipelines did, within 1e-6, each apart."""
    proc = load_processor(write_case(case, tmp_path), standin_tok)
    spec = PAYLOAD["cases"][case]
    assert proc.config.norm_mode == LEROBOT_MODES[spec["norm_map"].get("STATE", "IDENTITY")]
    assert proc.config.action_mode == LEROBOT_MODES[spec["norm_map"]["ACTION"]]
    state = TENSORS["input.state"]
    n = state.shape[0]
    obs = {"images": {"image": np.zeros((n, 8, 8, 3), np.uint8)}, "state": state.numpy(), "task": ["t"] * n}
    ours = proc(obs).state
    torch.testing.assert_close(ours, TENSORS[f"{case}/output.state"], atol=1e-6, rtol=0)
    actions = TENSORS["input.actions"]  # (B, H, 3) model space
    padded = torch.zeros(*actions.shape[:2], 32)
    padded[..., :3] = actions
    back = proc.postprocess(padded, action_chunk=actions.shape[1])
    torch.testing.assert_close(back, TENSORS[f"{case}/output.actions"], atol=1e-6, rtol=0)


def test_mixed_modes_are_not_mixed_up(tmp_path: Path, standin_tok: PromptTokenizer) -> None:
    """The issue's case: STATE=QUANTILES, ACTION=MEAN_STD un-normalises actions as mean/std, not quantiles."""
    proc = load_processor(write_case("state_quantiles_action_mean_std", tmp_path), standin_tok)
    stats = proc.config.action_stats
    y = torch.full((1, 1, 32), 0.5)
    expected = torch.as_tensor(0.5 * stats.std + stats.mean, dtype=torch.float32)
    torch.testing.assert_close(proc.postprocess(y, 1)[0, 0], expected, atol=1e-6, rtol=0)


def test_eps_and_missing_state_entry_are_read(tmp_path: Path) -> None:
    eps = read_lerobot_normalization(write_case("eps_1e-3_state_mean_std_action_min_max", tmp_path / "a"))
    assert (eps.state_mode, eps.action_mode, eps.eps) == ("mean_std", "min_max", 1e-3)
    none = read_lerobot_normalization(write_case("no_state_entry_action_quantiles", tmp_path / "b"))
    assert (none.state_mode, none.action_mode) == ("identity", "quantile") and "state" not in none.stats
