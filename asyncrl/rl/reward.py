"""Rewards as a worker group: a Python function `fn(prompt, response, **meta) -> float`
(`RewardFn`), or a reward model with a scalar head (`RewardModel`).

`score(batch)` takes what generation returned (the prompt records' columns pass through it):
the list column "prompt" (whatever the prompt source holds), the response token ids
(response_ids cut by response_mask) and the other list columns as keyword meta (an "answer",
say; "raw_prompt" when the prompt source tokenized text): those `fn` names, or all of them
when it takes **meta. With
`RewardFn(fn, tokenizer=DIR)` the function reads text instead: the response and a prompt of
token ids decoded, special tokens left out (verl's solution_str). Both return
{"reward": [B]}."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from asyncrl.actors.protocols import Dispatch
from asyncrl.actors.register import register
from asyncrl.actors.worker import Worker
from asyncrl.comm.batch import TensorBatch
from asyncrl.compat import add_note
from asyncrl.hybrid.user_fn import say_lost, taken_by

log = logging.getLogger("asyncrl")

RESERVED = {"prompt", "prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs",
            "seed"}


def _model_settings(model: dict[str, Any], micro_batch_size: int | None = 4,
                    max_tokens_per_micro_batch: int | None = None) -> tuple[Any, Any]:
    """Its ModelConfig and its sizes (checked as Reference's are)."""
    from asyncrl.hybrid.models import ModelConfig
    from asyncrl.hybrid.roles import scoring_sizes
    from asyncrl.hybrid.settings import from_dict

    sizes = scoring_sizes("RewardModel", micro_batch_size, max_tokens_per_micro_batch)
    return from_dict(ModelConfig, model, "RewardModel model="), sizes


class RewardModel(Worker):
    """A value model (backbone + scalar head) whose value at each sequence's last real token
    is its reward. From a local checkpoint, its head is the checkpoint's (transformers'
    *ForSequenceClassification, OpenRLHF's or TRL's value head; none is an error); from a
    preset, a random one drawn from the seed (a stand-in for tests and benchmarks). Each
    rank scores its rows in micro-batches, as Reference does: of `micro_batch_size` rows (4
    by default; None: all at once) or of `max_tokens_per_micro_batch` tokens."""

    def __init__(self, model: dict[str, Any], micro_batch_size: int | None = 4,
                 max_tokens_per_micro_batch: int | None = None):
        from asyncrl.hybrid.models import build_value_model, default_device

        cfg, self.sizes = _model_settings(model, micro_batch_size, max_tokens_per_micro_batch)
        self.whole = micro_batch_size is None
        self.model = build_value_model(cfg, require_head=True)
        if cfg.path is None:
            with torch.random.fork_rng(devices=[]), torch.no_grad():  # (drawn on the CPU:
                torch.random.default_generator.manual_seed(cfg.seed + 1)  # CUDA's left alone)
                torch.nn.init.normal_(self.model.value_head.weight,
                                      std=self.model.value_head.in_features ** -0.5)
        self.model.to(default_device())

    @classmethod
    def check_settings(cls, *args: Any, **kwargs: Any) -> None:
        """Its model=, where the group is declared (as Policy.check_settings)."""
        from asyncrl.hybrid.settings import own_arguments

        given = own_arguments(cls, RewardModel.__init__, args, kwargs)
        if given is not None:
            _model_settings(given["model"], given["micro_batch_size"],
                            given["max_tokens_per_micro_batch"])

    @register(dispatch=Dispatch.DP)
    @torch.no_grad()
    def score(self, batch: TensorBatch) -> TensorBatch:
        from asyncrl.hybrid.micro import micro_batches

        # a rank's whole chunk in one forward ran out of memory (2048 rows of 1.5k tokens
        # on a 7B model); a DP chunk's padding rows are not scored: given the last real one's
        real = batch.real_rows
        rows = batch.slice(0, real) if real < len(batch) else batch
        micros, order = micro_batches(  # (as Reference's: no parameters gathered)
            rows, max(len(rows), 1) if self.whole else self.sizes.micro_batch_size,
            self.sizes.max_tokens_per_micro_batch, agree=False)
        parts = [self._scores(m) for m in micros]
        scores = torch.cat(parts) if parts else torch.zeros(0)
        scores = scores if order is None else scores[order.argsort()]
        bad = (~scores.isfinite()).nonzero().flatten().tolist()
        if bad:  # (one NaN made a whole PPO batch's advantages NaN after whitening)
            raise ValueError(f"RewardModel scored {scores[bad[:5]].tolist()} for row(s) "
                             f"{bad[:5]}{' ...' if len(bad) > 5 else ''} of this rank's "
                             f"{len(rows)} rows; a reward must be a finite number: check "
                             f"the checkpoint's head and weights for NaN or inf, and use "
                             f"dtype 'bfloat16' or 'float32' where float16 overflows")
        return TensorBatch({"reward": _padded(scores, len(batch))})

    def _scores(self, batch: TensorBatch) -> torch.Tensor:
        """The value at each row's last real token."""
        from asyncrl.hybrid.models import joined, positions

        ids, mask, rmask = joined(self.model, batch.tensor("prompt_ids"),
                                  batch.tensor("prompt_mask"), batch.tensor("response_ids"),
                                  batch.tensor("response_mask"))
        values = self.model(input_ids=ids, attention_mask=mask, position_ids=positions(mask))
        last = ids.shape[1] - rmask.shape[1] + rmask.sum(1) - 1  # each row's last real token
        return values[torch.arange(len(batch)), last].float().cpu()


def row_inputs(fn: Callable[..., Any], batch: TensorBatch, tok: Any = None
               ) -> list[tuple[Any, Any, dict[str, Any]]]:
    """(prompt, response, meta) of each row, as `fn` takes them; with a tokenizer, text."""
    # as Python lists once: indexing tensors row by row costs more than most rewards do
    ids, mask = batch.tensor("response_ids").tolist(), batch.tensor("response_mask").tolist()
    prompts = batch["prompt"] if "prompt" in batch else [None] * len(batch)
    columns = {k: batch[k] for k in batch.keys() if k not in RESERVED and
               isinstance(batch[k], list)}
    if "turns" in batch:  # a multi-turn rollout's: its response holds the env's tokens too
        columns["turns"] = batch.tensor("turns").tolist()
    meta_keys = taken_by(fn, list(columns))
    rows = []
    for i in range(len(batch)):
        response: Any = [t for t, m in zip(ids[i], mask[i], strict=True) if m]
        prompt = prompts[i]
        if tok is not None:
            response = tok.decode(response, skip_special_tokens=True)
            if isinstance(prompt, list):
                prompt = tok.decode(prompt, skip_special_tokens=True)
        rows.append((prompt, response, {k: columns[k][i] for k in meta_keys}))
    return rows


def is_number(x: Any) -> bool:
    """A finite int or float (one a float holds), not a bool."""
    if not isinstance(x, int | float) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int past a float's range (10 ** 400)
        return False


def checked(fn: Callable[..., Any], value: Any, row: int) -> float:
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # a numpy or torch scalar: as a process pool's child sends it
    if isinstance(value, bool):  # `return answer == truth`: 1 or 0, as verl takes it
        return float(value)
    if not is_number(value):  # (an int's repr may be thousands of digits: past its limit)
        shown = f"an int of {value.bit_length()} bits" if isinstance(value, int) else \
            repr(value)
        raise ValueError(f"reward function {getattr(fn, '__name__', fn)!r} returned "
                         f"{shown} for row {row}; it must return a finite number (or a "
                         f"bool: 1 or 0)")
    return float(value)


def _padded(values: torch.Tensor, rows: int) -> torch.Tensor:
    """`values` of a chunk's real rows, its padding rows given the last one's (0: none)."""
    if len(values) == rows:
        return values
    last = values[-1:] if len(values) else torch.zeros(1, dtype=values.dtype)
    return torch.cat([values, last.expand(rows - len(values))])


def row_named(i: int, prompt: Any) -> str:
    """Row `i` in a reward function's errors: one text in this process and in a pool."""
    return f"row {i} of this rank's rows (prompt {str(prompt)[:80]!r})"


def score_rows(fn: Callable[..., float], batch: TensorBatch, tok: Any = None) -> torch.Tensor:
    """`fn` on each row, in this process; with a tokenizer `tok`, on text."""
    scores = []
    for i, (p, r, m) in enumerate(row_inputs(fn, batch, tok)):
        try:
            value = fn(p, r, **m)
        except Exception as e:  # its own type and traceback, and where: as the pool says
            add_note(e, f"in reward function {getattr(fn, '__name__', fn)!r} on "
                        f"{row_named(i, p)}")
            raise
        except (SystemExit, KeyboardInterrupt, GeneratorExit) as e:  # else the rank's end,
            raise RuntimeError(  # or a failure naming no row
                f"reward function {getattr(fn, '__name__', fn)!r} raised "
                f"{type(e).__name__}({e}) on {row_named(i, p)}; a reward function returns "
                f"a number or raises an Exception") from e
        scores.append(checked(fn, value, i))
    return torch.tensor(scores, dtype=torch.float32)


@dataclass(frozen=True, kw_only=True)
class Overlong:
    """DAPO's soft overlong punishment (verl's reward_model.overlong_buffer): a response
    longer than `max_length - buffer` tokens loses `penalty_factor` x the share of the
    buffer it runs into, down to -penalty_factor at `max_length` (the generation limit)."""

    max_length: int
    buffer: int
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("max_length", "buffer", "penalty_factor"):
            if not is_number(getattr(self, name)):  # (NaN or inf: NaN or -inf rewards)
                raise ValueError(f"RewardFn(overlong=): {name} must be a finite number, got "
                                 f"{getattr(self, name)!r}")
        if not 1 <= self.buffer <= self.max_length or self.penalty_factor < 0:
            raise ValueError(f"RewardFn(overlong=): give 1 <= buffer <= max_length (the "
                             f"generation's max_new_tokens) and penalty_factor >= 0, got "
                             f"buffer={self.buffer}, max_length={self.max_length}, "
                             f"penalty_factor={self.penalty_factor}")

    def penalty(self, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """Each response's penalty, never below -penalty_factor: a response past max_length
        (an evaluation generating more than training's max_new_tokens, `width` wide) loses
        that much, not more (at max_length=100, buffer=20, a 256-token one lost 8.8x)."""
        over = lengths.float() - (self.max_length - self.buffer)
        return (-over / self.buffer * self.penalty_factor).clamp(-self.penalty_factor, 0.0)


def overlong_config(overlong: dict[str, Any]) -> Overlong:
    known = {f.name for f in fields(Overlong)}
    if not isinstance(overlong, dict) or set(overlong) - known:
        raise TypeError(f"RewardFn(overlong=) is a dict with keys {sorted(known)} "
                        f"(max_length and buffer required), got {overlong!r}")
    return Overlong(**overlong)


class RewardFn(Worker):
    """A reward group running `fn` (a module-level function: it travels by reference), on
    token ids, or on text with `tokenizer` (a local tokenizer directory). With `overlong`
    ({"max_length": N, "buffer": B, "penalty_factor": 1.0}, see `Overlong`) the reward is
    fn's score plus the overlong penalty, and the scores hold both parts ("score",
    "overlong_penalty": dynamic sampling may filter on "score", as verl's DAPO on "acc").
    With `processes=N` each rank scores its rows N at a time in child processes
    (`asyncrl.hybrid.fn_pool`); with `timeout_s` (one process at least) a row whose function runs
    longer scores `timeout_score`, its process replaced, and the scores say which rows timed
    out ("timed_out")."""

    def __init__(self, fn: Callable[..., Any], tokenizer: str | None = None,
                 overlong: dict[str, Any] | None = None, processes: int = 0,
                 timeout_s: float | None = None, timeout_score: float = 0.0):
        from asyncrl.hybrid.fn_pool import pool_for, pool_settings_ok
        from asyncrl.hybrid.user_fn import load_tokenizer

        if not callable(fn):
            raise TypeError(f"RewardFn needs a function, got {fn!r}")
        if tokenizer is not None and not isinstance(tokenizer, str):
            raise TypeError(f"RewardFn(tokenizer=) is a local tokenizer directory (its ranks "
                            f"load it), got {type(tokenizer).__name__}")
        if not pool_settings_ok(processes, timeout_s) or not is_number(timeout_score):
            raise ValueError(f"RewardFn: processes must be an int >= 0, timeout_s a number "
                             f"> 0 (or None) and timeout_score a finite number, got "
                             f"{processes!r}, {timeout_s!r} and {timeout_score!r}")
        self.overlong = overlong_config(overlong) if overlong is not None else None
        self.fn, self.timeout_score = fn, float(timeout_score)
        self.tok = load_tokenizer(tokenizer) if tokenizer is not None else None
        self.pool = pool_for(fn, processes, timeout_s, "reward function")

    @register(dispatch=Dispatch.DP)
    def score(self, batch: TensorBatch) -> TensorBatch:
        # a DP chunk's padding rows (copies of its last row, dropped from the result) are
        # not scored: a paid judge, or a function with side effects, ran twice on one row
        real = batch.real_rows
        rows = batch.slice(0, real) if real < len(batch) else batch
        if self.pool is None:
            scores, out = score_rows(self.fn, rows, self.tok), {}
        else:
            jobs = row_inputs(self.fn, rows, self.tok)
            values, late = self.pool.call(jobs, [row_named(i, p) for i, (p, _, _) in
                                                 enumerate(jobs)])
            scores = torch.tensor([self.timeout_score if t else checked(self.fn, v, i)
                                   for i, (v, t) in enumerate(zip(values, late, strict=True))],
                                  dtype=torch.float32)
            out = {k: _padded(torch.tensor(flags, dtype=torch.float32), len(batch))
                   for k, flags in (("timed_out", late), ("crashed", self.pool.crashed))}
            say_lost(self.pool.name, self.pool.timeout_s, late, self.pool.crashed,
                     f"they score {self.timeout_score}", "timed_out and crashed say which")
        scores = _padded(scores, len(batch))
        if self.overlong is None:
            return TensorBatch({"reward": scores, **out})
        rmask = batch.tensor("response_mask")
        penalty = self.overlong.penalty(rmask.sum(1), rmask.shape[1])
        return TensorBatch({"reward": scores + penalty, "score": scores,
                            "overlong_penalty": penalty, **out})

    def on_close(self) -> None:
        if self.pool is not None:  # else the children, which share the rank's output
            self.pool.close()  # pipe, would keep its last lines from being read

    @register
    def scorer_pids(self) -> list[int]:
        """The pids of this rank's scoring processes (none without `processes`)."""
        return self.pool.pids() if self.pool is not None else []
