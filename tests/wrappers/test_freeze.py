from __future__ import annotations

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from wrappers.adapters.scripted import ScriptedEnv, make_scripted_env
from wrappers.freeze import (
    THAW_OPTION,
    FreezeOnDone,
    is_freezable,
    make_freezable_vector_env,
    require_freezable,
    start_freezing,
)

ZERO = np.zeros(3, np.float32)


def test_frozen_env_replays_terminal_transition_until_thawed():
    env = FreezeOnDone(ScriptedEnv(episode_lengths=(2, 4)))
    env.start_freezing()
    env.reset(seed=5)
    env.step(ZERO)
    terminal, reward, term, trunc, info = env.step(ZERO)
    assert term and env.frozen
    for _ in range(3):
        obs, reward, term, trunc, _ = env.step(ZERO + 1)
        np.testing.assert_array_equal(obs["state"], terminal["state"])
        assert (reward, term, trunc) == (0.0, False, False)
    obs, _ = env.reset()  # an autoreset without the thaw option is ignored
    np.testing.assert_array_equal(obs["state"], terminal["state"])
    obs, info = env.reset(options={THAW_OPTION: True})
    assert not env.frozen and obs["state"][0] == 0 and info["episode_index"] == 1


def test_thawed_episode_equals_plain_env_episode():
    frozen, plain = FreezeOnDone(ScriptedEnv(episode_lengths=(1, 3))), ScriptedEnv(episode_lengths=(1, 3))
    frozen.start_freezing()
    frozen.reset(seed=9), plain.reset(seed=9)
    frozen.step(ZERO), plain.step(ZERO)
    for _ in range(2):
        frozen.reset()  # ignored
        frozen.step(ZERO)  # replayed
    a, _ = frozen.reset(options={THAW_OPTION: True})
    b, _ = plain.reset()
    np.testing.assert_array_equal(a["state"], b["state"])


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.name)
def test_vector_env_autoreset_never_resets_a_frozen_sub_env(mode):
    venv = make_scripted_env(2, episode_lengths=[(1,), (5,)], autoreset_mode=mode)
    assert is_freezable(venv)
    start_freezing(venv)
    obs, _ = venv.reset(seed=0, options={THAW_OPTION: True})
    actions = np.zeros((2, 3), np.float32)
    first, *_ = venv.step(actions)
    for _ in range(3):
        if mode == AutoresetMode.DISABLED:
            venv.reset(options={"reset_mask": np.array([True, False])})
        obs, rewards, *_ = venv.step(actions)
        np.testing.assert_array_equal(obs["state"][0], first["state"][0])
        assert rewards[0] == 0.0
    obs, _ = venv.reset(options={"reset_mask": np.array([True, False]), THAW_OPTION: True})
    assert obs["state"][0][1] == 1  # episode index advanced exactly once
    venv.close()


def test_unfreezable_env_is_refused_with_fix():
    from gymnasium.vector import SyncVectorEnv

    venv = SyncVectorEnv([ScriptedEnv])
    assert not is_freezable(venv)
    with pytest.raises(ValueError, match="make_freezable_vector_env"):
        require_freezable(venv)
    venv.close()
    with pytest.raises(ValueError, match="vectorization"):
        make_freezable_vector_env([ScriptedEnv], vectorization="threads")
    with pytest.raises(ValueError, match="shared_memory=True"):
        make_freezable_vector_env([ScriptedEnv], vectorization="async", autoreset_mode="NextStep")
