"""Micro-batches: a rank's rows in pieces of `micro_batch_size` rows, or by a token budget
(verl's use_dynamic_bsz with ppo_max_token_len_per_gpu).

A forward pass costs the rows times the columns some row of the micro-batch uses (the
columns no row uses are trimmed, see `models.used_columns`). By a budget, the rows are sorted
by length and cut into runs whose cost stays within it, so short responses are not padded to
the longest of the batch and a micro-batch of long ones holds few rows. The ranks that shard
one model run the same number of forward passes (each gathers parameters from all of them):
they agree on the largest count any of them needs, and each cuts its rows into that many runs
of the least largest cost.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from asyncrl.comm.batch import PAD_KEY, TensorBatch


def row_lengths(batch: TensorBatch) -> tuple[list[int], list[int]]:
    """Each row's prompt and response lengths (its real tokens)."""
    return (batch.tensor("prompt_mask").sum(1).tolist(),
            batch.tensor("response_mask").sum(1).tolist())


def _cost(prompts: list[int], responses: list[int], rows: list[int]) -> int:
    """The tokens a forward pass over `rows` processes: rows x the columns some row uses."""
    return len(rows) * (max(prompts[r] for r in rows) + max(responses[r] for r in rows))


def _greedy(order: list[int], prompts: list[int], responses: list[int], budget: int
            ) -> list[list[int]]:
    """`order` cut into the fewest consecutive runs that cost at most `budget` each (a row
    that alone costs more is a run of its own)."""
    runs: list[list[int]] = []
    run: list[int] = []
    for r in order:
        if run and _cost(prompts, responses, run + [r]) > budget:
            runs.append(run)
            run = []
        run.append(r)
    return runs + [run] if run else runs


def token_runs(prompts: list[int], responses: list[int], budget: int, count: int | None = None
               ) -> list[list[int]]:
    """Row indices in runs that each cost at most `budget` tokens: the fewest runs, or with
    `count`, exactly that many runs (at most one per row) of the least largest cost."""
    order = sorted(range(len(prompts)), key=lambda r: -(prompts[r] + responses[r]))
    runs = _greedy(order, prompts, responses, budget)
    if count is None:
        return runs
    if count > len(order):  # the ranks hold equal rows (a DP call pads them): a bug upstream
        raise ValueError(f"token_runs: {count} micro-batches asked of {len(order)} rows; the "
                         f"ranks that shard one model must each hold at least as many rows "
                         f"as the micro-batches they agree on")
    if len(runs) > count:
        raise ValueError(f"token_runs: {len(runs)} runs of at most {budget} tokens are needed, "
                         f"more than the {count} asked for")
    # the least budget whose greedy cut needs at most `count` runs (greedy is optimal for
    # consecutive runs of a fixed order; a row over the budget is a run alone and does not
    # raise the others'); then split the runs with the most rows until there are `count` (a
    # split run costs no more than the whole)
    low, high = min(max(_cost(prompts, responses, [r]) for r in order), budget), budget
    while low < high:
        mid = (low + high) // 2
        if len(_greedy(order, prompts, responses, mid)) <= count:
            high = mid
        else:
            low = mid + 1
    runs = _greedy(order, prompts, responses, max(low, 1))
    while len(runs) < count:
        big = max(range(len(runs)), key=lambda i: len(runs[i]))
        run = runs.pop(big)
        runs[big:big] = [run[:len(run) // 2], run[len(run) // 2:]]
    return runs


def agreed(count: int, group: Any) -> int:
    """The largest of the ranks' counts."""
    t = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0])


def micro_batches(batch: TensorBatch, micro_batch_size: int, max_tokens: int | None = None,
                  group: Any = None, agree: bool = True) -> tuple[list[TensorBatch],
                                                                  torch.Tensor | None]:
    """The micro-batches of this rank's rows, and the order they hold the rows in (None: the
    batch's own order; else results concatenated micro-batch by micro-batch are put back with
    `out[order.argsort()]`). By rows when `max_tokens` is None; by the token budget otherwise,
    the count agreed over `group` when `agree` (the ranks that shard one model)."""
    if max_tokens is None or not len(batch):
        return batch.split(micro_batch_size), None
    prompts, responses = row_lengths(batch)
    runs = token_runs(prompts, responses, max_tokens)
    if agree and dist.is_initialized():
        runs = token_runs(prompts, responses, max_tokens, agreed(len(runs), group))
    # a DP chunk's trailing padding rows (copies, left out of every loss) stay trailing in
    # each micro-batch, marked as `split` marks them
    real = batch.real_rows
    runs = [[r for r in run if r < real] + [r for r in run if r >= real] for run in runs]
    micros = []
    for run in runs:
        micro = batch.take(run)
        padding = sum(r >= real for r in run)
        if padding:
            micro.meta[PAD_KEY] = padding
        micros.append(micro)
    return micros, torch.tensor([r for run in runs for r in run], dtype=torch.long)


def in_batch_order(parts: list[torch.Tensor], order: torch.Tensor | None,
                   batch: TensorBatch) -> torch.Tensor:
    """Micro-batches' [rows, response columns] results, concatenated, in the batch's row
    order (none for an empty batch)."""
    if not parts:
        return torch.zeros(0, batch.tensor("response_mask").shape[1])
    out = torch.cat(parts)
    return out if order is None else out[order.argsort()]
