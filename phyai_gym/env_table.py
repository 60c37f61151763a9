"""The README's table of what `make_env` returns per simulator, generated from the adapters themselves.

Every row is read off a built env (``make_env(name, num_envs=1)``): its simulator, cameras (name H x W),
state and action dims and episode limit, so the table cannot drift from the code. Rows of simulators that are
not installed are kept from the README as they are (and say so with ``--check``).

    python -m phyai_gym.env_table               # print the table
    python -m phyai_gym.env_table --check       # exit 1 when README.md's table differs from the adapters
    python -m phyai_gym.env_table --write       # rewrite the table in README.md (between its markers)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

ENVS: tuple[str, ...] = (
    "scripted",
    "target",
    "Pusher-v5",
    "libero_spatial",
    "libero_object",
    "libero_goal",
    "libero_10",
    "libero_90",
    "PickCube-v1",
    "PushCube-v1",
    "StackCube-v1",
    "mjwarp_pick_cube",
    "mjwarp_push_cube",
    "mjwarp_push_cube_state",
)
"""The names the table lists (every Gymnasium MuJoCo id and ManiSkill3 task id works the same way)."""
START, END = "<!-- env-table:start (python -m phyai_gym.env_table --write) -->", "<!-- env-table:end -->"
"""The README markers around the generated table."""
HEADER = (
    "| name | simulator | cameras (H x W) | state dims | action dims | episode limit (env steps) |\n"
    "|---|---|---|---|---|---|"
)
README = Path(__file__).resolve().parents[1] / "README.md"
_SIMULATORS = {
    "scripted": "none (test env)",
    "target": "none (test env)",
    "mujoco": "MuJoCo (Gymnasium)",
    "libero": "LIBERO (robosuite)",
    "maniskill": "ManiSkill3 (SAPIEN)",
    "mujoco_warp": "MuJoCo Warp (GPU-batched)",
}


def env_row(name: str) -> str:
    """The table row of env `name`, read off ``make_env(name, num_envs=1)``.

    Raises:
        ImportError: the env's simulator is not installed.

    Example:
        >>> env_row("target")
        '| `target` | none (test env) | image 32x32 | 2 | 1 | 1 |'
    """
    from phyai_gym.make import make_env, resolve_env
    from phyai_gym.run import episode_limit

    env = make_env(name, num_envs=1)
    try:
        space = env.single_observation_space
        cameras = ", ".join(f"{cam} {s.shape[0]}x{s.shape[1]}" for cam, s in space["images"].spaces.items())
        limit = episode_limit(env)
        if limit is None and resolve_env(name).kind == "scripted":
            limit = f"scripted ({', '.join(map(str, env.get_attr('episode_lengths')[0]))})"
        return (
            f"| `{name}` | {_SIMULATORS[resolve_env(name).kind]} | {cameras} | {space['state'].shape[0]} | "
            f"{env.single_action_space.shape[0]} | {limit if limit is not None else 'none'} |"
        )
    finally:
        env.close()


def readme_rows(text: str) -> dict[str, str]:
    """Env name -> row of the table between the markers of a README text ({} without markers)."""
    if START not in text or END not in text:
        return {}
    block = text.split(START, 1)[1].split(END, 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    return {row.split("`")[1]: row for row in rows}


def table(readme_text: str = "", names: Sequence[str] = ENVS) -> tuple[str, list[str]]:
    """(the table, names whose simulator is missing and whose README row was kept as is)."""
    old = readme_rows(readme_text)
    rows, missing = [], []
    for name in names:
        try:
            rows.append(env_row(name))
        except ImportError:
            missing.append(name)
            if name in old:
                rows.append(old[name])
    return "\n".join([HEADER, *rows]), missing


def main(argv: Sequence[str] | None = None) -> int:
    """Prints, checks or writes the README's env table."""
    parser = argparse.ArgumentParser(description="The README's make_env table, generated from the adapters.")
    parser.add_argument("--readme", default=str(README), help="the README holding the markers")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="exit 1 when the README's table differs")
    group.add_argument("--write", action="store_true", help="rewrite the README's table between the markers")
    args = parser.parse_args(argv)
    path = Path(args.readme)
    text = path.read_text(encoding="utf-8")
    generated, missing = table(text)
    if missing:
        print(f"not installed, README rows kept as they are: {', '.join(missing)}")
    if not (args.check or args.write):
        print(generated)
        return 0
    if START not in text or END not in text:
        print(f"{path}: no table markers; add the lines\n{START}\n{END}")
        return 1
    before, rest = text.split(START, 1)
    current, after = rest.split(END, 1)
    if args.check:
        same = current.strip() == generated.strip()
        state = "up to date" if same else "stale: run python -m phyai_gym.env_table --write"
        print(f"{path}: the env table is {state}")
        return 0 if same else 1
    path.write_text(f"{before}{START}\n{generated}\n{END}{after}", encoding="utf-8")
    print(f"wrote the env table to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
