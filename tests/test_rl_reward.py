"""A reward function on its own group, fed straight from a generating group's results."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_gone, group_pids, run

import asyncrl
from asyncrl import TensorBatch
from asyncrl.rl import RewardFn
from asyncrl.rl.reward import score_rows


def count_answer(prompt, response, answer):
    """1 if the response contains the answer token, else the share of tokens equal to it."""
    return 1.0 if answer in response[:1] else response.count(answer) / max(1, len(response))


def broken(prompt, response, answer):
    return "high"


def rollout_like(n: int) -> TensorBatch:
    ids = torch.tensor([[5, 6, 0], [7, 5, 5], [6, 6, 6], [5, 0, 0]])[:n]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])[:n]
    return TensorBatch({"response_ids": ids, "response_mask": mask,
                        "prompt": [f"q{i}" for i in range(n)], "answer": [5] * n})


def test_score_rows_by_hand():
    assert score_rows(count_answer, rollout_like(4)).tolist() == pytest.approx(
        [1.0, 2 / 3, 0.0, 1.0])
    with pytest.raises(ValueError, match="returned 'high' for row 0; it must return a finite"):
        score_rows(broken, rollout_like(1))


class Producer(asyncrl.Worker):
    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def rollout(self, index: TensorBatch) -> TensorBatch:
        return rollout_like(4).slice(int(index["i"][0]), int(index["i"][-1]) + 1)


def test_reward_group_scores_rows_pulled_from_another_group():
    async def main():
        async with asyncrl.Controller() as ctl:
            producer = await ctl.spawn(Producer, nprocs=2)
            reward = await ctl.spawn(RewardFn, count_answer, nprocs=1, name="reward")
            pids = group_pids(producer) + group_pids(reward)
            scores = await reward.score(producer.rollout(TensorBatch({"i": torch.arange(4)})))
            assert ctl.payload_bytes == 0
            return scores, pids
    scores, pids = run(main())
    assert_gone(pids)
    assert scores["reward"].tolist() == pytest.approx([1.0, 2 / 3, 0.0, 1.0])
