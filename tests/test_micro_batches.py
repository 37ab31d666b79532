"""Micro-batches by token budget (verl's use_dynamic_bsz): the cut, and FSDP2 / ZeRO-3 /
Reference groups that train and score with it exactly as without."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from helpers import assert_gone, group_pids, run
from test_backends import one_process_steps

import asyncrl
from asyncrl import TensorBatch
from asyncrl.comm.batch import PAD_KEY
from asyncrl.hybrid.fsdp import TrainConfig, sequence_mean_nll
from asyncrl.hybrid.micro import _cost, in_batch_order, micro_batches, token_runs
from asyncrl.hybrid.models import ModelConfig, build_model, sequence_logprobs, used_columns
from asyncrl.hybrid.roles import Reference, make_backend


def fewest_runs(prompts: list[int], responses: list[int], budget: int) -> int:
    """By brute force: the fewest consecutive runs of the length-sorted rows within budget."""
    order = sorted(range(len(prompts)), key=lambda r: -(prompts[r] + responses[r]))
    n = len(order)
    for k in range(1, n + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            runs = [order[a:b] for a, b in itertools.pairwise(bounds)]
            if all(_cost(prompts, responses, r) <= budget for r in runs):
                return k
    return n


def test_token_runs_stay_within_budget_with_the_fewest_or_the_asked_count():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 7)
        prompts = [rng.randint(1, 6) for _ in range(n)]
        responses = [rng.randint(0, 12) for _ in range(n)]
        budget = rng.randint(4, 60)
        runs = token_runs(prompts, responses, budget)
        assert sorted(r for run in runs for r in run) == list(range(n))  # every row once
        alone = [run for run in runs if _cost(prompts, responses, run) > budget]
        assert all(len(run) == 1 for run in alone)  # only a row too long for any company
        if not alone:
            assert len(runs) == fewest_runs(prompts, responses, budget)
        for count in range(len(runs), n + 1):  # the count the ranks agreed on
            cut = token_runs(prompts, responses, budget, count)
            assert len(cut) == count and all(cut)
            assert sorted(r for run in cut for r in run) == list(range(n))
            worst = max(_cost(prompts, responses, run) for run in cut)
            assert worst <= max(budget, max(_cost(prompts, responses, [r]) for r in range(n)))
    # four short rows and two long ones: the long ones apart, the short ones together
    assert token_runs([2] * 6, [30, 1, 2, 28, 1, 1], budget=40) == [[0], [3], [2, 1, 4, 5]]
    # a row over the budget is alone, and does not raise the budget of the others
    cut = token_runs([1] * 30, [149] + [9] * 29, budget=100, count=4)
    assert cut[0] == [0] and all(_cost([1] * 30, [149] + [9] * 29, r) <= 100 for r in cut[1:])
    with pytest.raises(ValueError, match="5 micro-batches asked of 4 rows"):
        token_runs([1] * 4, [2] * 4, budget=100, count=5)
    with pytest.raises(ValueError, match="more than the 1 asked for"):
        token_runs([2] * 6, [30, 1, 2, 28, 1, 1], budget=40, count=1)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 1"):
        TrainConfig(max_tokens_per_micro_batch=0)


def batch_of(prompt_lens: list[int], response_lens: list[int]) -> TensorBatch:
    """Prompts left-padded to 6 columns, responses right-padded to 24, random tokens."""
    gen, n = torch.Generator().manual_seed(0), len(prompt_lens)
    pm = torch.tensor([[0] * (6 - p) + [1] * p for p in prompt_lens])
    rm = torch.tensor([[1] * r + [0] * (24 - r) for r in response_lens])
    return TensorBatch({"prompt_ids": torch.randint(3, 128, (n, 6), generator=gen) * pm,
                        "prompt_mask": pm,
                        "response_ids": torch.randint(3, 128, (n, 24), generator=gen) * rm,
                        "response_mask": rm})


def ragged_batch() -> TensorBatch:
    """8 rows, prompts of 2-5 tokens, responses of 1-20 tokens: the long ones in the first
    half (rank 0's chunk under dp=2)."""
    return batch_of([3, 5, 2, 4, 3, 2, 5, 4], [20, 17, 3, 2, 2, 1, 3, 2])


def test_micro_batches_keep_padding_rows_trailing_and_results_come_back_in_row_order():
    """A DP chunk's padding rows (copies of its last row, left out of every loss) stay the
    trailing rows of the micro-batches they land in, counted in their meta as `split` counts
    them; results go back to the batch's order (a length order not its own inverse)."""
    batch = batch_of([2, 3, 2, 2], [1, 12, 6, 2]).pad_to(6)  # rows 4, 5: copies of row 3
    micros, order = micro_batches(batch, 8, max_tokens=30, agree=False)
    assert order.tolist()[:3] == [1, 2, 3]  # longest first
    start = 0
    for micro in micros:
        rows = order[start:start + len(micro)].tolist()
        start += len(micro)
        padding = [r >= 4 for r in rows]
        assert padding == sorted(padding)  # real rows first
        assert micro.meta.get(PAD_KEY, 0) == sum(padding)
    assert sum(m.meta.get(PAD_KEY, 0) for m in micros) == 2
    lengths = [m.tensor("response_mask").sum(1, keepdim=True) for m in micros]
    assert torch.equal(in_batch_order(lengths, order, batch),
                       batch.tensor("response_mask").sum(1, keepdim=True))
    empty = batch.slice(0, 0)
    assert in_batch_order(*micro_batches(empty, 8, 30, agree=False), empty).shape == (0, 24)


def test_forward_passes_skip_the_columns_no_row_uses():
    batch = ragged_batch().slice(4, 8)  # prompts from column 1, responses up to column 3
    assert used_columns(batch.tensor("prompt_mask"), batch.tensor("response_mask")) == (1, 3)
    model = build_model(ModelConfig(seed=0))
    widths = []
    model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    cols = [batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    with torch.no_grad():
        logp = sequence_logprobs(model, *cols)
        alone = [sequence_logprobs(model, *[c[i:i + 1] for c in cols]) for i in range(4)]
    assert widths[0] == 5 + 3 and logp.shape == (4, 24)  # 6 + 24 columns without trimming
    assert torch.equal(logp[:, 3:], torch.zeros(4, 21))
    assert torch.allclose(logp, torch.cat(alone), atol=1e-5)


class BudgetTrainer(asyncrl.Worker):
    """FSDP2 or ZeRO-3, noting the shape of each forward pass."""

    def __init__(self, kind: str, model_cfg: dict, train_cfg: dict):
        self.backend = make_backend(self, kind, ModelConfig(**model_cfg), TrainConfig(**train_cfg))
        self.shapes: list[tuple[int, int]] = []
        self.backend.model.register_forward_pre_hook(self._note, with_kwargs=True)

    def _note(self, _module, _args, kwargs) -> None:
        self.shapes.append(tuple(kwargs["input_ids"].shape))

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def step(self, batch: TensorBatch) -> dict:
        return self.backend.train_step(batch)

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def logprobs(self, batch: TensorBatch) -> TensorBatch:
        return TensorBatch({"logprobs": self.backend.logprobs(batch)})

    @asyncrl.register
    def forward_shapes(self) -> list:
        return self.shapes


def test_a_token_budget_trains_and_scores_as_row_micro_batches_do():
    """dp=2 with a budget of 40 tokens: rank 0 (two long rows) needs 3 micro-batches, rank 1
    (short rows) 1; both run 3 forward passes (each gathers the other's shards), none over
    the budget, and the log-probs come back in the batch's row order. FSDP2 and ZeRO-3 take
    the steps one process takes on the whole batch (of 8 rows, then 7: the loss is the mean
    over the 7 real rows, however the ranks and micro-batches hold them); a Reference scores
    alike."""
    pytest.importorskip("deepspeed")
    batch = ragged_batch()
    model_cfg = {"preset": "tiny-llama", "seed": 0}
    train_cfg = {"lr": 3e-3, "max_tokens_per_micro_batch": 40}
    cols = [batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]

    ref = build_model(ModelConfig(**model_cfg)).train()
    with torch.no_grad():
        initial = sequence_logprobs(ref, *cols)
    steps = [batch, batch.slice(0, 7)]  # 7 rows: rank 1 holds 3 and a padding row
    expected = one_process_steps(ref, steps, sequence_mean_nll, 3e-3)

    async def main():
        async with asyncrl.Controller() as ctl:
            out, pids = {}, []
            for kind in ("fsdp2", "zero3"):
                group = await ctl.spawn(BudgetTrainer, kind, model_cfg, train_cfg, nprocs=2,
                                        name=kind)
                pids += group_pids(group)
                logp = (await group.logprobs(batch))["logprobs"]
                losses = [(await group.step(b))[0]["loss"] for b in steps]
                out[kind] = (logp, losses, await group.forward_shapes())
                await ctl.close_group(group)
            scorer = await ctl.spawn(Reference, model_cfg, max_tokens_per_micro_batch=40,
                                     nprocs=2, name="ref")
            pids += group_pids(scorer)
            out["reference"] = (await scorer.logprobs(batch))["logprobs"]
            return out, pids
    out, pids = run(main(), timeout=300)
    assert_gone(pids)
    assert torch.allclose(out["reference"], initial, atol=1e-5)
    for kind in ("fsdp2", "zero3"):
        logp, losses, shapes = out[kind]
        assert torch.allclose(logp, initial, atol=1e-5), kind
        for got, want in zip(losses, expected, strict=True):
            assert abs(got - want) <= 1e-4 * abs(want), (kind, losses, expected)
        # 1 scoring + 2 steps, 3 micro-batches each, on both ranks; each within the budget
        assert [len(s) for s in shapes] == [9, 9], (kind, shapes)
        assert all(rows * width <= 40 for s in shapes for rows, width in s), (kind, shapes)
        assert sorted(rows for rows, _ in shapes[0][:3]) == [1, 1, 2]  # long rows apart
