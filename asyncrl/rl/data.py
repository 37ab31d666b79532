"""Prompt sources: a JSONL or Parquet file, or a Python sequence of records (dicts).

Batches are TensorBatches with one list column per record key, in an order shuffled with a
seed each epoch; `state_dict()` / `load_state_dict()` give a resumable position, so a run
stopped and resumed sees the same prompts in the same order.

With `repeat=k` each record appears k times in a row (a GRPO group: k samples of one
prompt), and a "seed" column gives every sample its own sampling seed, derived from the
source's seed and the sample's place in the data (the same in a resumed run).

With `tokenizer=` (a local directory or a tokenizer), prompts may be text or chat messages,
as verl's parquet files hold them: each record's `prompt_key` becomes "prompt" (token ids:
chats through the chat template, the assistant's turn opened) and "raw_prompt" (as given).
`max_prompt_length` drops the records whose prompt has more tokens, and says how many.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from asyncrl.comm.batch import TensorBatch
from asyncrl.comm.codec import encode_oob
from asyncrl.hybrid.sampler import GENERATED, PROMPT_WIDTH
from asyncrl.hybrid.user_fn import load_tokenizer
from asyncrl.rl.batch import ASSEMBLED, SAMPLES_PER_PROMPT
from asyncrl.rl.tokens import as_list, as_token_ids, no_negative_ids, plain, prompt_ids

log = logging.getLogger("asyncrl")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON Lines file (one JSON object per line; blank lines skipped)."""
    return _read_jsonl(path)[0]


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The records and the line each came from (for messages that name file:line)."""
    records, lines = [], []
    hint = (" (a .json file is read as JSON Lines: one object per line, not one array)"
            if Path(path).suffix == ".json" else "")
    with open(path, "rb") as f:  # decoded line by line, so a bad byte has its line
        for number, raw in enumerate(f, 1):
            try:  # (a BOM, as some Windows editors write, starts line 1)
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{number}: not UTF-8 text ({e.reason} at byte "
                                 f"{e.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg} at column "
                                 f"{e.colno}); each line must be one JSON object{hint}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: a {type(record).__name__}, not a JSON "
                                 f"object; each line must be one object such as "
                                 f'{{"prompt": [token ids]}}{hint}')
            records.append(record)
            lines.append(number)
    return records, lines


def read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    return pq.read_table(path).to_pylist()


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSONL or Parquet prompt file (to reshape them before a
    PromptSource: a question into a chat, say), with PromptSource's errors for bad files."""
    return _read_file(Path(path))[0]


def _read_file(path: Path) -> tuple[list[dict[str, Any]], str, Callable[[int], str]]:
    """A prompt file's records, its name for messages, and `locate(i)`: where record i is."""
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"prompt file {path} {what}; check the path (a relative path is read from "
            f"{os.getcwd()})")
    if path.suffix in (".jsonl", ".json"):
        records, lines = _read_jsonl(path)
        return records, str(path), lambda i: f"{path}:{lines[i]}"
    if path.suffix == ".parquet":
        return read_parquet(path), str(path), lambda i: f"row {i} of {path}"
    raise ValueError(f"prompt file {path} has the suffix {path.suffix!r}; PromptSource reads "
                     f".jsonl (one JSON object per line) or .parquet: convert the file, or "
                     f"pass the records as a list of dicts")


def _read_records(data: Sequence[dict[str, Any]]
                  ) -> tuple[list[dict[str, Any]], str, Callable[[int], str]]:
    """`_read_file` for records given in Python: each must be a dict."""
    def locate(i: int) -> str:
        return f"record {i} of the given sequence"

    records = list(data)
    if isinstance(data, Mapping) or (hasattr(data, "to_dict") and records
                                     and not isinstance(records[0], dict)):
        raise ValueError(f"data= is a {type(data).__name__}, which gives its keys or columns "
                         f"when read, not records: pass a list of records, one dict each "
                         f"(df.to_dict('records') for a DataFrame)")
    for i, r in enumerate(records):
        if isinstance(r, os.PathLike) or (isinstance(r, str) and r.endswith(
                (".jsonl", ".json", ".parquet"))):
            raise ValueError(f"{locate(i)} is a path ({str(r)!r}), not a record: give one file "
                             f"as data=, or several files' records as one list (read_records "
                             f"of each, concatenated)")
        if not isinstance(r, dict):
            raise ValueError(f"{locate(i)} is a {type(r).__name__}, not a dict; pass records "
                             f'as dicts such as {{"prompt": [token ids], "answer": "7"}}')
    # pandas' records hold numpy object arrays (chats, list<string> columns), which the
    # codec cannot send: it failed at the first generate, naming no record or column
    return [plain(r) for r in records], "the given sequence", locate


def _tokenized(records: list[dict[str, Any]], keys: list[str], tokenizer: Any, prompt_key: str,
               where: str, locate: Callable[[int], str]) -> list[dict[str, Any]]:
    """The records with their `prompt_key` as token ids under "prompt", as given under
    "raw_prompt"."""
    if prompt_key not in keys:
        raise ValueError(f"records of {where} have no {prompt_key!r} key (they have {keys}); "
                         f"name the key that holds the prompt with prompt_key=")
    taken = [k for k in ("raw_prompt", "prompt") if k in keys and k != prompt_key]
    if taken:
        raise ValueError(f"records of {where} have a {taken[0]!r} key, where PromptSource puts "
                         f"the tokenized prompt ('prompt') and the prompt as given "
                         f"('raw_prompt'): rename that key")
    tok = load_tokenizer(tokenizer)
    out = []
    for i, r in enumerate(records):
        r = dict(r)
        raw = plain(r.pop(prompt_key))  # (a file's records were not made plain)
        r["prompt"], r["raw_prompt"] = prompt_ids(tok, raw, locate(i)), raw
        out.append(r)
    return out


def _token_ids(records: list[dict[str, Any]], locate: Callable[[int], str]
               ) -> list[dict[str, Any]]:
    """Without a tokenizer: each "prompt" as a list (a tuple or an array: pandas' read_parquet
    records) and, once any is token ids, every one a non-empty list of ints (a bad one failed
    generation when its batch came, hours in). Text alone, or no "prompt" (a source of other
    data), is kept: the first generate refuses it, naming the fix."""
    out = [{**r, "prompt": as_list(r["prompt"])} if "prompt" in r else r for r in records]
    for i, r in enumerate(out):
        if "prompt" in r and not isinstance(r["prompt"], str | list):
            raise ValueError(f"{locate(i)}: the prompt {str(r['prompt'])[:40]!r} is a "
                             f"{type(r['prompt']).__name__}, not a list of token ids; give "
                             f"token ids, or text or chats with tokenizer=")
    ids = next((i for i, r in enumerate(out) if isinstance(r.get("prompt"), list)), None)
    if ids is None:
        return out
    for i, r in enumerate(out):
        p = r["prompt"]
        flat = as_token_ids(p)  # (before comparing: an array compares elementwise)
        if flat is None:
            like = f", as {locate(ids)}'s is" if i != ids else ""
            raise ValueError(f"{locate(i)}: the prompt {str(p)[:40]!r} is not a list of token "
                             f"ids (ints){like}; give every record token ids, or give text or "
                             f"chats with tokenizer=")
        if not flat:
            raise ValueError(f"{locate(i)}: the prompt [] has no tokens; generation needs at "
                             f"least one")
        no_negative_ids(flat, locate(i))
        if not all(type(t) is int for t in p):  # (numpy's ints: as plain ints on the wire)
            out[i] = {**r, "prompt": flat}
    return out


def _short_enough(records: list[dict[str, Any]], limit: int, where: str,
                  locate: Callable[[int], str]) -> list[dict[str, Any]]:
    """The records whose prompt has at most `limit` tokens (verl's filter_overlong_prompts)."""
    for i, r in enumerate(records):
        if not isinstance(r.get("prompt"), list):
            raise ValueError(f"max_prompt_length counts the token ids of 'prompt', but "
                             f"{locate(i)} has {str(r.get('prompt'))[:40]!r}; give token ids, "
                             f"or text with tokenizer=")
        if not r["prompt"]:
            raise ValueError(f"{locate(i)}: the prompt [] has no tokens; generation needs at "
                             f"least one")
    kept = [r for r in records if len(r["prompt"]) <= limit]
    if len(kept) < len(records):
        longest = max(len(r["prompt"]) for r in records)
        if not kept:
            raise ValueError(f"every prompt of {where} is longer than max_prompt_length="
                             f"{limit} tokens (the shortest: "
                             f"{min(len(r['prompt']) for r in records)}); raise the limit")
        log.warning("asyncrl: %d of the %d prompts of %s are longer than max_prompt_length=%d "
                    "tokens (the longest: %d) and are left out", len(records) - len(kept),
                    len(records), where, limit, longest)
    return kept


def _sendable(records: list[dict[str, Any]], locate: Callable[[int], str]) -> None:
    """Every record's values as the wire carries them (an int past 64 bits failed hours in,
    at the generate of its batch, naming no record, or at the first checkpoint's digest)."""
    step = 4096  # (~12 ms for 1e5 small records; in parts: a large file's text not held twice)
    for start in range(0, len(records), step):
        try:
            encode_oob(records[start:start + step])  # (large arrays left out: not copied)
        except (OverflowError, TypeError):
            for i in range(start, min(start + step, len(records))):
                for key, value in records[i].items():
                    try:
                        encode_oob(value)
                    except (OverflowError, TypeError) as e:
                        hint = ("store numbers past 64 bits as strings" if isinstance(
                            e, OverflowError) else "store it as text, a number or a list")
                        raise ValueError(f"{locate(i)}: its {key!r} value cannot be sent to "
                                         f"the workers ({e}); {hint}") from None
            raise


# records as values: what they hold, never how this process prints it
_CANONICAL = msgspec.msgpack.Encoder(
    order="deterministic", enc_hook=lambda x: x.tolist() if hasattr(x, "tolist") else str(x))


class PromptSource:
    def __init__(self, data: str | os.PathLike | Sequence[dict[str, Any]], *, batch_size: int,
                 seed: int = 0, shuffle: bool = True, epochs: int | None = 1, repeat: int = 1,
                 tokenizer: Any = None, prompt_key: str = "prompt",
                 max_prompt_length: int | None = None):
        for name, value in (("batch_size", batch_size), ("repeat", repeat),
                            ("max_prompt_length", 1 if max_prompt_length is None
                             else max_prompt_length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PromptSource: {name} must be an int >= 1, got {value!r}")
        if epochs is not None and (not isinstance(epochs, int) or isinstance(epochs, bool) or
                                   epochs < 1):  # 0 ran a run of no step without a word
            raise ValueError(f"PromptSource: epochs must be an int >= 1, or None (endless), "
                             f"got {epochs!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):  # the samples' seeds
            raise ValueError(f"PromptSource: seed must be an int, got {seed!r}")
        if not isinstance(shuffle, bool):  # "no" shuffled
            raise ValueError(f"PromptSource: shuffle must be True or False, got {shuffle!r}")
        if isinstance(data, str | os.PathLike):
            records, where, locate = _read_file(Path(data))
            fix = ('write at least one row, with a "prompt" column (token ids)'
                   if Path(data).suffix == ".parquet" else 'write one JSON object per line, '
                   'such as {"prompt": [token ids], "answer": "7"}')
        else:
            records, where, locate = _read_records(data)
            fix = "pass at least one record (a dict)"
        if not records:
            raise ValueError(f"no prompts in {where}: it is empty; {fix}")
        keys = sorted(records[0])
        for i, r in enumerate(records):
            if sorted(r) != keys:
                missing = sorted(set(keys) - set(r))
                extra = sorted(set(r) - set(keys))
                change = " and ".join(([f"add {missing}"] if missing else []) +
                                      ([f"drop {extra}"] if extra else []))
                raise ValueError(f"{locate(i)} has keys {sorted(r)}, but {locate(0)} has "
                                 f"{keys}; every record needs the same keys: {change} there")
        if "seed" in keys:
            raise ValueError(f"records of {where} have a 'seed' key; PromptSource adds the "
                             f"sampling seeds itself: rename that key")
        taken = sorted(set(keys) & GENERATED)
        if taken:  # generation's columns replace them: a reward function asking for one
            raise ValueError(f"records of {where} have the key(s) {taken}, which generation "
                             f"writes (its columns {sorted(GENERATED)}): rename them")
        taken = sorted(set(keys) & ASSEMBLED)
        if taken:  # an update puts them beside the rollout's columns: it failed there
            raise ValueError(f"records of {where} have the key(s) {taken}, which the RL step "
                             f"writes (its columns {sorted(ASSEMBLED)}): rename them")
        if tokenizer is not None:
            records = _tokenized(records, keys, tokenizer, prompt_key, where, locate)
            keys = sorted(records[0])
        elif prompt_key != "prompt":
            raise ValueError(f"prompt_key={prompt_key!r} names the key to tokenize: give "
                             f"tokenizer= too (the engines read token ids from 'prompt')")
        else:
            records = _token_ids(records, locate)
        _sendable(records, locate)  # (before _short_enough: locate(i) is of every record)
        if max_prompt_length is not None:
            records = _short_enough(records, max_prompt_length, where, locate)
        self.records, self.keys = records, keys
        self.batch_size, self.seed, self.shuffle, self.epochs = batch_size, seed, shuffle, epochs
        self.repeat, self.max_prompt_length = repeat, max_prompt_length
        self.epoch, self.index = 0, 0  # the position: the next batch starts here
        self._digest: str | None = None  # (made at the first checkpoint)
        # one epoch's order, made once for it (a million prompts' randperm: ~50 ms, at every
        # batch and every state_dict, which each step takes)
        self._orders: tuple[int, list[int]] | None = None
        self._said_done = False

    def _epoch_order(self, epoch: int) -> list[int]:
        """`epoch`'s order, made once for the epoch."""
        if self._orders is None or self._orders[0] != epoch:
            self._orders = (epoch, self._order(epoch))
        return self._orders[1]

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (1 << 63))
        return torch.randperm(len(self.records), generator=gen).tolist()

    def __iter__(self) -> Iterator[TensorBatch]:
        batch = self.next_batch()
        if batch is None and self.epochs is not None and not self._said_done:
            self._said_done = True  # (a validation set read at every evaluation, say)
            log.warning("asyncrl: a PromptSource that has given its %d epoch(s) was read "
                        "again and gives nothing: its position moves as it is read (and "
                        "checkpoints save it); list() it once to read it many times",
                        self.epochs)
        while batch is not None:
            yield batch
            batch = self.next_batch()

    def next_batch(self) -> TensorBatch | None:
        """The batch at the source's position (None once its epochs are done), moving it on:
        every reader shares the one position (a dynamic-sampling node drawing more prompts
        beside the flow's own reading), which checkpoints save."""
        if self.index >= len(self.records):
            self.epoch, self.index = self.epoch + 1, 0
        if self.epochs is not None and self.epoch >= self.epochs:
            return None
        epoch, first = self.epoch, self.index
        picked = self._epoch_order(epoch)[first:first + self.batch_size]
        self.index = first + len(picked)
        rows = [self.records[i] for i in picked for _ in range(self.repeat)]
        columns: dict[str, Any] = {k: [r[k] for r in rows] for k in self.keys}
        # one seed per sample: its epoch, its place in the epoch, its copy
        base = (self.seed * 1_000_003 + epoch) * len(self.records)
        columns["seed"] = [((base + first + i) * self.repeat + j) % (1 << 62)
                           for i in range(len(picked)) for j in range(self.repeat)]
        # responses to prompts padded to one width concatenate across generate calls
        meta = {} if self.max_prompt_length is None else {PROMPT_WIDTH: self.max_prompt_length}
        meta[SAMPLES_PER_PROMPT] = self.repeat  # (a group's size is checked against it)
        return TensorBatch(columns, meta)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "records": len(self.records), "shuffle": self.shuffle,
                "digest": self.digest(), "order": self._order_digest(self.epoch)}

    def _order_digest(self, epoch: int) -> str:
        """A hash of the first 64 indices of `epoch`'s order: the seed is saved, but
        torch.randperm may shuffle otherwise in another torch release."""
        head = self._epoch_order(epoch)[:64]
        return hashlib.sha1(json.dumps(head).encode()).hexdigest()[:16]

    def digest(self) -> str:
        """A fingerprint of the records (64 of them, evenly spaced: cheap for a large set),
        which another file of the same length would not match; of their values, encoded
        alike in every process and version (dict keys and sets sorted, arrays and numpy
        numbers as lists and numbers), not of their repr."""
        if self._digest is None:
            n = len(self.records)
            picks = sorted({i * n // 64 for i in range(64)}) if n else []
            encoded = _CANONICAL.encode([self.records[i] for i in picks])
            self._digest = hashlib.sha1(encoded).hexdigest()[:16]
        return self._digest

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.epoch, self.index = state["epoch"], state["index"]

    def check_state(self, state: dict[str, Any]) -> None:
        """ValueError when `state` is a position in other prompts (a resume checks it before
        any group starts)."""
        # (a position of before session 28 has no shuffle or digest: not checked)
        now = {"records": len(self.records), "seed": self.seed, "shuffle": self.shuffle,
               "digest": self.digest()}
        differ = [f"{k} {state.get(k)!r} there, {v!r} here" for k, v in now.items()
                  if (k in state or k in ("records", "seed")) and state.get(k) != v]
        if differ:  # the saved index would point into another order or other records
            raise ValueError(f"this position was saved for other prompts ({'; '.join(differ)}"
                             f"); resume with the prompt data, seed and shuffle the run "
                             f"started with (the digest is of the records' values)")
        self._check_order(state)

    def _check_order(self, state: dict[str, Any]) -> None:
        """The same data and seed shuffled otherwise here (another torch release's randperm):
        the saved index would repeat some prompts and skip others."""
        epoch = state.get("epoch", 0)  # (an older position has no order: not checked)
        if "order" in state and state["order"] != self._order_digest(epoch):
            raise ValueError(f"this position was saved for another order of the prompts: "
                             f"epoch {epoch}'s shuffle differs here (order {state['order']!r} "
                             f"there, {self._order_digest(epoch)!r} here), though the data, "
                             f"seed and shuffle match; resume with the torch version the run "
                             f"started with")
