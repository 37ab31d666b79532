"""A small pipeline declared as a DataFlow (CPU): sample, score, reference, update.

    asyncrl launch examples/flow.py --steps 4 lr=0.5

    prompts ──▶ rollout (policy, DP2) ──▶ score (reward) ──▶ train (policy)
                    └────────▶ reference (ref) ─────────────┘
    rollout of step t follows train of step t-1 (it samples with the weights train made)

The "policy" is a table of logits over 16 tokens; train raises the logits of tokens that
scored well, so the mean reward climbs over the steps.
"""

import torch

import asyncrl
from asyncrl import Dispatch, TensorBatch

cfg = asyncrl.config(lr=0.5, steps=4, batch=8, length=8)
VOCAB, GOOD = 16, 4


class Policy(asyncrl.Worker):
    def __init__(self, lr: float):
        self.logits = torch.zeros(VOCAB)
        self.lr = lr

    @asyncrl.register(dispatch=Dispatch.DP)
    def rollout(self, prompts: TensorBatch, length: int) -> TensorBatch:
        gen = torch.Generator().manual_seed(int(prompts["id"].sum()) * 31 + self.rank)
        probs = torch.softmax(self.logits, -1).expand(len(prompts), -1)
        tokens = torch.multinomial(probs, length, replacement=True, generator=gen)
        return TensorBatch({"id": prompts["id"], "tokens": tokens})

    @asyncrl.register
    def train(self, batch: TensorBatch, rewards: list, ref: list | None = None) -> dict:
        r = torch.tensor(rewards)
        adv = r - r.mean()
        counts = torch.zeros(len(r), VOCAB).scatter_add_(
            1, batch["tokens"], torch.ones_like(batch["tokens"], dtype=torch.float))
        grad = (adv[:, None] * counts).mean(0)
        torch.distributed.all_reduce(grad)  # every rank applies the same update
        self.logits += self.lr * grad / self.world_size
        return {"loss": float(-(adv * r).mean()), "p_good": float(
            torch.softmax(self.logits, -1)[GOOD])}

    def save_state(self, folder):  # what `asyncrl launch --resume` continues from
        torch.save(self.logits, folder / f"logits{self.rank}.pt")

    def load_state(self, folder):
        self.logits = torch.load(folder / f"logits{self.rank}.pt")


class Reward(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.RANK_ZERO)
    def score(self, batch: TensorBatch) -> list:
        return (batch["tokens"] == GOOD).float().mean(1).tolist()


class Reference(asyncrl.Worker):
    @asyncrl.register(dispatch=Dispatch.RANK_ZERO)
    def logprob(self, batch: TensorBatch) -> list:
        return [-float(len(t)) * torch.log(torch.tensor(float(VOCAB))).item()
                for t in batch["tokens"]]


policy = asyncrl.group(Policy, cfg["lr"], nprocs=2, name="policy")
reward = asyncrl.group(Reward, nprocs=1, name="reward", place=asyncrl.separate_from(policy))
ref = asyncrl.group(Reference, nprocs=1, name="ref")


def prompts():
    for step in range(cfg["steps"]):
        yield TensorBatch({"id": torch.arange(cfg["batch"]) + step * cfg["batch"]})


@asyncrl.node(follows="train")
def rollout(prompts):
    return policy.rollout(prompts, cfg["length"])


@asyncrl.node
def score(rollout):
    return reward.score(rollout)


@asyncrl.node
def reference(rollout):
    return ref.logprob(rollout)


@asyncrl.node
async def train(rollout, score, reference=None):
    rewards = await score  # an async node may await what it needs on the controller
    stats = await policy.train(rollout, rewards, reference)
    return {"reward": sum(rewards) / len(rewards), **stats[0]}


flow = asyncrl.DataFlow(nodes=[rollout, score, reference, train], inputs={"prompts": prompts()})
