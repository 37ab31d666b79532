"""Prompt sources: files and sequences, seeded shuffling, resumable positions, bad data."""

from __future__ import annotations

import json

import pytest

from asyncrl.rl import PromptSource


def records(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "answer": i} for i in range(n)]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_jsonl_batches_cover_every_record_once_per_epoch(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", records(10))
    src = PromptSource(tmp_path / "p.jsonl", batch_size=4, seed=1, epochs=2)
    batches = list(src)
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    first = [a for b in batches[:3] for a in b["answer"]]
    second = [a for b in batches[3:] for a in b["answer"]]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # each epoch has its own order
    assert batches[0]["prompt"] == [f"p{a}" for a in batches[0]["answer"]]


def test_seeded_order_and_exact_resume():
    a = [b["answer"] for b in PromptSource(records(12), batch_size=3, seed=7)]
    assert a == [b["answer"] for b in PromptSource(records(12), batch_size=3, seed=7)]
    assert a != [b["answer"] for b in PromptSource(records(12), batch_size=3, seed=8)]
    src = PromptSource(records(12), batch_size=3, seed=7, epochs=3)
    it = iter(src)
    seen = [next(it)["answer"] for _ in range(5)]  # into the second epoch
    state = src.state_dict()
    rest = [b["answer"] for b in it]
    again = PromptSource(records(12), batch_size=3, seed=7, epochs=3)
    again.load_state_dict(state)
    assert [b["answer"] for b in again] == rest
    assert seen[:4] == a
    other = PromptSource(records(11), batch_size=3, seed=7)
    with pytest.raises(ValueError, match="saved for 12 records with seed 7"):
        other.load_state_dict(state)

