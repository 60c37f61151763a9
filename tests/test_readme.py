"""Every command README.md shows either runs here as written (on CPU, from a fresh checkout) or is listed with the
reason it cannot: a new README command fails `test_every_readme_command_is_accounted_for` until it is added below.

Commands run in a temporary folder (relative ``--out`` paths land there) with this checkout first on the path;
``phyai-gym`` runs as ``python -m phyai_gym.cli``, since the console script may belong to another install.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PROGRAMS = {"phyai-gym", "python", "python3", "pip", "bash", "torchrun", "export", "apt-get", "source", "."}

FAST = {  # seconds each on a busy 2-core machine
    "phyai-gym --help",
    "phyai-gym eval --env target --policy tiny --episodes 20 --out runs/target",
}
SLOW = {  # tens of seconds each: Pusher renders 224x224 images
    "phyai-gym run",
    "phyai-gym eval --env Pusher-v5 --policy tiny --episodes 4 --num-envs 2 --out runs/demo",
}
NETWORK = "installs packages (needs a package index and changes the environment)"
GPU = "needs a CUDA GPU"
CHECKPOINT = "needs a PI0.5 checkpoint (DIR) and LIBERO"
SUITE = "runs the whole test suite (about 30 min on 2 cores); this test is part of it"
PPO_RUN = "a PPO run of minutes; tests/examples/test_ppo_checkpoint.py runs the same flags for fewer iterations"
SFT_RUN = ("SFT of about 10 min on a CPU core (and its checkpoint); tests/examples/test_sft.py runs the script, "
           "benchmarks/real_task_rl.py the sequence")
SKIPPED = {
    "python examples/sft_pi05.py --env mjwarp_push_cube_state --record-episodes 64 --demos demos/push.h5 "
    "--image-size 64 --cameras image --trainable all --steps 1500 --action-chunk 5 --out sft_push --eval-episodes 0":
        SFT_RUN,
    "phyai-gym eval --env mjwarp_push_cube_state --checkpoint sft_push --episodes 48 --num-envs 16 --image-size 64 "
    "--action-chunk 5 --out runs/eval_sft": SFT_RUN,
    "python examples/ppo_pi05.py --env mjwarp_push_cube_state --checkpoint sft_push --run-dir runs/push "
    "--image-size 64 --cameras image --action-chunk 5 --num-envs 32 --num-steps 10 --total-iterations 12 "
    "--learning-rate 3e-5 --value-lr 3e-3 --noise-level 0.5 --reward-mode sparse --save-every 4 --eval-episodes 0":
        PPO_RUN,
    "python examples/ppo_pi05.py --resume runs/push --total-iterations 24": PPO_RUN,
    "python -m benchmarks.real_task_rl --device cuda --policy-config small --demos 128 --num-envs 256 --group-size 8 "
    "--learning-rate 5e-5 --ppo-iterations 250 --save-every 5 --eval-episodes 256 --eval-envs 128 --work-dir runs/rt":
        GPU,
    "phyai-gym eval --env mjwarp_push_cube_state --checkpoint runs/push --episodes 48 --num-envs 16 --image-size 64 "
    "--action-chunk 5 --out runs/eval_ppo": PPO_RUN,
    'pip install torch==2.13.0 && pip install -e ".[sim]" && phyai-gym run': f"{NETWORK}; `phyai-gym run` runs here",
    'pip install torch==2.13.0 && pip install -e ".[test,sim,warp]" && bash .ci/install_sims.sh && '
    ". ~/.cache/phyai-gym/sim_env.sh && python3 -m pytest -q": f"{NETWORK}; then {SUITE}",
    "pip install torch==2.13.0": NETWORK,
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": NETWORK,
    "pip install ./torch-2.13.0+cpu-*.whl": f"{NETWORK} (a downloaded wheel)",
    'pip install -e ".[sim]"': NETWORK,
    'pip install -e ".[libero]"': NETWORK,
    'pip install -e ".[maniskill]"': NETWORK,
    'pip install -e ".[warp]"': NETWORK,
    'pip install --no-index --find-links wheelhouse "phyai-gym[warp]"': "needs a copied wheelhouse",
    'pip install --no-index --find-links wheelhouse "phyai-gym[maniskill]"': "needs a copied wheelhouse",
    "bash .ci/install_sims.sh": f"{NETWORK}; runs as root (apt-get)",
    "apt-get install libosmesa6": f"{NETWORK}; runs as root",
    "source ~/.cache/phyai-gym/sim_env.sh": "exists only after .ci/install_sims.sh; changes the calling shell",
    "export MUJOCO_GL=egl": "sets a variable of the calling shell",
    "phyai-gym run --checkpoint DIR --preset openpi_pi05_libero --env libero_spatial": CHECKPOINT,
    "phyai-gym eval --env libero_spatial --checkpoint DIR --preset openpi_pi05_libero --episodes 10 --num-envs 8 "
    "--out runs/eval": CHECKPOINT,
    "torchrun --nproc_per_node G examples/ppo_pi05.py --config base --device cuda --num-envs 32": GPU,
    "torchrun --nnodes 2 --nproc_per_node G --node_rank R --rdzv_backend c10d --rdzv_endpoint HOST0:29500 "
    "examples/ppo_pi05.py --config base --device cuda --num-envs 32": f"{GPU}s on two nodes",
    "torchrun --nproc_per_node 2 examples/ppo_pi05.py --num-envs 16": (
        "minutes of PPO on CPU; tests/examples/test_ppo_distributed.py runs the same script under 2 gloo ranks"
    ),
    "torchrun --nproc_per_node 3 examples/ppo_disaggregated.py": (
        "minutes of PPO on CPU; tests/examples/test_ppo_disaggregated.py runs the same script under 3 gloo ranks"
    ),
    "torchrun --nproc_per_node 8 examples/ppo_disaggregated.py --device cuda": f"{GPU}s (8)",
    "torchrun --nnodes 2 --nproc_per_node 8 --node_rank 0 --rdzv_backend c10d --rdzv_endpoint HOST:29500 "
    "examples/ppo_disaggregated.py --device cuda --trainer-ranks 2": f"{GPU}s on two nodes",
    "python -m benchmarks.gpu_suite --out DIR": GPU,
    "python -m benchmarks.soak_gpu": GPU,
    "python -m benchmarks.soak_cpu": "10,000 policy steps by design (minutes); a measurement, not a test",
    "python benchmarks/ppo_curves.py": "3 full PPO runs (minutes), a measurement rather than a test",
    "python -m phyai_gym.train.curves CSV": (
        "CSV is a placeholder; tests/phyai_gym/train/test_curves.py re-plots a curve"
    ),
    "bash .ci/run": f"{SUITE}, plus ruff",
    "python3 -m pytest -q": SUITE,
}
NAMES = {"phyai-gym", "phyai-gym eval", "apt-get install", "pip"}  # inline mentions in prose, not commands


def readme_commands(text: str) -> list[str]:
    """Every command of `text`: the lines of its ``bash`` blocks (comments cut, continuations joined) and inline
    code that starts with a program name."""
    commands: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for code in re.findall(r"`([^`\n]+)`", prose):
        if code.split()[0] in PROGRAMS and code not in commands:
            commands.append(code)
    return commands


def test_every_readme_command_is_accounted_for():
    commands = set(readme_commands(README.read_text(encoding="utf-8")))
    accounted = FAST | SLOW | set(SKIPPED) | NAMES
    assert commands - accounted == set(), "new README commands: add each to FAST, SLOW or SKIPPED (with a reason)"
    assert accounted - commands == set(), "commands no longer in the README: remove them here"


def _run(command: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    if argv[0] == "phyai-gym":
        argv = [sys.executable, "-m", "phyai_gym.cli", *argv[1:]]
    elif argv[0] in ("python", "python3"):
        argv = [sys.executable, *argv[1:]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("command", sorted(FAST))
def test_fast_readme_command_runs_as_written(command, tmp_path):
    _check(_run(command, tmp_path, timeout=600))


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(SLOW))
def test_slow_readme_command_runs_as_written(command, tmp_path):
    proc = _run(command, tmp_path, timeout=1800)
    _check(proc)
    if command == "phyai-gym run":  # and its next: line suggests an eval that runs as written
        suggested = proc.stdout.rstrip().splitlines()[-1].split("`")[1]
        assert suggested.startswith("phyai-gym eval --env Pusher-v5 ")


@pytest.mark.slow
def test_readme_library_snippet_runs(tmp_path):
    (block,) = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    script = tmp_path / "snippet.py"
    script.write_text(block + "envs.close()\n")
    _check(_run(f"python {script}", tmp_path, timeout=1800))


def test_readme_opens_with_its_title_a_paragraph_and_the_two_commands():
    text = README.read_text(encoding="utf-8")
    title, paragraph, block = text.split("\n\n", 3)[:3]
    assert title == "# phyai-gym" and not paragraph.startswith(("#", "`")) and block.startswith("```bash")
    assert len(block.split("```bash\n")[1].split("```")[0].strip().splitlines()) == 2
    assert "docs/architecture.md" in text and (ROOT / "docs/architecture.md").is_file()


def test_readme_keeps_commit_ids_in_the_benchmark_rows():
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", README.read_text(encoding="utf-8")) if re.search("[a-f]", w)
              and re.search("[0-9]", w)]  # fmt: skip
    assert len(hashes) <= 5, hashes


def test_architecture_defines_every_contract():
    text = (ROOT / "docs/architecture.md").read_text(encoding="utf-8")
    for k in range(1, 10):
        assert re.search(rf"^\*\*C{k} [A-Z]", text, flags=re.M), f"C{k} is not defined"
