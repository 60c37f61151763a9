from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from policies.pi05.normalize import NormStats
from policies.pi05.presets import get_preset, infer_preset, list_presets
from policies.pi05.processor import Pi05Processor, ProcessorConfig
from policies.pi05.prompt import discretize_state_np, host_tokenize

S = 32  # model image size in these tests
STATE_STATS = NormStats(
    mean=np.zeros(4), std=np.ones(4), q01=np.array([-1.0, 0.0, -2.0, 0.0]), q99=np.array([1.0, 2.0, 2.0, 10.0])
)
ACTION_STATS = NormStats(
    mean=np.zeros(3), std=np.ones(3), q01=np.array([0.0, -1.0, 0.0]), q99=np.array([2.0, 1.0, 1.0])
)


def _config(tok_dir, **kw):
    base = dict(
        camera_map={"image": "base_0_rgb", "wrist": "left_wrist_0_rgb"},
        image_size=S,
        max_token_len=112,
        state_stats=STATE_STATS,
        action_stats=ACTION_STATS,
        action_dim=4,
        tokenizer=str(tok_dir),
    )
    base.update(kw)
    return ProcessorConfig(**base)


def _obs(n=3, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "images": {
            "image": rng.integers(0, 256, (n, 40, 48, 3), dtype=np.uint8),
            "wrist": rng.integers(0, 256, (n, 24, 24, 3), dtype=np.uint8),
            "unused": rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8),
        },
        "state": rng.uniform(-2, 3, (n, 4)).astype(np.float32),
        "task": [f"pick_up block {i % 2}" for i in range(n)],
    }


@pytest.fixture(scope="module")
def proc(standin_tokenizer):
    return Pi05Processor(_config(standin_tokenizer))


def test_outputs_and_tokens_match_host(proc, standin_tok):
    obs = _obs()
    x = proc(obs)
    assert x.images.shape == (3, 2, 3, S, S) and x.images.dtype == torch.uint8
    assert x.slots == (0, 1) and x.image_mask.all() and x.image_mask.shape == (3, 2)
    assert x.tokens.dtype == torch.int32 and x.lengths.dtype == torch.int32
    q01, q99 = STATE_STATS.q01, STATE_STATS.q99
    state_norm = (obs["state"].astype(np.float64) - q01) / (q99 - q01 + 1e-6) * 2.0 - 1.0  # openpi rule
    np.testing.assert_allclose(x.state.numpy(), state_norm, rtol=1e-6)
    bins = discretize_state_np(state_norm)
    for i in range(3):
        ref = host_tokenize(standin_tok, obs["task"][i], "state", bins[i])
        assert x.tokens[i, : x.lengths[i]].tolist() == ref
        assert (x.tokens[i, x.lengths[i] :] == 0).all()


def test_camera_map_decides_slots(standin_tokenizer):
    p = Pi05Processor(_config(standin_tokenizer, camera_map={"wrist": "right_wrist_0_rgb"}, prompt_format="text"))
    x = p(_obs())
    assert x.slots == (2,) and x.images.shape == (3, 1, 3, S, S)
    p2 = Pi05Processor(_config(standin_tokenizer, camera_map={"wrist": "base_0_rgb", "image": "right_wrist_0_rgb"}))
    x2 = p2(_obs())
    assert x2.slots == (0, 2)
    assert torch.equal(x2.images[:, 0], p(_obs()).images[:, 0])  # wrist camera first (slot 0)


def test_batch_equals_single_calls(proc):
    obs = _obs(n=4, seed=3)
    batch = proc(obs)
    for i in range(4):
        one = proc(
            {
                "images": {k: v[i : i + 1] for k, v in obs["images"].items()},
                "state": obs["state"][i : i + 1],
                "task": obs["task"][i : i + 1],
            }
        )
        assert torch.equal(one.images[0], batch.images[i])
        assert torch.equal(one.state[0], batch.state[i])
        n = one.lengths[0].item()
        assert n == batch.lengths[i].item()
        assert torch.equal(one.tokens[0, :n], batch.tokens[i, :n])


def test_torch_inputs_equal_numpy_inputs(proc):
    obs = _obs(seed=4)
    tobs = {
        "images": {k: torch.from_numpy(v) for k, v in obs["images"].items()},
        "state": torch.from_numpy(obs["state"]),
        "task": tuple(obs["task"]),
    }
    a, b = proc(obs), proc(tobs)
    assert torch.equal(a.images, b.images) and torch.equal(a.tokens, b.tokens) and torch.equal(a.state, b.state)


def test_postprocess(standin_tokenizer):
    p = Pi05Processor(_config(standin_tokenizer, action_dim=3, norm_mode="quantile", eps_rule="phyai"))
    y = torch.linspace(-1, 1, 2 * 10 * 32).reshape(2, 10, 32)
    out = p.postprocess(y, action_chunk=4)
    assert out.shape == (2, 4, 3) and out.dtype == torch.float32
    q01 = torch.tensor(ACTION_STATS.q01, dtype=torch.float32)
    q99 = torch.tensor(ACTION_STATS.q99, dtype=torch.float32)
    ref = (y[:, :4, :3] + 1.0) / 2.0 * (q99 - q01 + 1e-8) + q01
    assert torch.allclose(out, ref)
    # action dims beyond the stats are passed through
    wide = Pi05Processor(_config(standin_tokenizer, action_dim=5)).postprocess(y, 2)
    assert torch.equal(wide[..., 3:], y[:, :2, 3:5])
    binary = Pi05Processor(_config(standin_tokenizer, action_dim=3, gripper_map="binary", gripper_threshold=0.5))
    g = binary.postprocess(y)[..., -1]
    assert set(g.unique().tolist()) <= {-1.0, 1.0}
    inv = Pi05Processor(_config(standin_tokenizer, action_dim=3, gripper_map="invert")).postprocess(y)
    assert torch.allclose(inv[..., -1], -p.postprocess(y)[..., -1])
    with pytest.raises(ValueError, match=r"action_chunk must be in 1..H=10, got 11"):
        p.postprocess(y, 11)


def test_every_option_survives_save_load(standin_tokenizer, tmp_path):
    cfg = ProcessorConfig(
        camera_map={"cam": "right_wrist_0_rgb", "top": "base_0_rgb"},
        camera_slots=("base_0_rgb", "extra_rgb", "right_wrist_0_rgb"),
        image_size=S,
        resize_mode="bilinear",
        rotate180=True,
        hflip=True,
        prompt_format="text",
        max_token_len=40,
        prompt_buckets=(8, 24),
        norm_mode="mean_std",
        action_norm_mode="quantile",
        eps_rule="lerobot",
        norm_eps=1e-5,
        state_stats=STATE_STATS,
        action_stats=ACTION_STATS,
        state_dim=4,
        action_dim=6,
        model_action_dim=16,
        gripper_map="binary",
        gripper_index=2,
        gripper_threshold=0.25,
        tokenizer=str(standin_tokenizer),
        vocab_size=300_000,
        check_finite_on_device=True,
        action_horizon=12,
        action_chunk=3,
        num_steps=7,
        preset="custom",
    )
    defaults = ProcessorConfig()
    for name in cfg.to_dict():  # the test sets every field to a non-default value
        assert getattr(cfg, name) != getattr(defaults, name), name
    p = Pi05Processor(cfg)
    p.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "processor_config.json").read_text())["prompt_format"] == "text"
    q = Pi05Processor.from_pretrained(tmp_path)
    assert q.config == cfg
    obs = {"images": {"cam": _obs()["images"]["wrist"], "top": _obs()["images"]["image"]}, "task": ["a", "b", "c"]}
    obs["state"] = _obs()["state"]
    a, b = p(obs), q(obs)
    assert torch.equal(a.images, b.images) and torch.equal(a.tokens, b.tokens) and a.tokens.shape[1] == 8
    y = torch.randn(3, 12, 16)
    assert torch.equal(p.postprocess(y, 3), q.postprocess(y, 3))


def test_text_only_processor_reloads_text_only(standin_tokenizer, tmp_path):
    p = Pi05Processor(_config(standin_tokenizer, prompt_format="text", state_stats=None))
    p.save_pretrained(tmp_path)
    q = Pi05Processor.from_pretrained(tmp_path)
    assert q.config.prompt_format == "text" and q.config.state_stats is None
    obs = _obs()
    del obs["state"]
    x = q(obs)
    assert x.state is None
    assert x.tokens[0, : x.lengths[0]].tolist() == host_tokenize(q.tokenizer, obs["task"][0], "text")


def test_presets_and_inference(standin_tokenizer, tmp_path):
    assert set(list_presets()) == {
        "openpi_pi05_base",
        "openpi_pi05_libero",
        "lerobot_pi05",
        "rlinf_pi05_libero",
        "rlinf_pi05_maniskill",
    }
    libero = get_preset("openpi_pi05_libero")
    assert (libero.prompt_format, libero.action_horizon, libero.action_dim) == ("text", 10, 7)
    assert get_preset("lerobot_pi05").resize_mode == "bilinear" and get_preset("lerobot_pi05").eps_rule == "lerobot"
    assert get_preset("openpi_pi05_base").tokenizer == "google/paligemma-3b-pt-224"
    with pytest.raises(ValueError, match="rlinf_pi05_maniskill"):
        get_preset("nope")
    with pytest.raises(ValueError, match=r"Pass preset= one of: lerobot_pi05"):
        infer_preset(tmp_path)
    lr = tmp_path / "lerobot"
    lr.mkdir()
    (lr / "config.json").write_text(json.dumps({"type": "pi05"}))
    assert infer_preset(lr).name == "lerobot_pi05"
    op = tmp_path / "openpi" / "assets" / "physical-intelligence" / "libero"
    op.mkdir(parents=True)
    stats = {"norm_stats": {"state": {"q01": [0.0] * 8, "q99": [1.0] * 8}, "actions": {"q01": [0] * 7, "q99": [1] * 7}}}
    (op / "norm_stats.json").write_text(json.dumps(stats))
    cfg = ProcessorConfig.from_preset(infer_preset(tmp_path / "openpi"), image_size=S, tokenizer=str(standin_tokenizer))
    assert cfg.preset == "openpi_pi05_libero" and cfg.camera_map == {
        "image": "base_0_rgb",
        "wrist_image": "left_wrist_0_rgb",
    }
    assert cfg.action_horizon == 10 and cfg.action_chunk == 5


def test_from_pretrained_checkpoint_folder(standin_tokenizer, tmp_path):
    op = tmp_path / "assets" / "libero_task"
    op.mkdir(parents=True)
    stats = {"norm_stats": {"state": {"q01": [0.0] * 8, "q99": [1.0] * 8}, "actions": {"q01": [0] * 7, "q99": [2] * 7}}}
    (op / "norm_stats.json").write_text(json.dumps(stats))
    from policies.pi05.tokenizer import load_tokenizer

    p = Pi05Processor.from_pretrained(tmp_path, tokenizer=load_tokenizer(standin_tokenizer), image_size=S)
    assert p.config.preset == "openpi_pi05_libero" and p.config.state_stats.width == 8
    out = p.postprocess(torch.zeros(1, 10, 32), 5)
    assert out.shape == (1, 5, 7) and torch.allclose(out, torch.ones(1, 5, 7), atol=1e-5)


BAD_INPUTS = [
    (
        "float images",
        lambda o: o["images"].__setitem__("image", o["images"]["image"].astype(np.float32)),
        TypeError,
        ["obs['images']['image']", "uint8", "float32"],
    ),
    (
        "4 channels",
        lambda o: o["images"].__setitem__("wrist", np.zeros((3, 24, 24, 4), np.uint8)),
        ValueError,
        ["obs['images']['wrist']", "3 RGB channels", "(3, 24, 24, 4)"],
    ),
    (
        "channel first",
        lambda o: o["images"].__setitem__("wrist", np.zeros((3, 3, 24, 24), np.uint8)),
        ValueError,
        ["channel-first", "(N, H, W, 3)"],
    ),
    ("missing camera", lambda o: o["images"].pop("wrist"), ValueError, ["missing camera 'wrist'", "camera_map"]),
    ("nan state", lambda o: o["state"].__setitem__((1, 2), np.nan), ValueError, ["obs['state']", "finite", "NaN"]),
    ("inf state", lambda o: o["state"].__setitem__((0, 0), np.inf), ValueError, ["obs['state']", "Inf"]),
    (
        "state width",
        lambda o: o.__setitem__("state", np.zeros((3, 5), np.float32)),
        ValueError,
        ["obs['state']", "expected width 4", "got 5"],
    ),
    ("int state", lambda o: o.__setitem__("state", np.zeros((3, 4), np.int64)), TypeError, ["obs['state']", "int64"]),
    ("empty task", lambda o: o["task"].__setitem__(1, "  "), ValueError, ["obs['task'][1]", "non-empty", "'  '"]),
    ("task str", lambda o: o.__setitem__("task", "pick"), TypeError, ["obs['task']", "sequence of N strings", "str"]),
    (
        "batch images",
        lambda o: o["images"].__setitem__("image", o["images"]["image"][:2]),
        ValueError,
        ["obs['images']['image']", "expected 3 rows", "obs['images']['image'] 2"],
    ),
    ("batch state", lambda o: o.__setitem__("state", o["state"][:1]), ValueError, ["obs['state']", "3 rows"]),
    ("missing state", lambda o: o.pop("state"), ValueError, ["obs['state']", "missing", "prompt_format='text'"]),
    (
        "new task + bad image",
        lambda o: (
            o["task"].__setitem__(0, "brand new task"),
            o["images"].__setitem__("image", o["images"]["image"][..., :2]),
        ),
        ValueError,
        ["3 RGB channels"],
    ),
]


@pytest.mark.parametrize(("what", "mutate", "error", "fragments"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_and_leave_processor_intact(proc, what, mutate, error, fragments):
    good = proc(_obs(seed=11))
    cached = proc.prompt.num_cached_tasks
    bad = _obs(seed=11)
    mutate(bad)
    with pytest.raises(error) as info:
        proc(bad)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert proc.prompt.num_cached_tasks == cached
    again = proc(_obs(seed=11))
    assert torch.equal(again.tokens, good.tokens) and torch.equal(again.images, good.images)


def test_config_errors(standin_tokenizer):
    with pytest.raises(ValueError, match=r"slots \['wrist'\] are not model slots"):
        ProcessorConfig(camera_map={"a": "wrist"})
    with pytest.raises(ValueError, match="same slot"):
        ProcessorConfig(camera_map={"a": "base_0_rgb", "b": "base_0_rgb"})
    with pytest.raises(ValueError, match=r"resize_mode: expected one of \('antialias', 'bilinear'\), got 'area'"):
        ProcessorConfig(resize_mode="area")
    with pytest.raises(ValueError, match="unknown ProcessorConfig keys"):
        ProcessorConfig.from_dict({"colour": 1})
    with pytest.raises(ValueError, match="257152 tokens"):
        Pi05Processor(_config(standin_tokenizer, vocab_size=1000))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Pi05Processor(_config(standin_tokenizer, tokenizer="/does/not/exist"))


def test_for_config_matches_model_geometry(standin_tok):
    from policies.pi05.config import Pi05Config

    model_cfg = Pi05Config.tiny()
    with pytest.warns(UserWarning, match="no state statistics"):
        p = Pi05Processor.for_config(model_cfg, action_dim=7, tokenizer=standin_tok)
    assert p.config.max_token_len == model_cfg.max_token_len and p.prompt_buckets == (16, 32, 48)
    assert p.config.image_size == model_cfg.vision.image_size and p.slots == (0, 1, 2) and p.action_dim == 7
    q = Pi05Processor.for_config(model_cfg, tokenizer=standin_tok.name, preset="rlinf_pi05_libero", action_dim=7)
    assert q.config.tokenizer == standin_tok.name
    assert q.action_chunk == 5 and q.action_horizon == 10 and q.slots == (0, 1)
