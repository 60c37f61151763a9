from __future__ import annotations

import pytest

from policies.pi05.tokenizer import (
    PALIGEMMA_VOCAB_SIZE,
    build_standin_tokenizer,
    check_vocab,
    load_tokenizer,
)


def test_standin_layout(standin_tok):
    tok = standin_tok
    assert tok.vocab_size == PALIGEMMA_VOCAB_SIZE == 257_152
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert tok.is_standin
    sp = tok._sp
    assert sp.unk_id() == 3 and sp.id_to_piece(4) == "<mask>"
    assert sp.piece_to_id("<loc0000>") == 256_000
    assert sp.piece_to_id("<loc0001>") == 256_001
    assert sp.piece_to_id("<seg000>") == 257_024
    assert sp.piece_to_id("<seg127>") == 257_151
    assert tok.encode("<loc0001>") == [256_001]


def test_standin_splits_digits_and_round_trips(standin_tok):
    tok = standin_tok
    ids = tok.encode("1234")
    assert len(ids) == 4
    assert ids == [tok.encode(d)[0] for d in "1234"]
    for text in ["Task: pick up the black bowl, State: 12 3 -1 255;\nAction: ", "Ünïcödé 日本 ~", "a  b\n"]:
        assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode("Ünïcödé 日本")) < 512  # byte fallback, no unk
    assert 3 not in tok.encode("Ünïcödé 日本")


def test_standin_is_cached(standin_tokenizer):
    model = standin_tokenizer / "tokenizer.model"
    before = model.stat().st_mtime_ns
    assert build_standin_tokenizer(standin_tokenizer) == standin_tokenizer  # speed: benchmarks/bench_cli.py
    assert model.stat().st_mtime_ns == before


def test_build_is_deterministic(tmp_path, standin_tokenizer):
    other = build_standin_tokenizer(tmp_path / "again")
    assert (other / "tokenizer.model").read_bytes() == (standin_tokenizer / "tokenizer.model").read_bytes()


def test_missing_local_path_never_falls_back(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither tokenizer.model"):
        load_tokenizer(empty)


def test_hub_id_unavailable_raises_with_remedy(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(OSError, match="not replaced by a stand-in") as info:
        load_tokenizer("google/paligemma-3b-pt-224", local_files_only=True)
    assert "google/paligemma-3b-pt-224" in str(info.value)


def test_transformers_backend_matches_sentencepiece(standin_tokenizer, standin_tok):
    hf = load_tokenizer(standin_tokenizer, backend="transformers")
    assert (hf.bos_id, hf.eos_id, hf.pad_id) == (2, 1, 0)
    assert hf.vocab_size == PALIGEMMA_VOCAB_SIZE
    for text in ["Task: open the drawer, State: 0 -1 255 17;\nAction: ", "pick_up it\n", "  x  "]:
        assert hf.encode(text) == standin_tok.encode(text)


def test_vocab_larger_than_embedding_is_refused(standin_tok):
    check_vocab(standin_tok, PALIGEMMA_VOCAB_SIZE)
    with pytest.raises(ValueError, match=r"257152 tokens .* 1000 rows"):
        check_vocab(standin_tok, 1000)
