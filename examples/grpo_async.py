"""GRPO with separate trainer and rollout groups, overlapped under a staleness bound.

    asyncrl launch examples/grpo_async.py                   max_staleness=1 (overlapped)
    asyncrl launch examples/grpo_async.py max_staleness=0   on-policy: the metrics of the
                                                            colocated grpo_tiny.py, same seed

    prompts ──▶ rollout (rollout group) ──▶ score ──▶ train (trainer group) ──▶ sync
                     └──────────▶ reference ─────────┘                           │
    rollout of step t follows sync of step t-1-k: with k >= 1 it runs while the trainer
    still trains step t-1 (on another core), with weights up to k versions old.

`sync` moves the trainer's new weights to every rollout rank in one call: the data plane
pulls them worker to worker (shared memory here) in buckets; a generation in flight picks
them up at its next token. Every token carries the version that sampled it; the trainer
drops samples older than the bound and corrects the rest with truncated importance weights.
The reference runs beside the rollout (the forward passes on one core) and the reward
beside the trainer (the training step on the other), so each core has about the same work a
step: the rollout's core sets the step when overlapped, and the reward is cheap to move.
"""

import math

import next_digit

import asyncrl
from asyncrl.rl import Actor, PromptSource, Reference, RewardFn, Rollout

cfg = asyncrl.config(steps=60, lr=3e-3, prompts=16, group_size=8, kl_coef=1e-3, seed=0,
                     max_staleness=1, correction="tis", trainer_procs=1, rollout_procs=1,
                     backend="fsdp2", model_path=None, max_new_tokens=2)
tok = next_digit.tokenizer(cfg["model_path"])
model = next_digit.model(tok, cfg["model_path"], cfg["seed"])
sampling = {"max_new_tokens": cfg["max_new_tokens"], "stop_token_ids": [tok.eos],
            "pad_token_id": tok.pad}


def reward(prompt, response, answer, **meta):
    return next_digit.score(tok.decode(response), answer)


trainer = asyncrl.group(
    Actor, model=model, name="trainer", nprocs=cfg["trainer_procs"], backend=cfg["backend"],
    hybrid=False, train={"lr": cfg["lr"], "micro_batch_size": 128},
    rl={"algo": "grpo", "group_size": cfg["group_size"], "kl_coef": cfg["kl_coef"],
        "max_staleness": cfg["max_staleness"],
        "correction": cfg["correction"] if cfg["max_staleness"] else "none"})
# nice: on its core the reference, which the trainer waits for, goes first
rollouts = asyncrl.group(Rollout, model=model, sampling=sampling, name="rollout",
                         nprocs=cfg["rollout_procs"], place=asyncrl.separate_from(trainer),
                         nice=5)
# kl_coef=0 (TRL's default beta, DAPO's recipe): no KL term, so no reference model at all
ref = (asyncrl.group(Reference, model=model, name="ref", micro_batch_size=128,
                     place=asyncrl.colocate_with(rollouts)) if cfg["kl_coef"] else None)
rewards = asyncrl.group(RewardFn, reward, name="reward", place=asyncrl.colocate_with(trainer))

data = next_digit.records(tok, copies=cfg["prompts"])
prompts = PromptSource(data, batch_size=cfg["prompts"], seed=cfg["seed"],
                       repeat=cfg["group_size"],
                       epochs=math.ceil(cfg["steps"] * cfg["prompts"] / len(data)))


@asyncrl.node(follows="sync")
def rollout(prompts):
    return rollouts.generate(prompts)


@asyncrl.node
def score(rollout):
    return rewards.score(rollout)


@asyncrl.node
def reference(rollout):
    return ref.logprobs(rollout)


@asyncrl.node
def train(rollout, score, reference=None):  # None: the flow has no reference node
    return trainer.update(rollout, score, reference)


@asyncrl.node
def sync(train):  # after train: the trainer's calls run in order
    return rollouts.load_weights(trainer.sync_pack())


flow = asyncrl.DataFlow(nodes=[rollout, score, train, sync] + ([reference] if ref else []),
                        inputs={"prompts": prompts}, max_staleness=cfg["max_staleness"],
                        steps=cfg["steps"])
