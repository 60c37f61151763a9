r"""Prompt tokenizers: the real PaliGemma tokenizer (local folder or hub id) and a local stand-in for tests.

`load_tokenizer(name_or_path)` returns a `PromptTokenizer`: a folder holding a SentencePiece
``tokenizer.model`` is read with sentencepiece directly (fast, no transformers import); any other folder or a
hub id (the default ``google/paligemma-3b-pt-224``) goes through ``transformers.AutoTokenizer``. A name that
cannot be loaded raises -- it never falls back to the stand-in.

`build_standin_tokenizer(path)` writes a 257,152-piece SentencePiece model with PaliGemma's id layout
(pad 0, eos 1, bos 2, unk 3, ``<mask>`` 4, digits split, byte fallback, ``<loc0000..1023>`` from id 256000
and ``<seg000..127>`` after them) trained in memory on a small robot-task corpus (reference/simulators.md
section 6). Its token ids are not PaliGemma's, but the vocabulary size, special ids and the digit splitting
that the discretised-state prompt relies on match.

Example:
    >>> import tempfile
    >>> folder = build_standin_tokenizer(tempfile.mkdtemp())
    >>> tok = load_tokenizer(folder)
    >>> tok.vocab_size, tok.bos_id, tok.pad_id
    (257152, 2, 0)
    >>> tok.decode(tok.encode("Task: pick up the bowl, State: 12 -1;\nAction: "))
    'Task: pick up the bowl, State: 12 -1;\nAction: '
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

DEFAULT_TOKENIZER = "google/paligemma-3b-pt-224"
"""Hub id of the PaliGemma tokenizer (a stored name; nothing is downloaded unless a processor asks for it)."""

PALIGEMMA_VOCAB_SIZE = 257_152
"""Gemma's 256,000 pieces + 1,024 ``<loc>`` + 128 ``<seg>`` tokens."""

STANDIN_NAME = "phyai-standin"
"""Tokenizer name that asks for the locally built stand-in explicitly (built on first use, with a warning)."""
STANDIN_MARKER = "phyai_standin.json"
"""File that marks a folder as a stand-in tokenizer built by `build_standin_tokenizer`."""

_STANDIN_VERSION = 1


@runtime_checkable
class PromptTokenizer(Protocol):
    """What the prompt builder needs from a tokenizer."""

    name: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    is_standin: bool

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without BOS/EOS."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`."""
        ...


class SentencePieceTokenizer:
    """A SentencePiece ``tokenizer.model`` read with the sentencepiece library.

    Example:
        >>> import tempfile
        >>> tok = SentencePieceTokenizer(Path(build_standin_tokenizer(tempfile.mkdtemp())) / "tokenizer.model")
        >>> tok.encode("12") == [tok.encode("1")[0], tok.encode("2")[0]]
        True
    """

    def __init__(self, model_file: str | Path, *, name: str | None = None) -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.name = name or str(model_file)
        self.vocab_size = int(self._sp.get_piece_size())
        self.bos_id = int(self._sp.bos_id())
        self.eos_id = int(self._sp.eos_id())
        self.pad_id = max(int(self._sp.pad_id()), 0)
        self.is_standin = (Path(model_file).parent / STANDIN_MARKER).exists()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without BOS/EOS."""
        return list(self._sp.encode(text))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`."""
        return str(self._sp.decode(list(ids)))


class HFTokenizer:
    """A ``transformers`` tokenizer (local folder or hub id), used without special tokens.

    Example:
        >>> import tempfile
        >>> tok = HFTokenizer(build_standin_tokenizer(tempfile.mkdtemp()))  # doctest: +SKIP
    """

    def __init__(self, name_or_path: str | Path, *, local_files_only: bool = False) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(name_or_path), local_files_only=local_files_only)
        self.name = str(name_or_path)
        self.vocab_size = len(self._tok)
        self.bos_id = int(self._tok.bos_token_id)
        self.eos_id = int(self._tok.eos_token_id)
        self.pad_id = int(self._tok.pad_token_id) if self._tok.pad_token_id is not None else 0
        self.is_standin = Path(str(name_or_path), STANDIN_MARKER).exists()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without BOS/EOS."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`."""
        return str(self._tok.decode(list(ids)))


def load_tokenizer(
    name_or_path: str | Path, *, backend: str = "auto", local_files_only: bool = False
) -> PromptTokenizer:
    """Load a tokenizer from a local folder / ``tokenizer.model`` file or a hub id; never substitutes another.

    Args:
        name_or_path: folder, SentencePiece model file, or hub id (e.g. ``google/paligemma-3b-pt-224``).
        backend: ``"auto"`` (sentencepiece when a ``tokenizer.model`` is present, else transformers),
            ``"sentencepiece"`` or ``"transformers"``.
        local_files_only: for hub ids, use only the local Hugging Face cache (no network).

    Raises:
        ValueError: unknown backend.
        FileNotFoundError: a local path that does not exist or holds no tokenizer files.
        OSError: a hub id that transformers cannot load (gated, offline, misspelt); the message says how to fix.
    """
    if backend not in ("auto", "sentencepiece", "transformers"):
        raise ValueError(f"load_tokenizer: backend must be 'auto', 'sentencepiece' or 'transformers', got {backend!r}.")
    name = str(name_or_path)
    if name == STANDIN_NAME:  # an explicit request, never a fallback
        folder = build_standin_tokenizer(default_standin_dir())
        warnings.warn(
            f"load_tokenizer: using the locally built stand-in tokenizer at {folder} (PaliGemma's vocabulary size "
            "and special ids, not its token ids); fine for random-weight demos and tests, not for checkpoints.",
            stacklevel=2,
        )
        return SentencePieceTokenizer(Path(folder) / "tokenizer.model", name=STANDIN_NAME)
    path = Path(name).expanduser()
    if path.exists():
        model_file = path if path.is_file() else path / "tokenizer.model"
        if backend in ("auto", "sentencepiece") and model_file.is_file():
            return SentencePieceTokenizer(model_file, name=name)
        if backend == "sentencepiece":
            raise FileNotFoundError(f"load_tokenizer: no SentencePiece tokenizer.model under {name!r}.")
        if path.is_dir() and not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise FileNotFoundError(
                f"load_tokenizer: {name!r} holds neither tokenizer.model, tokenizer.json nor "
                "tokenizer_config.json; point `tokenizer` at a tokenizer folder."
            )
        return HFTokenizer(path, local_files_only=True)
    if name.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(
            f"load_tokenizer: tokenizer path {name!r} does not exist. Build a stand-in with "
            "policies.pi05.tokenizer.build_standin_tokenizer(path) for tests, or give the real tokenizer folder."
        )
    if backend == "sentencepiece":
        raise FileNotFoundError(f"load_tokenizer: {name!r} is not a local tokenizer.model file or folder.")
    try:
        return HFTokenizer(name, local_files_only=local_files_only)
    except Exception as err:  # transformers raises OSError/ValueError/HTTP errors; re-raise with a remedy
        raise OSError(
            f"load_tokenizer: could not load tokenizer {name!r} ({type(err).__name__}: {err}). "
            "It is not replaced by a stand-in. Remedies: 1) log in with `huggingface-cli login` and accept the "
            "PaliGemma licence (the repo is gated); 2) download it once and pass the local folder; "
            "3) for tests, pass a folder built by build_standin_tokenizer()."
        ) from err


def check_vocab(tokenizer: PromptTokenizer, embedding_rows: int) -> None:
    """Refuse a tokenizer whose ids could index past the model's token embedding.

    Raises:
        ValueError: ``tokenizer.vocab_size > embedding_rows``.
    """
    if tokenizer.vocab_size > embedding_rows:
        raise ValueError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but the model's embedding has "
            f"{embedding_rows} rows (expected vocab_size <= {embedding_rows}); use the PaliGemma tokenizer "
            f"({PALIGEMMA_VOCAB_SIZE} tokens) or a model config with a larger vocab_size."
        )


# ------------------------------------------------------------------------------------------- stand-in
def _standin_corpus() -> list[str]:
    """A small deterministic corpus of prompt-like sentences (tasks, numbers, punctuation)."""
    words = (
        "pick up the black bowl between plate and ramekin place it on red block put open close top middle "
        "bottom drawer of cabinet move to left right turn on off stove alphabet soup cream cheese tomato "
        "sauce ketchup butter milk orange juice basket wine bottle rack mug microwave book caddy back front "
        "push pull lift stack cube green blue yellow white grasp rotate insert peg hole in into onto from "
        "near next a an with task state action"
    ).split()
    out = []
    for i in range(600):
        task = " ".join(words[(i * 7 + k * 3) % len(words)] for k in range(3 + i % 9))
        nums = " ".join(str((i * 37 + k * 101) % 257 - 1) for k in range(1 + i % 8))
        out.append(f"Task: {task}, State: {nums};\nAction: ")
        out.append(f"{task.capitalize()}.\n")
    return out


def build_standin_tokenizer(path: str | Path, *, overwrite: bool = False) -> Path:
    """Write (or reuse) a 257,152-piece stand-in PaliGemma tokenizer in folder `path`; returns the folder.

    The folder gets ``tokenizer.model`` (SentencePiece), ``tokenizer_config.json`` (so transformers'
    ``AutoTokenizer`` loads it as a ``GemmaTokenizer``) and a marker file. An existing stand-in of the same
    version is reused, so the folder serves as a cache. Takes about 0.5 s and needs no network.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    folder = Path(path).expanduser()
    marker = folder / STANDIN_MARKER
    if not overwrite and marker.is_file() and (folder / "tokenizer.model").is_file():
        try:
            if json.loads(marker.read_text()).get("version") == _STANDIN_VERSION:
                return folder
        except (OSError, json.JSONDecodeError):
            pass
    folder.mkdir(parents=True, exist_ok=True)

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_standin_corpus()),
        model_writer=buffer,
        vocab_size=512,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        control_symbols=["<mask>"],
        user_defined_symbols=["\n"],
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    proto = model_pb2.ModelProto()
    proto.ParseFromString(buffer.getvalue())
    piece_type = model_pb2.ModelProto.SentencePiece
    for i in range(256_000 - len(proto.pieces)):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = f"<unused{i}>", 0.0, piece_type.UNUSED
    for i in range(1024):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = f"<loc{i:04d}>", 0.0, piece_type.USER_DEFINED
    for i in range(128):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = f"<seg{i:03d}>", 0.0, piece_type.USER_DEFINED
    assert len(proto.pieces) == PALIGEMMA_VOCAB_SIZE

    config: dict[str, Any] = {
        "tokenizer_class": "GemmaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "padding_side": "right",
        "model_max_length": 200,
    }
    _atomic_write(folder / "tokenizer.model", proto.SerializeToString())
    _atomic_write(folder / "tokenizer_config.json", (json.dumps(config, indent=2) + "\n").encode())
    _atomic_write(
        marker,
        (json.dumps({"version": _STANDIN_VERSION, "vocab_size": PALIGEMMA_VOCAB_SIZE}) + "\n").encode(),
    )
    return folder


def default_standin_dir() -> Path:
    """Cache folder of the stand-in (``$PHYAI_GYM_CACHE`` or ``~/.cache/phyai-gym``)/paligemma_standin."""
    root = os.environ.get("PHYAI_GYM_CACHE") or str(Path("~/.cache/phyai-gym").expanduser())
    return Path(root) / "paligemma_standin"


def _atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename (no half-written files)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
