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


def test_bad_data_gets_clear_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no prompts in .*empty.jsonl"):
        PromptSource(tmp_path / "empty.jsonl", batch_size=2)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        PromptSource(tmp_path / "bad.jsonl", batch_size=2)
    (tmp_path / "list.jsonl").write_text('[1, 2]\n')
    with pytest.raises(ValueError, match="list.jsonl:1: a list, not a JSON object"):
        PromptSource(tmp_path / "list.jsonl", batch_size=2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PromptSource(tmp_path / "missing.jsonl", batch_size=2)
    with pytest.raises(ValueError, match="record 1 .* has keys \\['x'\\]"):
        PromptSource([{"prompt": "a"}, {"x": 1}], batch_size=2)
    with pytest.raises(ValueError, match="expected .jsonl or .parquet"):
        (tmp_path / "p.csv").write_text("a\n")
        PromptSource(tmp_path / "p.csv", batch_size=2)
