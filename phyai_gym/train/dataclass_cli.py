"""An argparse command line from a typed dataclass: one flag per field, its docstring as help, defaults shown.

``--num-envs 8`` sets ``num_envs``; booleans get ``--quiet`` / ``--no-quiet``; ``X | None`` fields accept
``none``. Fields with ``init=False`` (derived in ``__post_init__``) get no flag. The help texts are the string
literals under each field (the docstring-per-field convention), read from the class's source.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
_SCALARS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under its annotation in the class body.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Args:
        ...     lr: float = 1e-3
        ...     '''Adam learning rate'''
        >>> field_docs(Args)  # doctest: +SKIP
        {'lr': 'Adam learning rate'}
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (e.g. built in a REPL): no help texts
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in zip(body, body[1:]):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _converter(annotation: str, name: str) -> tuple[Callable[[str], Any] | None, bool]:
    """(str -> value converter, is a bool) of a field annotation written as text (``"int | None"``)."""
    parts = [p.strip() for p in annotation.replace("Optional[", "").rstrip("]").split("|")]
    optional = "None" in parts
    base = next((p for p in parts if p != "None"), "str")
    if base == "bool":
        return None, True
    if base not in _SCALARS:
        raise TypeError(f"dataclass_parser: field {name!r} has type {annotation!r}; supported: int, float, str, bool")
    scalar = _SCALARS[base]

    def convert(text: str) -> Any:
        return None if optional and text.lower() == "none" else scalar(text)

    convert.__name__ = base  # argparse names the type in its error message
    return convert, False


def dataclass_parser(cls: type, description: str | None = None) -> argparse.ArgumentParser:
    """An `argparse.ArgumentParser` with one flag per init field of the dataclass `cls`.

    Args:
        cls: a dataclass whose field annotations are int, float, str or bool, optionally ``| None``.
        description: the parser's description (default: the first line of the class docstring).

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Args:
        ...     steps: int = 10
        ...     quiet: bool = False
        >>> vars(dataclass_parser(Args).parse_args(["--steps", "3", "--quiet"]))
        {'steps': 3, 'quiet': True}
    """
    docs = field_docs(cls)
    parser = argparse.ArgumentParser(
        description=description or (cls.__doc__ or "").strip().splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        convert, is_bool = _converter(annotation.replace("typing.", ""), f.name)
        help_text = docs.get(f.name, " ")
        if is_bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=convert, default=default, metavar=f.name.upper(), help=help_text)
    return parser


def parse_dataclass(cls: type[T], argv: Sequence[str] | None = None, description: str | None = None) -> T:
    """``cls(**flags)`` from the command line (`argv`, default ``sys.argv[1:]``); bad flags exit with status 2."""
    return cls(**vars(dataclass_parser(cls, description).parse_args(argv)))
