"""PPO from scratch on a 2-core CPU: the next-digit task of grpo_tiny.py, with a critic.

    asyncrl launch examples/ppo_tiny.py            asyncrl launch examples/ppo_tiny.py lr=0
    asyncrl launch examples/ppo_tiny.py model_path=/models/Qwen2.5-0.5B  (a GPU machine)

    prompts ──▶ rollout (actor) ──▶ score (reward fn) ──────────▶ train_actor  (actor)
                     ├──────────▶ reference (ref) ──────────────▶ train_critic (critic)
                     └──────────▶ values (critic) ──────────────▶ (both)

The score lands on each response's last token, the KL to the reference is subtracted from
every token's reward, GAE turns rewards and the critic's values into advantages (whitened
over the batch) and returns; the critic learns the returns with value clipping. The two
updates run at the same time on their own groups.
"""

import math

import next_digit

import asyncrl
from asyncrl.rl import Actor, Critic, PromptSource, Reference, RewardFn

cfg = asyncrl.config(steps=60, lr=3e-3, critic_lr=1e-2, prompts=128, kl_coef=1e-3, seed=0,
                     gamma=1.0, lam=0.95, actor_procs=1, backend="fsdp2", model_path=None,
                     max_new_tokens=2)
tok = next_digit.tokenizer(cfg["model_path"])
model = next_digit.model(tok, cfg["model_path"], cfg["seed"])
algo = {"algo": "ppo", "kl_coef": cfg["kl_coef"], "kl_in_reward": True, "kl_kind": "k1",
        "gamma": cfg["gamma"], "lam": cfg["lam"]}


def reward(prompt, response, answer, **meta):
    return next_digit.score(tok.decode(response), answer)


actor = asyncrl.group(
    Actor, model=model, name="actor", nprocs=cfg["actor_procs"], backend=cfg["backend"], rl=algo,
    train={"lr": cfg["lr"], "micro_batch_size": 128},
    sampling={"max_new_tokens": cfg["max_new_tokens"], "stop_token_ids": [tok.eos],
              "pad_token_id": tok.pad})
critic = asyncrl.group(Critic, model=model, name="critic", rl=algo, backend=cfg["backend"],
                       train={"lr": cfg["critic_lr"], "micro_batch_size": 128})
ref = asyncrl.group(Reference, model=model, name="ref", micro_batch_size=128)
rewards = asyncrl.group(RewardFn, reward, name="reward")

data = next_digit.records(tok, copies=cfg["prompts"])
prompts = PromptSource(data, batch_size=cfg["prompts"], seed=cfg["seed"],
                       epochs=math.ceil(cfg["steps"] * cfg["prompts"] / len(data)))


@asyncrl.node(follows="train_actor")
def rollout(prompts):
    return actor.generate(prompts)


@asyncrl.node
def score(rollout):
    return rewards.score(rollout)


@asyncrl.node
def reference(rollout):
    return ref.logprobs(rollout)


@asyncrl.node(follows="train_critic")
def values(rollout):
    return critic.values(rollout)


@asyncrl.node
def train_actor(rollout, score, reference, values):
    return actor.update(rollout, score, reference, values)


@asyncrl.node
def train_critic(rollout, score, reference, values):
    return critic.update(rollout, score, reference, values)


flow = asyncrl.DataFlow(nodes=[rollout, score, reference, values, train_actor, train_critic],
                        inputs={"prompts": prompts}, steps=cfg["steps"])
