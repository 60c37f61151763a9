"""Semantics of PolicyVectorEnv (DESIGN C2/C3) on the scripted env."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.wrappers.vector import DictInfoToList, RecordEpisodeStatistics

from policies.baseline import ConstantPolicy, GaussianPolicy
from policies.pi05.config import Pi05Config
from policies.pi05.policy import Pi05Policy
from wrappers.adapters.scripted import ScriptedEnv, make_scripted_env
from wrappers.policy_vector_env import PolicyVectorEnv

C, A = 4, 3
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


def reference_rollout(lengths, seed, chunks, end_with="terminated"):
    """One plain ScriptedEnv driven with chunk semantics by hand: stop at the end, reset at the boundary."""
    env = ScriptedEnv(episode_lengths=lengths, end_with=end_with)
    obs, _ = env.reset(seed=seed)
    steps = []
    for chunk in chunks:
        total, term_any, trunc_any, executed, final = 0.0, False, False, 0, None
        for action in chunk:
            obs, reward, term, trunc, _ = env.step(action)
            total += reward
            executed += 1
            if term or trunc:
                term_any, trunc_any, final = term, trunc, obs
                obs, _ = env.reset()
                break
        steps.append(dict(obs=obs, reward=total, term=term_any, trunc=trunc_any, executed=executed, final=final))
    return steps


def assert_obs_row(batch, i, single):
    np.testing.assert_array_equal(batch["state"][i], single["state"])
    np.testing.assert_array_equal(batch["images"]["image"][i], single["images"]["image"])
    assert batch["task"][i] == single["task"]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("end_with", ["terminated", "truncated"])
def test_end_at_every_substep_matches_single_env(mode, end_with):
    # env i's first episode ends at sub-step i; later episodes end at other positions
    lengths = [(k + 1, 3, C + 2, 2 * C) for k in range(C)]
    env = make_scripted_env(C, episode_lengths=lengths, autoreset_mode=mode, end_with=end_with)
    wrapper = PolicyVectorEnv(env, ConstantPolicy([0.0] * A, action_horizon=C), action_chunk=C)
    chunks = np.random.default_rng(0).uniform(-1, 1, size=(6, C, C, A)).astype(np.float32)
    obs, _ = wrapper.reset(seed=10)
    refs = [reference_rollout(lengths[i], 10 + i, chunks[:, i], end_with) for i in range(C)]
    for t in range(len(chunks)):
        obs, rewards, terms, truncs, info = wrapper.step(chunks[t])
        for i in range(C):
            ref = refs[i][t]
            assert_obs_row(obs, i, ref["obs"])
            np.testing.assert_allclose(rewards[i], ref["reward"], rtol=1e-12)
            assert (terms[i], truncs[i]) == (ref["term"], ref["trunc"])
            assert info["substep_mask"][i].sum() == ref["executed"]
            assert info["substep_mask"][i].tolist() == [k < ref["executed"] for k in range(C)]
            assert info["_final_obs"][i] == (ref["final"] is not None)
            if ref["final"] is not None:
                assert_obs_row(info["final_obs"], i, ref["final"])
    assert isinstance(rewards, np.ndarray) and rewards.dtype == np.float64
    wrapper.close()


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.DISABLED], ids=lambda m: m.name)
def test_async_inner_env_matches_single_env(mode):
    lengths = [(k + 1, 3) for k in range(C)]
    env = make_scripted_env(C, episode_lengths=lengths, vectorization="async", autoreset_mode=mode)
    wrapper = PolicyVectorEnv(env, ConstantPolicy([0.0] * A, action_horizon=C), action_chunk=C)
    chunks = np.random.default_rng(1).uniform(-1, 1, size=(3, C, C, A)).astype(np.float32)
    obs, _ = wrapper.reset(seed=3)
    refs = [reference_rollout(lengths[i], 3 + i, chunks[:, i]) for i in range(C)]
    for t in range(len(chunks)):
        obs, rewards, *_ = wrapper.step(chunks[t])
        for i in range(C):
            assert_obs_row(obs, i, refs[i][t]["obs"])
    wrapper.close()


def run_policy(num_envs, seed, lengths, groups=1, steps=5, chunk=C):
    per_group = num_envs // groups
    envs = [
        make_scripted_env(per_group, episode_lengths=lengths[g * per_group : (g + 1) * per_group])
        for g in range(groups)
    ]
    wrapper = PolicyVectorEnv(
        envs if groups > 1 else envs[0], GaussianPolicy(A, action_horizon=8, std=0.3), action_chunk=chunk
    )
    obs, _ = wrapper.reset(seed=seed)
    history = []
    for _ in range(steps):
        obs, rewards, terms, truncs, info = wrapper.step()
        history.append(
            dict(
                state=obs["state"].copy(),
                rewards=rewards.copy(),
                done=terms | truncs,
                actions=info["policy"]["actions"].clone(),
                log_prob=info["policy"]["log_prob"].clone(),
            )
        )
    wrapper.close()
    return history


def test_n_envs_equal_n_single_runs_with_stochastic_policy():
    lengths = [(2, 5), (3,), (7, 1), (4, 4)]
    batched = run_policy(4, 100, lengths)
    for i in range(4):
        single = run_policy(1, 100 + i, [lengths[i]])
        for b, s in zip(batched, single):
            torch.testing.assert_close(b["actions"][i], s["actions"][0], rtol=0, atol=0)
            torch.testing.assert_close(b["log_prob"][i], s["log_prob"][0], rtol=0, atol=0)
            np.testing.assert_array_equal(b["state"][i], s["state"][0])
            np.testing.assert_array_equal(b["rewards"][i], s["rewards"][0])
    assert not torch.equal(batched[0]["actions"][0], batched[0]["actions"][1])


def test_groups_equal_one_group():
    lengths = [(2, 5), (3,), (7, 1), (4, 4)]
    one, two = run_policy(4, 7, lengths, groups=1), run_policy(4, 7, lengths, groups=2)
    for a, b in zip(one, two):
        torch.testing.assert_close(a["actions"], b["actions"], rtol=0, atol=0)
        np.testing.assert_array_equal(a["state"], b["state"])
        np.testing.assert_array_equal(a["rewards"], b["rewards"])
        np.testing.assert_array_equal(a["done"], b["done"])


def test_policy_info_final_value_and_spaces():
    env = make_scripted_env(2, episode_lengths=[(2,), (9,)], success_steps=(1,))
    policy = GaussianPolicy(A, action_horizon=8)
    wrapper = PolicyVectorEnv(env, policy, action_chunk=C)
    assert wrapper.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
    assert wrapper.single_action_space.shape == (C, A) and wrapper.action_space.shape == (2, C, A)
    assert isinstance(wrapper.single_observation_space["task"], gym.spaces.Text)
    assert wrapper.single_observation_space["images"]["image"].dtype == np.uint8
    obs, _ = wrapper.reset(seed=0)
    assert wrapper.observation_space["state"].shape == (2, 4)
    obs, rewards, terms, truncs, info = wrapper.step()
    assert set(info["policy"]) >= {"actions", "log_prob", "log_prob_elements", "values", "final_value"}
    assert info["_policy"].all() and info["policy"]["final_value"].shape == (2,)
    assert info["policy"]["actions"].device == policy.device
    assert terms.tolist() == [True, False]
    assert info["success"].tolist() == [False, False] and info["_success"].all()
    assert info["episode"]["success_once"].tolist() == [True, False]
    assert info["episode"]["l"].tolist() == [2, 0] and info["_episode"].tolist() == [True, False]
    np.testing.assert_allclose(info["substep_rewards"].sum(1), rewards)
    wrapper.close()


def test_record_episode_statistics_and_dict_info_to_list_on_top():
    lengths = [(3, 6), (5,)]
    ours = PolicyVectorEnv(make_scripted_env(2, episode_lengths=lengths), GaussianPolicy(A, 8), action_chunk=C)
    stacked = RecordEpisodeStatistics(ours, stats_key="gym_episode")
    obs, _ = stacked.reset(seed=1)
    seen = 0
    for _ in range(8):
        obs, rewards, terms, truncs, info = stacked.step(None)
        if "gym_episode" in info:
            mask = info["_gym_episode"]
            np.testing.assert_allclose(info["gym_episode"]["r"][mask], info["episode"]["r"][mask])
            expected_chunks = np.ceil(info["episode"]["l"][mask] / C)
            np.testing.assert_array_equal(info["gym_episode"]["l"][mask], expected_chunks)
            seen += int(mask.sum())
    assert seen >= 3
    stacked.close()

    plain = PolicyVectorEnv(
        make_scripted_env(2, episode_lengths=lengths),
        GaussianPolicy(A, 8),
        action_chunk=C,
        episode_statistics=False,
        numpy_infos=True,
    )
    listed = DictInfoToList(RecordEpisodeStatistics(plain))
    obs, infos = listed.reset(seed=1)
    for _ in range(3):
        obs, rewards, terms, truncs, infos = listed.step(None)
    assert isinstance(infos, list) and len(infos) == 2
    assert infos[0]["policy"]["actions"].shape == (C, A)
    assert "episode" in infos[0] and "final_obs" in infos[0]
    listed.close()


def test_sync_weights_and_callback():
    seen = []
    policy = GaussianPolicy(A, 8)
    wrapper = PolicyVectorEnv(make_scripted_env(2), policy, action_chunk=2, callback=lambda env, info: seen.append(1))
    wrapper.reset(seed=0)
    report = wrapper.sync_weights({"mean": torch.full((A,), 5.0)})
    assert report["version"] == 1
    _, _, _, _, info = wrapper.step()
    assert seen == [1] and info["policy"]["actions"].mean().item() > 3.0
    wrapper.close()


# ---------------------------------------------------------------------------------------------- errors
def test_errors_name_argument_expected_and_fix():
    policy = GaussianPolicy(A, action_horizon=4)
    with pytest.raises(ValueError, match=r"action_chunk.*action_horizon=4.*got 5.*Fix"):
        PolicyVectorEnv(make_scripted_env(1), policy, action_chunk=5)
    with pytest.raises(ValueError, match=r"action_dim=7 does not match.*3.*Fix"):
        PolicyVectorEnv(make_scripted_env(1), GaussianPolicy(7, 4), action_chunk=2)
    with pytest.raises(TypeError, match=r"argument `env` must be a gymnasium.vector.VectorEnv.*ScriptedEnv.*Fix"):
        PolicyVectorEnv(ScriptedEnv(), policy, action_chunk=2)
    plain = SyncVectorEnv([ScriptedEnv])
    with pytest.raises(ValueError, match=r"freeze.*make_freezable_vector_env"):
        PolicyVectorEnv(plain, policy, action_chunk=2)
    plain.close()
    with pytest.raises(TypeError, match=r"argument `policy`"):
        PolicyVectorEnv(make_scripted_env(1), object(), action_chunk=2)
    with pytest.raises(ValueError, match=r"argument `groups` is 2 but 1"):
        PolicyVectorEnv(make_scripted_env(2), policy, action_chunk=2, groups=2)

    wrapper = PolicyVectorEnv(make_scripted_env(2), policy, action_chunk=2)
    with pytest.raises(RuntimeError, match="reset"):
        wrapper.step()
    wrapper.reset(seed=0)
    with pytest.raises(ValueError, match=r"`actions` must have shape \(N, C, A\) = \(2, 2, 3\), got \(2, 3\)"):
        wrapper.step(np.zeros((2, 3), np.float32))
    wrapper.close()
    with pytest.raises(gym.error.ClosedEnvironmentError, match="closed"):
        wrapper.step()


class _NoTask(gym.ObservationWrapper):
    def __init__(self, env):
        super().__init__(env)
        self.observation_space = gym.spaces.Dict({k: v for k, v in env.observation_space.items() if k != "task"})

    def observation(self, obs):
        return {k: v for k, v in obs.items() if k != "task"}


def test_missing_observation_key_is_refused():
    from wrappers.freeze import make_freezable_vector_env

    env = make_freezable_vector_env([lambda: _NoTask(ScriptedEnv())])
    with pytest.raises(KeyError, match=r"missing \['task'\].*Fix"):
        PolicyVectorEnv(env, GaussianPolicy(A, 4), action_chunk=2)
    env.close()


# ---------------------------------------------------------------------------------------------- final values
class CriticGaussian(GaussianPolicy):
    """GaussianPolicy with a critic that is >= 1 everywhere and differs per observation and per env id."""

    def value(self, obs, *, env_ids=None):
        state = torch.as_tensor(obs["state"])
        ids = torch.arange(state.shape[0]) if env_ids is None else torch.as_tensor(list(env_ids))
        # step in episode, episode index, reset noise: the terminal and the reset observation differ
        return (1.0 + state[:, 0] + 10.0 * state[:, 1] + 1e-3 * state[:, 2] + 1e3 * ids).to(torch.float32)


class TorchObservations(gym.vector.VectorWrapper):
    """Serves a numpy vector env's observations and flags as torch tensors (the path of GPU simulators)."""

    def _obs(self, obs):
        images = {name: torch.as_tensor(image) for name, image in obs["images"].items()}
        return {"images": images, "state": torch.as_tensor(obs["state"]), "task": tuple(obs["task"])}

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self._obs(obs), info

    def step(self, actions):
        obs, rewards, terms, truncs, info = self.env.step(actions.cpu().numpy())
        return self._obs(obs), torch.as_tensor(rewards), torch.as_tensor(terms), torch.as_tensor(truncs), info


def tiny_pi05():
    """A tiny PI0.5 (random weights, value head on the prefix) for the scripted env's 8x8 image and 4-dim state."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stand-in tokenizer, no norm statistics: expected for a random policy
        return Pi05Policy.from_config(
            Pi05Config.tiny(), action_dim=A, tokenizer="phyai-standin", camera_map={"image": "base_0_rgb"}, state_dim=4
        )


@pytest.mark.parametrize("variant", ["numpy", "numpy_groups", "torch", "pi05"])
def test_final_value_is_the_critic_on_final_obs_of_finished_envs_and_zero_elsewhere(variant):
    lengths = [(2, 5), (3,), (7, 1), (4, 4)]
    policy = tiny_pi05() if variant == "pi05" else CriticGaussian(A, action_horizon=8)
    atol = 1e-6 if variant == "pi05" else 0  # PI0.5: float sums of the wrapper's batch (finished rows only) differ
    if variant == "numpy_groups":
        env = [make_scripted_env(2, episode_lengths=lengths[:2]), make_scripted_env(2, episode_lengths=lengths[2:])]
    else:
        env = make_scripted_env(4, episode_lengths=lengths)
        env = TorchObservations(env) if variant == "torch" else env
    wrapper = PolicyVectorEnv(env, policy, action_chunk=C)
    wrapper.reset(seed=3)
    critic_batches, value = [], policy.value

    def recording_value(obs, **kwargs):
        critic_batches.append(len(obs["task"]))
        return value(obs, **kwargs)

    policy.value = recording_value  # the wrapper's calls only: the checks below call `value` directly
    finished = unfinished = 0
    for _ in range(5):
        obs, _, terms, truncs, info = wrapper.step()
        done = torch.as_tensor(terms | truncs)
        final_value = info["policy"]["final_value"]
        expected = value(info["final_obs"], env_ids=range(4))
        assert (expected.abs() > 1e-3).all()  # the critic is non-zero on every row
        reset_values = value(obs, env_ids=range(4))  # finished envs: the reset observation differs
        assert not torch.isclose(expected, reset_values, rtol=0, atol=1e-4)[done].any()
        torch.testing.assert_close(final_value[~done], torch.zeros(int((~done).sum())), rtol=0, atol=0)
        torch.testing.assert_close(final_value, torch.where(done, expected, 0.0), rtol=0, atol=atol)
        finished, unfinished = finished + int(done.sum()), unfinished + int((~done).sum())
    assert finished >= 4 and unfinished >= 4
    assert critic_batches and set(critic_batches) <= {1, 2, 4}  # padded to powers of two: few batch shapes
    wrapper.close()


# ---------------------------------------------------------------------------------------------- batch sizes
class DeclaringGaussian(GaussianPolicy):
    """Records what `declare_batch_sizes` (policies.base.BatchSizePolicy) was told, and the batch sizes of `act`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.declared, self.acted = [], set()

    def declare_batch_sizes(self, sizes):
        self.declared.append(tuple(sizes))

    def act(self, obs, **kwargs):
        self.acted.add(len(obs["task"]))
        return super().act(obs, **kwargs)


@pytest.mark.parametrize("sizes", [(4,), (2, 2), (3, 1)], ids=["G1", "G2", "G2_uneven"])
def test_wrapper_declares_the_batch_sizes_it_calls(sizes):
    policy = DeclaringGaussian(A, action_horizon=8)
    envs = [make_scripted_env(n, episode_lengths=[(3,)] * n) for n in sizes]
    wrapper = PolicyVectorEnv(envs if len(envs) > 1 else envs[0], policy, action_chunk=C)
    assert policy.declared == [tuple(sorted(set(sizes)))]  # once, at construction, before any call
    wrapper.reset(seed=0)
    for _ in range(3):
        wrapper.step()
    assert policy.acted == set(sizes)
    wrapper.close()
    with pytest.raises(ValueError, match="action_chunk"):  # a refused construction declares nothing
        PolicyVectorEnv(make_scripted_env(2), policy, action_chunk=9)
    assert len(policy.declared) == 1


def test_stream_seeds_set_the_noise_apart_from_the_env_seeds():
    """GRPO's groups: envs reset to one state (equal env seeds) draw the noise of their own stream seeds; a bad
    stream_seeds option is refused before anything is reset."""
    wrappers = [PolicyVectorEnv(make_scripted_env(4), GaussianPolicy(A, action_horizon=C), action_chunk=C)
                for _ in range(2)]  # fmt: skip
    for wrapper in wrappers:
        obs, _ = wrapper.reset(seed=[5, 5, 5, 5], options={"stream_seeds": [1, 2, 1, 3]})
        assert all(np.array_equal(obs["state"][0], row) for row in obs["state"])  # one state
        wrapper.step()
    actions = wrappers[0].last_output.actions
    assert torch.equal(actions[0], actions[2]) and not torch.equal(actions[0], actions[1])
    assert not torch.equal(actions[1], actions[3])
    refused = wrappers[0]
    with pytest.raises(ValueError, match=r"stream_seeds.*one seed per env \(4\).*got 3"):
        refused.reset(seed=0, options={"stream_seeds": [1, 2, 3]})
    with pytest.raises(ValueError, match="without a reset_mask"):
        refused.reset(options={"stream_seeds": [1, 2, 3, 4], "reset_mask": np.array([True, False, True, False])})
    (obs_a, *_), (obs_b, *_) = (w.step() for w in wrappers)  # the refusals changed nothing
    np.testing.assert_array_equal(obs_a["state"], obs_b["state"])
    assert torch.equal(wrappers[0].last_output.actions, wrappers[1].last_output.actions)
    for wrapper in wrappers:
        wrapper.close()
