"""Pi05Config: published geometry, tiny() asymmetries (DESIGN C7), JSON round trips and validation."""

from __future__ import annotations

import json

import pytest

from policies.pi05.config import CAMERA_SLOTS, GemmaConfig, Pi05Config, SiglipConfig


def test_tiny_keeps_every_asymmetry() -> None:
    cfg = Pi05Config.tiny()
    lm, ex, vis = cfg.llm, cfg.expert, cfg.vision
    attn_width = ex.num_heads * ex.head_dim
    # expert width != heads x head_dim != LM width (and the LM's own q width differs from its width)
    assert len({ex.width, attn_width, lm.width}) == 3
    assert lm.num_heads * lm.head_dim != lm.width
    # one KV head shared by several query heads, but not the real model's 8 (catches hard-coded 8s)
    for stack in (lm, ex):
        assert stack.num_kv_heads == 1
        assert 1 < stack.num_heads != 8
    # SigLIP head_dim differs from the LM head_dim (and from the real 72)
    assert vis.head_dim != lm.head_dim
    assert vis.width % vis.num_heads == 0
    assert cfg.camera_slots == CAMERA_SLOTS and len(cfg.camera_slots) == 3
    assert cfg.action_dim == 32
    assert cfg.action_horizon != cfg.num_steps  # H and K are not confused
    assert cfg.dtype == "float32"
    assert lm.depth == ex.depth and lm.head_dim == ex.head_dim


def test_small_is_tiny_with_a_deeper_wider_lm_and_expert() -> None:
    tiny, small = Pi05Config.tiny(), Pi05Config.small()
    assert small.vision == tiny.vision and small.action_horizon == tiny.action_horizon
    for stack in (small.llm, small.expert):  # the expert attends with the LM: same depth, heads and head_dim
        assert (stack.width, stack.depth, stack.num_heads, stack.head_dim) == (128, 4, 4, 32)
    assert Pi05Config.small(max_token_len=128).max_token_len == 128


def test_make_policy_names_its_configs() -> None:
    from phyai_gym.make import make_policy

    assert make_policy(config="small", action_dim=7).model.config.expert.width == 128
    with pytest.raises(ValueError, match=r"config: expected 'tiny', 'small', 'base' .* got 'huge'"):
        make_policy(config="huge", action_dim=7)


def test_pi05_base_has_published_numbers() -> None:
    cfg = Pi05Config.pi05_base()
    vis = cfg.vision
    assert (vis.width, vis.depth, vis.mlp_dim, vis.num_heads, vis.patch_size, vis.image_size) == (
        1152,
        27,
        4304,
        16,
        14,
        224,
    )
    assert vis.head_dim == 72 and vis.num_patches == 256 and vis.eps == 1e-6
    lm = cfg.llm
    assert (lm.width, lm.depth, lm.mlp_dim, lm.num_heads, lm.num_kv_heads, lm.head_dim) == (
        2048,
        18,
        16384,
        8,
        1,
        256,
    )
    ex = cfg.expert
    assert (ex.width, ex.depth, ex.mlp_dim, ex.num_heads, ex.num_kv_heads, ex.head_dim) == (
        1024,
        18,
        4096,
        8,
        1,
        256,
    )
    for stack in (lm, ex):
        assert stack.eps == 1e-6 and stack.rope_theta == 10_000.0
    assert cfg.vocab_size == 257_152
    assert (cfg.action_horizon, cfg.num_steps, cfg.max_token_len, cfg.action_dim) == (50, 10, 200, 32)
    assert cfg.camera_slots == ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    assert (cfg.min_period, cfg.max_period) == (4e-3, 4.0)
    # prefix length 3 * 256 + 200 = 968
    assert len(cfg.camera_slots) * vis.num_patches + cfg.max_token_len == 968


@pytest.mark.parametrize(
    "cfg",
    [
        Pi05Config.tiny(),
        Pi05Config.pi05_base(),
        Pi05Config.small(),
        Pi05Config.tiny(value_source="suffix", noise_head=False, action_horizon=7, noise_std_range=(0.1, 0.2)),
    ],
    ids=["tiny", "base", "small", "tiny-variant"],
)
def test_config_json_round_trip(tmp_path, cfg: Pi05Config) -> None:
    path = tmp_path / "config.json"
    cfg.save(path)
    data = json.loads(path.read_text())
    assert data["type"] == "phyai_pi05"
    loaded = Pi05Config.load(path)
    assert loaded == cfg
    assert isinstance(loaded.vision, SiglipConfig) and isinstance(loaded.llm, GemmaConfig)
    assert isinstance(loaded.camera_slots, tuple) and isinstance(loaded.noise_std_range, tuple)
    assert Pi05Config.from_dict(cfg.to_dict()) == cfg


LEROBOT_CONFIG = {
    "type": "pi05",
    "n_obs_steps": 1,
    "input_features": {
        "observation.images.base_0_rgb": {"type": "VISUAL", "shape": [3, 224, 224]},
        "observation.state": {"type": "STATE", "shape": [32]},
    },
    "output_features": {"action": {"type": "ACTION", "shape": [32]}},
    "device": "cuda",
    "use_amp": False,
    "push_to_hub": True,
    "repo_id": None,
    "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
    "paligemma_variant": "gemma_2b",
    "action_expert_variant": "gemma_300m",
    "dtype": "float32",
    "chunk_size": 10,
    "n_action_steps": 10,
    "max_state_dim": 32,
    "max_action_dim": 32,
    "num_inference_steps": 5,
    "time_sampling_beta_alpha": 1.5,
    "time_sampling_beta_beta": 1.0,
    "time_sampling_scale": 0.999,
    "time_sampling_offset": 0.001,
    "min_period": 0.004,
    "max_period": 4.0,
    "image_resolution": [224, 224],
    "empty_cameras": 0,
    "tokenizer_max_length": 48,
    "compile_model": False,
    "gradient_checkpointing": False,
    "optimizer_lr": 2.5e-05,
}


def test_reads_lerobot_config(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LEROBOT_CONFIG))
    cfg = Pi05Config.load(path)
    base = Pi05Config.pi05_base()
    # geometry is the published one (LeRobot has no size options) ...
    assert (cfg.vision, cfg.llm, cfg.expert, cfg.vocab_size) == (base.vision, base.llm, base.expert, base.vocab_size)
    # ... and the run options come from the file
    assert cfg.action_horizon == 10
    assert cfg.num_steps == 5
    assert cfg.max_token_len == 48
    assert cfg.action_dim == 32
    assert cfg.dtype == "float32"
    assert (cfg.min_period, cfg.max_period) == (4e-3, 4.0)


def test_lerobot_defaults_when_fields_absent() -> None:
    cfg = Pi05Config.from_dict({"type": "pi05"})
    assert (cfg.action_horizon, cfg.num_steps, cfg.max_token_len) == (50, 10, 200)


BAD_CONFIGS = [
    (lambda: Pi05Config.tiny(expert=GemmaConfig(width=40, depth=3, mlp_dim=72, num_heads=4, head_dim=24)), "depth"),
    (lambda: Pi05Config.tiny(expert=GemmaConfig(width=40, depth=2, mlp_dim=72, num_heads=2, head_dim=24)), "num_heads"),
    (lambda: Pi05Config.tiny(expert=GemmaConfig(width=40, depth=2, mlp_dim=72, num_heads=4, head_dim=16)), "head_dim"),
    (
        lambda: Pi05Config.tiny(
            llm=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=3, head_dim=24),
            expert=GemmaConfig(width=40, depth=2, mlp_dim=72, num_heads=4, num_kv_heads=3, head_dim=24),
        ),
        "num_kv_heads",
    ),
    (lambda: Pi05Config.tiny(value_source="critic"), "value_source"),
    (lambda: Pi05Config.tiny(dtype="int8"), "dtype"),
    (lambda: Pi05Config.tiny(vision=SiglipConfig(width=50, depth=1, mlp_dim=8, num_heads=3)), "vision.width"),
    (lambda: Pi05Config.from_dict({**Pi05Config.tiny().to_dict(), "horizon": 5}), "horizon"),
    (lambda: Pi05Config.from_dict({**Pi05Config.tiny().to_dict(), "type": "pi0"}), "type"),
    (lambda: Pi05Config.from_dict({"type": "pi05", "paligemma_variant": "gemma_2b_lora"}), "paligemma_variant"),
    (lambda: Pi05Config.from_dict({**Pi05Config.tiny().to_dict(), "llm": {"widht": 64}}), "widht"),
    (lambda: Pi05Config.tiny(action_horizon=0), "action_horizon"),
    (lambda: Pi05Config.tiny(num_steps=0), "num_steps"),
    (lambda: Pi05Config.tiny(vision=SiglipConfig(width=48, depth=0, mlp_dim=8, num_heads=3)), "vision.depth"),
]


@pytest.mark.parametrize("build, field", BAD_CONFIGS, ids=[f for _, f in BAD_CONFIGS])
def test_bad_config_raises_value_error_naming_field(build, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build()
