"""Quickstart: a tiny PI0.5 acting in a vector env through PolicyVectorEnv, without the CLI.

python examples/quickstart.py            # offline: random weights, locally built stand-in tokenizer
"""

from __future__ import annotations

import argparse

import numpy as np

from phyai_gym import PolicyVectorEnv, make_env, make_policy
from phyai_gym.threads import configure_threads

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--env", default="target", help="any make_env name: 'target', 'Pusher-v5', 'libero_spatial'")
parser.add_argument("--steps", type=int, default=3, help="wrapper steps (policy calls) to run")
parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 for the tiny policy)")
args = parser.parse_args()  # --help prints this and exits before anything is built
print(configure_threads(args.threads, device="cpu", small_model=True))  # 1 thread: tiny models are latency-bound

# 1. A vector env with canonical observations (images, state, task); "Pusher-v5" or "libero_spatial" work too.
env = make_env(args.env, num_envs=4)

# 2. A PI0.5 policy: here tiny() with random weights (seed 0); make_policy("ckpt/", preset=...) loads one.
policy = make_policy(action_dim=env.single_action_space.shape[0], prompt_format="state")

# 3. The wrapper: one step() = one action chunk of C env steps, chosen by the policy.
envs = PolicyVectorEnv(env, policy, action_chunk=1)
obs, _ = envs.reset(seed=0)
for step in range(args.steps):
    obs, reward, terminated, truncated, info = envs.step()  # step(None): the policy acts
    out = info["policy"]  # (N, ...) tensors of the call that chose these actions
    print(
        f"step {step}: reward {np.round(reward, 3).tolist()} log-prob {np.round(out['log_prob'].numpy(), 2)} "
        f"value {np.round(out['values'].numpy(), 3)} success {info.get('success', np.zeros(4, bool)).tolist()}"
    )

# 4. Weight sync: load new trainable weights into the running policy in place (a PPO trainer does this).
report = envs.sync_weights(policy.model)
print(f"weight version after sync: {report.version}")
envs.close()
