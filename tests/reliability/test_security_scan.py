"""Security: the project never unpickles a file or a network payload, never evaluates text as code, and never
hands config-derived strings to a shell.

Weights and statistics come from safetensors/JSON; LIBERO initial states from ``numpy.load(allow_pickle=False)``
or ``torch.load(weights_only=True)``; cross-GPU weight sync uses tensor collectives only (object collectives
pickle). The one documented exception is gymnasium's AsyncVectorEnv, which pickles env *factories* (our own
functions) with cloudpickle to start its workers -- cloudpickle is imported by gymnasium, never by us.

`scan_source` is an AST scan (not a text search), so ``policy.evaluate(...)``, ``model.eval()`` and the CLI
subcommand string ``"eval"`` are not findings. The scanner is tested on planted violations first.
"""

from __future__ import annotations

import ast
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("phyai_gym", "policies", "wrappers", "benchmarks", "examples")

PICKLE_MODULES = frozenset({"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib",
                            "jsonpickle"})  # fmt: skip
CODE_BUILTINS = frozenset({"eval", "exec", "compile", "__import__"})
OBJECT_COLLECTIVES = frozenset({"broadcast_object_list", "all_gather_object", "scatter_object_list", "gather_object",
                                "send_object_list", "recv_object_list"})  # fmt: skip
SUBPROCESS_CALLS = frozenset({"run", "call", "check_call", "check_output", "Popen", "getoutput", "getstatusoutput"})
OS_SHELL = frozenset({"system", "popen", "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp",
                      "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
                      "spawnvpe", "posix_spawn", "posix_spawnp", "startfile"})  # fmt: skip


@dataclass(frozen=True)
class Finding:
    """One violation: where and what."""

    path: str
    line: int
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.detail}"


def _dotted(node: ast.AST) -> str | None:
    """'a.b.c' for Name/Attribute chains, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str, tree: ast.Module) -> None:
        self.path = path
        self.findings: list[Finding] = []
        self.aliases: dict[str, str] = {}  # local name -> fully qualified ("th" -> "torch", "load" -> "torch.load")
        self.literal_argv: set[str] = set()  # names assigned a list/tuple of constant strings / sys.executable
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and self._safe_argv(node.value):
                self.literal_argv.update(t.id for t in node.targets if isinstance(t, ast.Name))

    def add(self, node: ast.AST, rule: str, detail: str) -> None:
        self.findings.append(Finding(self.path, getattr(node, "lineno", 0), rule, detail))

    def qualified(self, node: ast.AST) -> str | None:
        name = _dotted(node)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        base = self.aliases.get(head, head)
        return f"{base}.{rest}" if rest else base

    def _safe_argv(self, node: ast.expr) -> bool:
        if not isinstance(node, ast.List | ast.Tuple):
            return False
        return all(
            (isinstance(e, ast.Constant) and isinstance(e.value, str)) or _dotted(e) == "sys.executable"
            for e in node.elts
        )

    # imports
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            root = alias.name.split(".")[0]
            if root in PICKLE_MODULES:
                self.add(node, "pickle-import", f"import {alias.name}")
            self.aliases[alias.asname or root] = alias.name if alias.asname else root
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if module.split(".")[0] in PICKLE_MODULES:
            self.add(node, "pickle-import", f"from {module} import ...")
        for alias in node.names:
            if alias.name in OBJECT_COLLECTIVES:
                self.add(node, "object-collective", f"from {module} import {alias.name}")
            if alias.name in PICKLE_MODULES:
                self.add(node, "pickle-import", f"from {module} import {alias.name}")
            self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}" if module else alias.name
        self.generic_visit(node)

    # references to object collectives, even when not called (e.g. passed as a function)
    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in OBJECT_COLLECTIVES:
            self.add(node, "object-collective", f"{_dotted(node) or node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = self.qualified(func) or ""
        short = name.rsplit(".", 1)[-1]
        if isinstance(func, ast.Name) and func.id in CODE_BUILTINS and func.id not in self.aliases:
            self.add(node, "code-eval", f"{func.id}(...)")
        if isinstance(func, ast.Name) and func.id in OBJECT_COLLECTIVES:
            self.add(node, "object-collective", f"{func.id}(...)")
        if name == "torch.load" and not _is_const(_kw(node, "weights_only"), True):
            self.add(node, "torch-load", "torch.load without weights_only=True")
        if name in ("numpy.load", "np.load") and _kw(node, "allow_pickle") is not None and not _is_const(
            _kw(node, "allow_pickle"), False
        ):
            self.add(node, "numpy-pickle", "numpy.load with allow_pickle not False")
        if name in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all"):
            self.add(node, "yaml-load", name)
        if name in ("yaml.load", "yaml.load_all"):
            loader = _dotted(_kw(node, "Loader") or ast.Constant(None)) or ""
            if not loader.endswith(("SafeLoader", "CSafeLoader")):
                self.add(node, "yaml-load", f"{name} without Loader=SafeLoader")
        if name.startswith("os.") and short in OS_SHELL:
            self.add(node, "shell", f"{name}(...)")
        if name.startswith("subprocess.") and short in SUBPROCESS_CALLS:
            if _is_const(_kw(node, "shell"), True) or (_kw(node, "shell") is not None
                                                       and not _is_const(_kw(node, "shell"), False)):  # fmt: skip
                self.add(node, "shell", f"{name}(..., shell=...)")
            argv = node.args[0] if node.args else _kw(node, "args")
            safe = argv is not None and (
                self._safe_argv(argv) or (isinstance(argv, ast.Name) and argv.id in self.literal_argv)
            )
            if not safe:
                self.add(node, "subprocess-argv", f"{name} with a non-literal command (must be constant strings)")
        self.generic_visit(node)


def scan_source(source: str, path: str = "<string>") -> list[Finding]:
    """Findings of one Python source text."""
    tree = ast.parse(source, filename=path)
    scanner = _Scanner(path, tree)
    scanner.visit(tree)
    return scanner.findings


def scan_tree(root: Path, folders: tuple[str, ...] = SCANNED) -> list[Finding]:
    """Findings of every .py file under `root`/`folders` (result files and caches skipped)."""
    findings = []
    for folder in folders:
        for file in sorted((root / folder).rglob("*.py")):
            if "__pycache__" in file.parts:
                continue
            findings += scan_source(file.read_text(encoding="utf-8"), str(file.relative_to(root)))
    return findings


# ------------------------------------------------------------------------------------------ scanner self-test
PLANTED = {
    "import pickle": "pickle-import",
    "import cloudpickle as cp": "pickle-import",
    "from dill import loads": "pickle-import",
    "from pickle import loads as l": "pickle-import",
    "import _pickle": "pickle-import",
    "eval('1 + 1')": "code-eval",
    "exec(open(cfg).read())": "code-eval",
    "compile(src, 'f', 'exec')": "code-eval",
    "import torch\ntorch.load(path)": "torch-load",
    "import torch\ntorch.load(path, weights_only=False)": "torch-load",
    "import torch as th\nth.load(path, map_location='cpu')": "torch-load",
    "from torch import load\nload(path)": "torch-load",
    "import numpy as np\nnp.load(path, allow_pickle=True)": "numpy-pickle",
    "import torch.distributed as dist\ndist.broadcast_object_list(objs, src=0)": "object-collective",
    "import torch.distributed as dist\ndist.all_gather_object(out, obj)": "object-collective",
    "from torch.distributed import scatter_object_list": "object-collective",
    "import torch.distributed as dist\nfn = dist.gather_object": "object-collective",
    "import torch.distributed as dist\ndist.send_object_list([x], dst=1)": "object-collective",
    "import os\nos.system(cfg.command)": "shell",
    "import os\nos.popen('ls ' + path)": "shell",
    "import subprocess\nsubprocess.run(cfg.cmd, shell=True)": "shell",
    "import subprocess\nsubprocess.run(['sh', '-c', cfg.path])": "subprocess-argv",
    "import subprocess\nsubprocess.check_output(command)": "subprocess-argv",
    "import yaml\nyaml.load(text)": "yaml-load",
    "import yaml\nyaml.unsafe_load(text)": "yaml-load",
}

ALLOWED = """
import json, subprocess, sys, torch
import numpy as np
import yaml
policy.evaluate(batch)
model.eval()
parser.add_parser("eval", help="success rates")
args.command == "eval"
self.evaluate = None
x = torch.load(path, map_location="cpu", weights_only=True)
states = np.load(path, allow_pickle=False)
arr = np.load(path)
cfg = json.loads(text)
data = yaml.load(text, Loader=yaml.SafeLoader)
subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True)
cmd = [sys.executable, "-m", "pytest", "-q"]
subprocess.run(cmd, cwd=root)
re.compile("x+")
torch.compile(model)
dist.broadcast(tensor, src=0)
dist.all_reduce(flag)
"""


@pytest.mark.parametrize("source", list(PLANTED), ids=[f"{i:02d}_{v}" for i, v in enumerate(PLANTED.values())])
def test_scanner_flags_planted_violation(source: str) -> None:
    rules = {f.rule for f in scan_source(source)}
    assert PLANTED[source] in rules, (source, rules)


def test_scanner_allows_safe_patterns() -> None:
    assert scan_source(ALLOWED) == []


def test_scanner_fails_on_a_planted_file(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "ok.py").write_text("def f(policy, batch):\n    return policy.evaluate(batch)\n")
    assert scan_tree(tmp_path, ("pkg",)) == []
    (tmp_path / "pkg" / "bad.py").write_text("import torch\n\ndef load(p):\n    return torch.load(p)\n")
    findings = scan_tree(tmp_path, ("pkg",))
    assert [str(f) for f in findings] == ["pkg/bad.py:4: [torch-load] torch.load without weights_only=True"]


# --------------------------------------------------------------------------------------------- the project
def test_project_has_no_unsafe_deserialisation_or_code_execution() -> None:
    present = [folder for folder in SCANNED if (ROOT / folder).is_dir()]
    assert {"phyai_gym", "policies", "wrappers", "benchmarks"} <= set(present)
    findings = scan_tree(ROOT, tuple(present))
    assert not findings, "\n".join(map(str, findings))


def test_async_vector_env_is_the_only_pickling_and_it_is_gymnasiums() -> None:
    """cloudpickle (for AsyncVectorEnv's env factories) is imported by gymnasium, not by the project."""
    import gymnasium.vector.async_vector_env as avec

    source = Path(avec.__file__).read_text()
    assert "CloudpickleWrapper" in source  # the documented exception lives in gymnasium
    ours = [f for f in scan_tree(ROOT, tuple(d for d in SCANNED if (ROOT / d).is_dir())) if f.rule == "pickle-import"]
    assert ours == []


# ---------------------------------------------------------------------------------- behaviour on hostile files
class _Payload:
    """Unpickling it creates `marker` (a directory): proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.mkdir, (str(self.marker),)


def _checkpoint_folder(root: Path, weights_name: str, payload: bytes) -> Path:
    from policies.pi05.config import Pi05Config

    root.mkdir(parents=True)
    Pi05Config.tiny().save(root / "config.json")
    (root / weights_name).write_bytes(payload)
    return root


@pytest.mark.parametrize("weights_name", ["model.safetensors", "model.bin", "pytorch_model.pt", "model.pth"])
def test_checkpoint_loader_never_unpickles(tmp_path: Path, weights_name: str) -> None:
    from policies.pi05.checkpoint import CheckpointError, iter_tensors

    marker = tmp_path / "pwned"
    payload = pickle.dumps({"w": _Payload(marker)})
    folder = _checkpoint_folder(tmp_path / "ckpt", weights_name, payload)
    with pytest.raises(CheckpointError):
        list(iter_tensors(folder))
    torch_payload = tmp_path / "torch_payload.pt"
    torch.save({"w": _Payload(marker)}, torch_payload)
    (folder / weights_name).write_bytes(torch_payload.read_bytes())
    with pytest.raises(CheckpointError):
        list(iter_tensors(folder))
    assert not marker.exists()


def test_libero_init_states_never_unpickle(tmp_path: Path) -> None:
    from wrappers.adapters.libero import load_init_states

    marker = tmp_path / "pwned"
    np.save(tmp_path / "objects.npy", np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):
        load_init_states(tmp_path / "objects.npy")
    torch.save([_Payload(marker)], tmp_path / "legacy.pruned_init")
    with pytest.raises(pickle.UnpicklingError):
        load_init_states(tmp_path / "legacy.pruned_init")
    assert not marker.exists()
    torch.save(torch.zeros(3, 4), tmp_path / "good.pruned_init")  # a legacy tensor file still loads
    assert load_init_states(tmp_path / "good.pruned_init").shape == (3, 4)


def test_norm_stats_and_configs_are_parsed_as_data(tmp_path: Path) -> None:
    """A config whose strings look like code stays a string; nothing is evaluated."""
    from policies.pi05.config import Pi05Config

    marker = tmp_path / "pwned"
    bad = Pi05Config.tiny().to_dict()
    bad["dtype"] = f"__import__('os').mkdir({str(marker)!r})"
    with pytest.raises(ValueError):
        Pi05Config.from_dict(bad)
    assert not marker.exists()
