"""GRPO from scratch on a 2-core CPU: a tiny Llama learns to say the next digit.

    asyncrl launch examples/grpo_tiny.py            (make demo)
    asyncrl launch examples/grpo_tiny.py lr=0       (a baseline that must not learn)
    asyncrl launch examples/grpo_tiny.py model_path=/models/Qwen2.5-0.5B  (a GPU machine)
    asyncrl launch examples/grpo_tiny.py lora_rank=8 lr=5e-3   (LoRA: adapters and the head;
        lora_head=False: adapters alone, as a pretrained model with a tied head needs)

    prompts (16 x 8 samples) ──▶ rollout (actor: generate) ──▶ score (reward fn) ──▶ train
                                        └──────────▶ reference (ref) ──────────────────┘
    rollout of step t follows train of step t-1: on-policy (the hybrid engine switches the
    actor's ranks between training and generation in place)
    every `val_every` steps, after train: validate (greedy answers to the ten digits)

Each prompt is sampled `group_size` times; each sample's advantage is its reward against its
group's (GRPO); the KL to the reference is a loss term. metrics.jsonl has reward/mean,
actor/kl, actor/pg_loss, actor/clipfrac, actor/grad_norm, actor/entropy,
response_length/mean, time per node and tokens/s, and val/reward every `val_every` steps.
"""

import math

import next_digit

import asyncrl
from asyncrl.rl import Actor, PromptSource, Reference, RewardFn

cfg = asyncrl.config(steps=60, lr=3e-3, prompts=16, group_size=8, kl_coef=1e-3, seed=0,
                     actor_procs=2, backend="fsdp2", model_path=None, max_new_tokens=2,
                     restarts=3, val_every=20, lora_rank=0, lora_head=True)
tok = next_digit.tokenizer(cfg["model_path"])
model = next_digit.model(tok, cfg["model_path"], cfg["seed"])
if cfg["lora_rank"]:
    # the head trains whole: this random model's frozen one cannot give a confident answer
    # (a pretrained model's can, and one whose head is tied to its embeddings, such as
    # Qwen2.5-0.5B's, must not: lora_head=False)
    model["lora"] = {"rank": cfg["lora_rank"], "alpha": 2 * cfg["lora_rank"],
                     "modules_to_save": ["lm_head"] if cfg["lora_head"] else []}


def reward(prompt, response, answer, **meta):
    return next_digit.score(tok.decode(response), answer)


# a group whose rank dies is respawned up to `restarts` times: the reward fn and the reference
# re-run their node, the actor sends the run back to its last checkpoint (--checkpoint-every)
actor = asyncrl.group(
    Actor, model=model, name="actor", nprocs=cfg["actor_procs"], backend=cfg["backend"],
    max_restarts=cfg["restarts"],
    rl={"algo": "grpo", "group_size": cfg["group_size"], "kl_coef": cfg["kl_coef"]},
    train={"lr": cfg["lr"], "micro_batch_size": 128},
    sampling={"max_new_tokens": cfg["max_new_tokens"], "stop_token_ids": [tok.eos],
              "pad_token_id": tok.pad})
# (given a LoRA model, the reference builds it without adapters: the model LoRA started from;
# a LoRA actor whose adapters alone train is its own reference: actor.ref_logprobs)
ref = asyncrl.group(Reference, model=model, name="ref", micro_batch_size=128,
                    max_restarts=cfg["restarts"])
rewards = asyncrl.group(RewardFn, reward, name="reward", max_restarts=cfg["restarts"])

data = next_digit.records(tok, copies=cfg["prompts"])
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
def reference(rollout):
    return ref.logprobs(rollout)


@asyncrl.node
def train(rollout, score, reference):
    return actor.update(rollout, score, reference)


# validation, as verl's test_freq: each digit once, answered greedily (the actor's calls run
# in order: after this step's update)
val_prompts = next(iter(PromptSource(next_digit.records(tok, copies=1), batch_size=10,
                                     shuffle=False)))


@asyncrl.node
async def validate(step, train):
    if (step + 1) % cfg["val_every"]:
        return {}
    answers = actor.generate(val_prompts, sampling={"temperature": 0})
    return {"val/reward": float((await rewards.score(answers))["reward"].double().mean())}


flow = asyncrl.DataFlow(nodes=[rollout, score, reference, train, validate],
                        inputs={"prompts": prompts}, steps=cfg["steps"])
