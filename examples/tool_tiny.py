"""Multi-turn GRPO with a tool on a 2-core CPU: a tiny Llama learns to look a value up.

    asyncrl launch examples/tool_tiny.py
    asyncrl launch examples/tool_tiny.py lr=0       (a baseline that must not learn)

    prompts ──▶ rollout: turn 0 ─▶ lookup(...) ─▶ turn 1 ──▶ score ──▶ train
    (the actor's ranks generate each turn; the environment runs on them between turns)

Each prompt "k>" asks for the value filed under key k, a digit drawn at random for each
record: no policy can know it. The tool call is the token "?" (a stop token: the turn ends
there); the environment `lookup` answers a call with "=v", the value, and the next turn
should repeat it: "?" "=v" "v". The reward is 1 for a looked-up answer that repeats the value
(what follows it is not read), else 0: a guess without the tool earns nothing, and the
policy has to find the call by sampling it (about one token in 16 at first). The observation's
tokens are in the response the trainer reads but out of every loss (policy_mask).
metrics.jsonl adds multi_turn/turns (turns per sample) and
multi_turn/env_tokens (observation tokens per sample) to the actor's update metrics
(reward/*, actor/*; no reference, so no KL, and no validation node).
"""

import math
import random

import next_digit

import asyncrl
from asyncrl.rl import Actor, PromptSource, RewardFn

cfg = asyncrl.config(steps=120, lr=3e-3, prompts=16, group_size=8, seed=0, actor_procs=2,
                     restarts=3)


class ToolVocab(next_digit.Vocab):
    """next_digit's vocabulary with the tool call "?" and the observation marker "="."""

    chars = next_digit.DIGITS + ">?="


tok = ToolVocab()
CALL, SAYS = tok.encode("?=")[1:]
model = next_digit.model(tok, None, cfg["seed"])


def records(count, seed):
    """`count` prompts "k>", each with its own value: the answer only the tool knows."""
    rng = random.Random(seed)
    return [{"prompt": tok.encode(f"{rng.randrange(10)}>"), "answer": str(rng.randrange(10))}
            for _ in range(count)]


def lookup(prompt, response, answer):
    """The environment: a turn that ends with a call gets "=" and the value; else done."""
    if response and response[-1] == CALL:
        return [SAYS, tok.encode(answer)[1]]
    return None


def reward(prompt, response, answer):
    text = tok.decode(response)  # e.g. "?=73": a call, the value 7, the answer 3
    return 1.0 if text.startswith("?=") and text[3:4] == answer else 0.0


actor = asyncrl.group(
    Actor, model=model, name="actor", nprocs=cfg["actor_procs"], max_restarts=cfg["restarts"],
    rl={"algo": "grpo", "group_size": cfg["group_size"], "kl_coef": 0.0},
    train={"lr": cfg["lr"], "micro_batch_size": 128},
    # 5 tokens: the call, the observation's two, the answer and its end
    sampling={"max_new_tokens": 5, "stop_token_ids": [tok.eos, CALL], "pad_token_id": tok.pad},
    multi_turn={"env": lookup, "max_turns": 2, "max_observation_tokens": 2})
rewards = asyncrl.group(RewardFn, reward, name="reward", max_restarts=cfg["restarts"])

data = records(256, cfg["seed"])
prompts = PromptSource(data, batch_size=cfg["prompts"], seed=cfg["seed"],
                       repeat=cfg["group_size"],
                       epochs=math.ceil(cfg["steps"] * cfg["prompts"] / len(data)))


@asyncrl.node(follows="train")
def rollout(prompts):
    return actor.generate(prompts)


@asyncrl.node
def score(rollout):
    return rewards.score(rollout)


@asyncrl.node
def train(rollout, score):
    return actor.update(rollout, score)


flow = asyncrl.DataFlow(nodes=[rollout, score, train], inputs={"prompts": prompts},
                        steps=cfg["steps"])
