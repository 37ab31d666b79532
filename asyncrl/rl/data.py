"""Prompt sources: a JSONL or Parquet file, or a Python sequence of records (dicts).

Batches are TensorBatches with one list column per record key, in an order shuffled with a
seed each epoch; `state_dict()` / `load_state_dict()` give a resumable position, so a run
stopped and resumed sees the same prompts in the same order.

With `repeat=k` each record appears k times in a row (a GRPO group: k samples of one
prompt), and a "seed" column gives every sample its own sampling seed, derived from the
source's seed and the sample's place in the data (the same in a resumed run).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrl.comm.batch import TensorBatch


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg} at column "
                                 f"{e.colno}); each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: a {type(record).__name__}, not a JSON "
                                 f"object; each line must be one object such as "
                                 f'{{"prompt": "..."}}')
            records.append(record)
    return records


def read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    return pq.read_table(path).to_pylist()


class PromptSource:
    def __init__(self, data: str | os.PathLike | Sequence[dict[str, Any]], *, batch_size: int,
                 seed: int = 0, shuffle: bool = True, epochs: int | None = 1, repeat: int = 1):
        if batch_size < 1:
            raise ValueError(f"PromptSource: batch_size must be >= 1, got {batch_size}")
        if repeat < 1:
            raise ValueError(f"PromptSource: repeat must be >= 1, got {repeat}")
        if isinstance(data, str | os.PathLike):
            path = Path(data)
            if not path.is_file():
                raise FileNotFoundError(f"prompt file {path} does not exist")
            readers = {".jsonl": read_jsonl, ".json": read_jsonl, ".parquet": read_parquet}
            if path.suffix not in readers:
                raise ValueError(f"prompt file {path}: expected .jsonl or .parquet")
            records = readers[path.suffix](path)
            where = str(path)
        else:
            records, where = list(data), "the given sequence"
        if not records:
            raise ValueError(f"no prompts in {where}: it is empty")
        keys = sorted(records[0])
        for i, r in enumerate(records):
            if not isinstance(r, dict) or sorted(r) != keys:
                raise ValueError(f"record {i} of {where} has keys "
                                 f"{sorted(r) if isinstance(r, dict) else type(r).__name__}, "
                                 f"but record 0 has {keys}; every record needs the same keys")
        if "seed" in keys:
            raise ValueError(f"records of {where} have a 'seed' key; PromptSource adds the "
                             f"sampling seeds itself: rename that key")
        self.records, self.keys = records, keys
        self.batch_size, self.seed, self.shuffle, self.epochs = batch_size, seed, shuffle, epochs
        self.repeat = repeat
        self.epoch, self.index = 0, 0  # the position: the next batch starts here

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.records), generator=gen).tolist()

    def __iter__(self) -> Iterator[TensorBatch]:
        while self.epochs is None or self.epoch < self.epochs:
            order = self._order(self.epoch)
            while self.index < len(order):
                picked = order[self.index:self.index + self.batch_size]
                first, self.index = self.index, self.index + len(picked)
                rows = [self.records[i] for i in picked for _ in range(self.repeat)]
                columns: dict[str, Any] = {k: [r[k] for r in rows] for k in self.keys}
                # one seed per sample: its epoch, its place in the epoch, its copy
                base = (self.seed * 1_000_003 + self.epoch) * len(order)
                columns["seed"] = [((base + first + i) * self.repeat + j) % (1 << 62)
                                   for i in range(len(picked)) for j in range(self.repeat)]
                yield TensorBatch(columns)
            self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "records": len(self.records)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("records") != len(self.records) or state.get("seed") != self.seed:
            raise ValueError(f"this position was saved for {state.get('records')} records with "
                             f"seed {state.get('seed')}, but this source has "
                             f"{len(self.records)} records with seed {self.seed}")
        self.epoch, self.index = state["epoch"], state["index"]
