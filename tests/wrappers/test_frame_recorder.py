from __future__ import annotations

import numpy as np
import pytest

from policies.baseline import GaussianPolicy
from wrappers import FrameRecorder, PolicyVectorEnv
from wrappers.adapters.scripted import ScriptedEnv, make_scripted_env


@pytest.mark.parametrize("mode", ["SameStep", "NextStep", "Disabled"])
def test_every_env_step_of_an_armed_episode_is_a_frame(mode):
    # episodes of 7 env steps under chunks of 3: a per-chunk recording would hold 4 frames, this one 8
    recorder = FrameRecorder(make_scripted_env(2, episode_lengths=(7,), autoreset_mode=mode))
    envs = PolicyVectorEnv(recorder, GaussianPolicy(3, action_horizon=3, std=1e-6), action_chunk=3)
    recorder.arm(1, "clip")
    envs.reset(seed=10)
    for _ in range(4):
        envs.step()
    frames = recorder.take("clip")
    envs.close()

    single = ScriptedEnv(episode_lengths=(7,))  # the same episode, driven by hand (env 1 resets with seed + 1)
    expected = [single.reset(seed=11)[0]["images"]["image"]]
    expected += [single.step(np.zeros(3, np.float32))[0]["images"]["image"] for _ in range(7)]
    assert len(frames) == 8
    for got, want in zip(frames, expected):
        np.testing.assert_array_equal(got, want)
    assert recorder.take("clip") == []  # taken once


def test_unarmed_envs_are_not_recorded_and_bad_index_is_refused():
    recorder = FrameRecorder(make_scripted_env(2, episode_lengths=(2,)), fps=5)
    assert recorder.fps == 5.0
    with pytest.raises(ValueError, match=r"FrameRecorder.arm: index must be in \[0, 2\), got 2"):
        recorder.arm(2, "clip")
    envs = PolicyVectorEnv(recorder, GaussianPolicy(3, action_horizon=1), action_chunk=1)
    envs.reset(seed=0)
    envs.step()
    assert recorder.take("clip") == []
    envs.close()
