"""Checkpoints of a training run that outlive it: the policy in the LeRobot layout, the state to resume from.

A run folder (``--run-dir``) keeps LeRobot's training-checkpoint layout (``lerobot/common/utils/train_utils.py``)::

    RUN/checkpoints/000004/pretrained_model/   config.json, model.safetensors, processor_config.json,
                                               policy_config.json: what `make_policy(folder)` and
                                               `phyai-gym eval --checkpoint folder` load unchanged
    RUN/checkpoints/000004/training_state/     master_weights.safetensors (float32, by parameter name),
                                               optimizer_state.safetensors + optimizer_param_groups.json,
                                               rng_state.safetensors (torch) + rng_state.json (python, numpy),
                                               training_step.json (iteration and the loop's counters)
    RUN/checkpoints/last -> 000004             the newest complete checkpoint

Nothing is pickled: tensors go to safetensors, the rest to JSON, so loading a checkpoint runs no code. A checkpoint
is written to ``<name>.tmp`` and renamed when complete, and ``last`` moves after that: a run killed while saving
leaves the previous checkpoint as ``last``.

Example:
    >>> import tempfile, torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.Adam(model.parameters(), lr=0.1)
    >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> state = TrainingState(list(model.named_parameters()), opt)
    >>> run = Path(tempfile.mkdtemp())
    >>> folder = state.save(run, 1, {"global_step": 8})
    >>> folder.name, latest_checkpoint(run) == folder
    ('000001', True)
    >>> TrainingState(list(model.named_parameters()), opt).load(folder)["global_step"]
    8
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

CHECKPOINTS, LAST = "checkpoints", "last"
PRETRAINED, TRAINING_STATE = "pretrained_model", "training_state"


def checkpoint_dir(run_dir: str | Path, iteration: int) -> Path:
    """``RUN/checkpoints/<iteration, 6 digits>``."""
    return Path(run_dir) / CHECKPOINTS / f"{iteration:06d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``last`` points to (None: the run has none yet)."""
    last = Path(run_dir) / CHECKPOINTS / LAST
    return last.resolve() if last.exists() else None


class TrainingState:
    """What a resumed run needs besides the policy: float32 master weights, the optimizer and the RNG streams.

    Args:
        masters: (name, float32 tensor) pairs the optimizer steps, by parameter name (the masters of
            `phyai_gym.train.master_weights.MasterWeights`, named after the model's trainable parameters).
        optimizer: the optimizer over exactly those tensors.
    """

    def __init__(self, masters: Sequence[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer) -> None:
        self.masters = list(masters)
        self.optimizer = optimizer

    def save(
        self,
        run_dir: str | Path,
        iteration: int,
        counters: dict[str, Any],
        write_policy: Callable[[Path], Any] | None = None,
        keep: int = 0,
    ) -> Path:
        """Write checkpoint `iteration` (``write_policy(folder)`` writes ``pretrained_model``); moves ``last``.

        `keep` > 0 then deletes all but the newest `keep` checkpoints (a base-config checkpoint is about 12 GB:
        bf16 weights, float32 masters and Adam's two moments).
        """
        final = checkpoint_dir(run_dir, iteration)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if write_policy is not None:
            write_policy(tmp / PRETRAINED)
        state = tmp / TRAINING_STATE
        state.mkdir(parents=True)
        save_file({name: t.detach().to("cpu").contiguous() for name, t in self.masters},
                  str(state / "master_weights.safetensors"))  # fmt: skip
        opt = self.optimizer.state_dict()
        tensors = {f"{index}.{key}": torch.as_tensor(value).detach().to("cpu").contiguous()
                   for index, entry in opt["state"].items() for key, value in entry.items()}  # fmt: skip
        save_file(tensors, str(state / "optimizer_state.safetensors"))
        (state / "optimizer_param_groups.json").write_text(json.dumps(opt["param_groups"], indent=2) + "\n")
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_file(rng, str(state / "rng_state.safetensors"))
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        py_version, py_state, py_gauss = random.getstate()
        (state / "rng_state.json").write_text(json.dumps({
            "python": [py_version, list(py_state), py_gauss],
            "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        }) + "\n")  # fmt: skip
        (state / "training_step.json").write_text(json.dumps({"iteration": iteration, **counters}, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        link = final.parent / LAST
        tmp_link = final.parent / (LAST + ".tmp")
        tmp_link.unlink(missing_ok=True)
        tmp_link.symlink_to(final.name)
        os.replace(tmp_link, link)
        if keep > 0:
            done = sorted(d for d in final.parent.iterdir() if d.name.isdigit() and d.is_dir())
            for old in done[:-keep]:
                shutil.rmtree(old)
        return final

    def load(self, folder: str | Path) -> dict[str, Any]:
        """Restore masters (in place), optimizer and RNG streams from `folder`; returns training_step.json."""
        state = Path(folder) / TRAINING_STATE
        if not (state / "training_step.json").is_file():
            raise FileNotFoundError(
                f"resume: {str(folder)!r} is no complete checkpoint (no {TRAINING_STATE}/training_step.json). Fix: "
                f"pass the run folder that holds {CHECKPOINTS}/{LAST}, written by --run-dir."
            )
        saved = load_file(str(state / "master_weights.safetensors"))
        names = [name for name, _ in self.masters]
        if sorted(saved) != sorted(names):
            missing, extra = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
            raise ValueError(
                f"resume: the checkpoint's master weights do not match the trainable parameters (missing "
                f"{missing[:4]}, unexpected {extra[:4]}). Fix: resume with the run's own flags (--trainable, "
                "--config, --checkpoint), which --resume reads from args.json."
            )
        with torch.no_grad():
            for name, tensor in self.masters:
                tensor.copy_(saved[name])
        tensors = load_file(str(state / "optimizer_state.safetensors"))
        device = self.masters[0][1].device if self.masters else torch.device("cpu")
        opt_state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            index, name = key.split(".", 1)
            opt_state.setdefault(int(index), {})[name] = value if name == "step" else value.to(device)
        groups = json.loads((state / "optimizer_param_groups.json").read_text())
        self.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
        rng = load_file(str(state / "rng_state.safetensors"))
        torch.set_rng_state(rng["torch"])
        cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
        host = json.loads((state / "rng_state.json").read_text())
        version, py_state, gauss = host["python"]
        random.setstate((version, tuple(py_state), gauss))
        kind, keys, pos, has_gauss, cached = host["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        return json.loads((state / "training_step.json").read_text())
