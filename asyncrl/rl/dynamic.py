"""DAPO's dynamic sampling (verl's algorithm.filter_groups): a step trains on `groups`
prompt groups whose rewards differ. A group whose samples all scored alike (all right, all
wrong) has advantage 0 everywhere under GRPO: it only dilutes the batch. So the node
generates and scores, keeps the groups whose rewards differ, draws the next prompt batch
while it has too few, and hands on the kept rows of every round as one batch.

    @asyncrl.node(follows="train")
    async def sample(prompts):
        return await dynamic_sampling(prompts, more=source.next_batch,
                                      generate=actor.generate, score=rewards.score,
                                      groups=16, group_size=8, max_rounds=4)
    # then: ref.logprobs(sample["rollout"]), actor.update(sample["rollout"], sample["score"],
    # reference); metrics dapo/rounds, dapo/kept_groups, dapo/uniform_groups, sampled_mean

Only the scores come to the controller (one number per sample); the kept rows are
`fut.rows(...)` of each round's rollout, which the consumers' ranks pull from the ranks that
generated them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from asyncrl.comm.batch import TensorBatch
from asyncrl.errors import AsyncRLError, InputsExhausted
from asyncrl.futures.future import DistFuture, concat
from asyncrl.hybrid.sampler import PROMPT_WIDTH
from asyncrl.rl.batch import SAMPLES_PER_PROMPT, sampling_seeds, shared_seed_group

log = logging.getLogger("asyncrl")
WARN_EVERY = 10  # prompt batches between warnings of a step with no max_rounds


class DynamicSamplingError(AsyncRLError, RuntimeError):
    """Too few groups whose rewards differ within `max_rounds` prompt batches. `drawn`: the
    prompt batch drawn past them (to tell prompts that ran out from more needed), not
    generated: a caller that goes on may use it."""

    drawn: TensorBatch | None = None


class PromptsExhausted(DynamicSamplingError, InputsExhausted):
    """The prompts ran out before a group whose rewards differ was found: the last step of
    a finite run (epochs=) has nothing to train on, and a DataFlow ends the run there."""


def informative_groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """The indices of the groups (consecutive runs of `group_size` samples) whose values
    differ."""
    if values.numel() % group_size:
        raise ValueError(f"dynamic sampling: {values.numel()} samples is not a multiple of "
                         f"group_size={group_size}; sample group_size responses per prompt "
                         f"(PromptSource(..., repeat=group_size))")
    g = values.double().reshape(-1, group_size)
    return (g.max(1).values > g.min(1).values).nonzero().flatten()


def _check_groups(batch: TensorBatch, group_size: int) -> None:
    """Each run of `group_size` rows is one prompt's samples: with PromptSource(repeat=4)
    and group_size=8 a block held two prompts, kept when either's samples differed."""
    # (1: one sample per prompt, repeated later with batch.repeat(k): the seed check below
    # refuses its copies); a block that was part of a prompt's samples was dropped when its
    # part scored alike, or kept halved
    repeat = batch.meta.get(SAMPLES_PER_PROMPT)
    if repeat is not None and repeat > 1 and repeat != group_size:
        raise ValueError(
            f"dynamic sampling: group_size={group_size}, but the PromptSource repeats each "
            f"prompt {repeat} times (repeat={repeat}): a group is all of one prompt's "
            f"samples; give both (and RLConfig group_size) the same value")
    if len(batch) % group_size:
        return  # (informative_groups names a count that does not divide)
    if "prompt" in batch:
        _check_one_prompt(batch, group_size)
    if "seed" in batch:
        _check_distinct_seeds(batch, group_size)


def _check_one_prompt(batch: TensorBatch, group_size: int) -> None:
    column = batch["prompt"]
    prompts = column.tolist() if hasattr(column, "tolist") else list(column)
    for start in range(0, len(prompts), group_size):
        block = prompts[start:start + group_size]
        if any(p != block[0] for p in block):
            raise ValueError(f"dynamic sampling: rows {start}..{start + group_size - 1} are "
                             f"to be one prompt's group_size={group_size} samples, but hold "
                             f"different prompts; give the PromptSource repeat={group_size} "
                             f"(and RLConfig group_size={group_size})")


def _check_distinct_seeds(batch: TensorBatch, group_size: int) -> None:
    """A group's samples each need their own seed: equal seeds draw the same numbers, so the
    samples come out identical, score alike, and no round ever keeps their group."""
    group = shared_seed_group(sampling_seeds(batch)[:, 0], group_size)
    if group is not None:
        start = group * group_size
        raise ValueError(f"dynamic sampling: rows {start}..{start + group_size - 1} are "
                         f"one group, but samples of one group share a sampling seed: "
                         f"they will be identical; use PromptSource(repeat=group_size) "
                         f"(repeat={group_size}), not batch.repeat(k), which copies the "
                         f"seeds too")


async def dynamic_sampling(prompts: TensorBatch, *, more: Callable[[], TensorBatch | None],
                           generate: Callable[[TensorBatch], DistFuture],
                           score: Callable[[DistFuture], DistFuture], groups: int,
                           group_size: int, max_rounds: int | None = None,
                           metric: str | None = None) -> dict[str, Any]:
    """Generate and score `prompts`, then batches from `more()` (a PromptSource's
    next_batch), until `groups` groups whose `metric` column differs are kept (the first
    ones found, in order; a surplus is left out, as verl trims to train_batch_size).

    Returns {"rollout": rows of the rollouts, "score": the same rows of the scores, and the
    metrics dapo/rounds, dapo/kept_groups, dapo/uniform_groups (the share of the groups
    seen whose samples all scored alike), dapo/sampled_mean (the metric's mean over every sample
    generated: the policy's score before the filter)}. More than `max_rounds` batches
    needed (None: no limit) is a DynamicSamplingError, as verl's max_num_gen_batches. If
    `more()` runs out first, the step trains on the groups kept so far (none: PromptsExhausted,
    which ends a DataFlow's run as an input's end does).
    `metric` None: "score" where the scores have it (a RewardFn with an overlong penalty:
    its function's own score, as verl's DAPO filters on "acc"; wrong answers of different
    lengths would else pass for a group whose rewards differ), else "reward"."""
    if groups < 1 or group_size < 2 or (max_rounds is not None and max_rounds < 1):
        raise ValueError(f"dynamic_sampling: groups and max_rounds must be >= 1 and "
                         f"group_size >= 2 (a group's rewards differ between its samples), "
                         f"got {groups}, {group_size} and {max_rounds}")
    kept_rollouts, kept_scores = [], []
    kept = seen = uniform = rounds = 0
    total, samples = 0.0, 0
    batch: TensorBatch | None = prompts
    while batch is not None:
        # before the first round too (else said at the first step that needs a second,
        # hours in, after a wasted generate); max_rounds=1 never joins batches
        if (rounds or max_rounds != 1) and PROMPT_WIDTH not in batch.meta:
            raise ValueError("dynamic_sampling draws more prompts when a batch has too few "
                             "groups whose rewards differ, and their responses join the "
                             "first batch's: give the PromptSource max_prompt_length= so "
                             "that every batch's prompts are padded to one width (or "
                             "max_rounds=1: one batch a step, never joined)")
        _check_groups(batch, group_size)
        rounds += 1
        rollout = generate(batch)
        scores = score(rollout)
        got = await scores  # one number per sample: all that comes here
        column = metric or ("score" if "score" in got else "reward")
        if column not in got:
            raise KeyError(f"dynamic_sampling(metric={metric!r}): the scores have no "
                           f"{column!r} column; they have {got.keys()}")
        values = torch.as_tensor(got[column])
        bad = (~values.double().isfinite()).nonzero().flatten()
        if len(bad):  # (NaN > NaN is False: its group was dropped as scored alike, unsaid)
            raise ValueError(f"dynamic_sampling: {len(bad)} {column}(s) of prompt batch "
                             f"{rounds} are not finite numbers, the first sample {int(bad[0])}"
                             f"'s ({float(values[bad[0]])}); a score must be a finite number: "
                             f"fix the scorer")
        differ = informative_groups(values, group_size)
        seen += len(values) // group_size
        total, samples = total + float(values.double().sum()), samples + len(values)
        uniform += len(values) // group_size - len(differ)
        keep = differ[:groups - kept]
        if len(keep):
            rows = (keep[:, None] * group_size + torch.arange(group_size)).flatten().tolist()
            kept_rollouts.append(rollout.rows(rows))
            kept_scores.append(scores.rows(rows))
            kept += len(keep)
        if kept >= groups:
            break
        # drawn before the limit is checked: prompts that ran out end the step (trained on
        # what was kept) at max_rounds too; the batch drawn goes with the error (a failed
        # run saves no position: it resumes at its last checkpoint's)
        batch = more()
        if batch is not None and rounds == max_rounds:
            error = DynamicSamplingError(
                f"dynamic sampling kept {kept} of the {groups} groups needed after "
                f"{rounds} prompt batches ({seen} groups, {uniform} of them scored alike): "
                f"the prompts are too easy or too hard for the policy now; raise max_rounds "
                f"(verl's max_num_gen_batches) or change the data")
            error.drawn = batch
            raise error
        if batch is not None and max_rounds is None and rounds % WARN_EVERY == 0:
            # no limit: a reward that scores everything alike (a format it never parses)
            # would make this node run on, with nothing said while the step looked hung
            log.warning("asyncrl: dynamic sampling has drawn %d prompt batches and kept %d "
                        "of the %d groups needed (%d of %d groups scored alike); it goes on "
                        "(no max_rounds: set one to stop with an error)", rounds, kept,
                        groups, uniform, seen)
    if not kept:
        raise PromptsExhausted(f"dynamic sampling found no group whose rewards differ in "
                               f"{seen} groups before the prompts ran out")
    return {"rollout": concat(*kept_rollouts), "score": concat(*kept_scores),
            "dapo/rounds": rounds, "dapo/kept_groups": kept,
            "dapo/uniform_groups": uniform / seen, "dapo/sampled_mean": total / samples}
