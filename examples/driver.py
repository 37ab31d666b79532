"""A small driver: two SPMD worker groups, futures passed from one to the other.

    asyncrl launch examples/driver.py        (`make demo` runs examples/grpo_tiny.py)

    prompts ──▶ sampler (2 ranks, DP) ──▶ scorer (1 rank) ──▶ mean reward (all-reduce)

The sampler's ranks each get half the prompts and sample "responses" from a tiny random
policy; the scorer rewards responses by how often they contain token 4. A collective runs
inside a method
(all-reduce across the sampler's ranks), so calls must reach every rank in the same order.
"""

import asyncio
import time

import torch
import torch.distributed as dist

import asyncrl
from asyncrl import Dispatch, TensorBatch

VOCAB, LENGTH = 16, 8


class Sampler(asyncrl.Worker):
    def __init__(self, seed: int):
        torch.manual_seed(seed)  # the same policy on every rank
        self.logits = torch.randn(VOCAB)

    @asyncrl.register(dispatch=Dispatch.DP)
    def sample(self, prompts: TensorBatch) -> TensorBatch:
        gen = torch.Generator().manual_seed(1000 + self.rank)
        probs = torch.softmax(self.logits, -1)
        tokens = torch.multinomial(probs.expand(len(prompts), -1), LENGTH, replacement=True,
                                   generator=gen)
        return TensorBatch({"prompt": prompts["prompt"], "tokens": tokens,
                            "rank": [self.rank] * len(prompts)})

    @asyncrl.register
    def mean(self, value: float) -> float:
        t = torch.tensor([value])
        dist.all_reduce(t)
        return t.item() / self.world_size


class Scorer(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.RANK_ZERO)
    def score(self, batch: TensorBatch) -> list[float]:
        return (batch["tokens"] == 4).float().mean(dim=1).tolist()


async def main() -> None:
    async with asyncrl.Controller() as ctl:
        t0 = time.perf_counter()
        sampler, scorer = await asyncio.gather(
            ctl.spawn(Sampler, 0, nprocs=2, name="sampler"),
            ctl.spawn(Scorer, nprocs=1, name="scorer"))
        print(f"spawned 2 groups (3 ranks) in {time.perf_counter() - t0:.1f} s")

        prompts = TensorBatch({"prompt": torch.arange(6)})
        responses = sampler.sample(prompts)  # a DistFuture, at once
        rewards = scorer.score(responses)  # the future is an argument
        batch, rewards = await responses, await rewards
        for p, r, tok, w in zip(batch["prompt"].tolist(), batch["rank"], batch["tokens"],
                                rewards, strict=True):
            print(f"prompt {p} (rank {r}): {tok.tolist()} reward {w:.3f}")
        means = await sampler.mean(sum(rewards) / len(rewards))
        print(f"mean reward, all-reduced on both sampler ranks: {means}")

        t0 = time.perf_counter()
        await asyncio.gather(*(sampler.mean(1.0) for _ in range(200)))
        dt = time.perf_counter() - t0
        print(f"200 all-reduce calls in flight: {dt * 1e3:.0f} ms ({200 / dt:.0f} calls/s)")


if __name__ == "__main__":
    asyncrl.run(main())
