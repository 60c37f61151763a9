from __future__ import annotations

import pytest

from phyai_gym.protocols import PRESET_PROTOCOLS, get_protocol, list_protocols, protocol_for_preset
from policies.pi05.presets import list_presets


def test_presets_map_to_their_reference_protocol():
    assert protocol_for_preset("openpi_pi05_libero", "libero").name == "openpi_libero"
    assert protocol_for_preset("lerobot_pi05", "libero").name == "lerobot_libero"
    assert protocol_for_preset("rlinf_pi05_maniskill", "maniskill").name == "rlinf_maniskill"
    assert protocol_for_preset("openpi_pi05_libero", "mujoco").name == "phyai"
    assert protocol_for_preset(None, "libero").name == "phyai"
    assert {preset for preset, _ in PRESET_PROTOCOLS} <= set(list_presets())
    assert {name for name in PRESET_PROTOCOLS.values()} <= set(list_protocols())


def test_openpi_libero_protocol_is_openpis_procedure():
    protocol = get_protocol("openpi_libero")
    assert (protocol.episodes_per_task, protocol.action_chunk, protocol.primary_metric) == (50, 5, "success_once")
    assert dict(protocol.env_kwargs) == {
        "preset": "openpi", "render_size": 256, "image_size": 224, "seed_mode": "once", "seed": 7,
    }  # fmt: skip
    with pytest.raises(TypeError):
        protocol.env_kwargs["seed"] = 0  # read-only


def test_unknown_or_misapplied_protocol_is_refused():
    with pytest.raises(ValueError, match=r"--protocol 'nope' is unknown; choose one of: phyai, openpi_libero"):
        get_protocol("nope")
    with pytest.raises(ValueError, match=r"applies to libero envs, got a maniskill env"):
        get_protocol("lerobot_libero", "maniskill")
