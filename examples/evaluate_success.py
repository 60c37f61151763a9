"""Success rates of a policy with a fixed, resumable episode plan, without the CLI.

python examples/evaluate_success.py                       # tiny random PI0.5 on the target task
python examples/evaluate_success.py --checkpoint DIR --preset openpi_pi05_libero --env libero_spatial
"""

from __future__ import annotations

import argparse
import functools
import sys

from tqdm import tqdm

from phyai_gym import PolicyVectorEnv, evaluate_success, make_env, make_policy
from phyai_gym.cli import written_files
from phyai_gym.evaluation import format_table
from phyai_gym.make import resolve_env
from phyai_gym.protocols import protocol_for_preset
from phyai_gym.run import episode_limit
from phyai_gym.threads import configure_threads

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--env", default="target")
parser.add_argument("--checkpoint", default=None)
parser.add_argument("--preset", default=None)
parser.add_argument("--episodes", type=int, default=16, help="episodes per task")
parser.add_argument("--num-envs", type=int, default=4)
parser.add_argument("--out", default=None, help="folder for episodes.jsonl / results.csv / success.png (resumable)")
parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 for the tiny policy)")
args = parser.parse_args()
print(configure_threads(args.threads, device="cpu", small_model=args.checkpoint is None))

env = make_env(args.env, num_envs=args.num_envs)
if args.checkpoint is None:  # random tiny PI0.5 with the stand-in tokenizer: a smoke test, ~50 % on "target"
    policy = make_policy(action_dim=env.single_action_space.shape[0], prompt_format="state")
else:
    policy = make_policy(args.checkpoint, preset=args.preset)
envs = PolicyVectorEnv(env, policy, action_chunk=1 if args.env == "target" else None, deterministic=True)

libero = args.env.startswith("libero_")  # LIBERO: episodes use the suite's fixed initial states
protocol = protocol_for_preset(args.preset, resolve_env(args.env).kind)  # named in the header and the table
header = {"env": args.env, "protocol": protocol.name, "checkpoint": args.checkpoint}
bar = functools.partial(tqdm, desc="eval", file=sys.stderr)  # env steps with an ETA; a resume starts at N
result = evaluate_success(
    envs, args.episodes, header=header, out_dir=args.out, seed=0, primary_metric=protocol.primary_metric,
    init_state_option=libero, progress=bar, episode_limit=episode_limit(env),  # sizes the bar in env steps
)  # fmt: skip
envs.close()
print(format_table(result))
overall = result.overall
ci = f"95% CI {overall.ci_low:.3f}-{overall.ci_high:.3f}"
print(f"overall success {overall.success_rate:.3f} ({ci}), {overall.episodes} episodes")
print(written_files(result))
