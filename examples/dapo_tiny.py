"""DAPO on a 2-core CPU: the next-digit task of grpo_tiny.py with DAPO's recipe.

    asyncrl launch examples/dapo_tiny.py
    asyncrl launch examples/dapo_tiny.py model_path=/models/Qwen2.5-0.5B  (a GPU machine)

    prompts ──▶ sample: generate + score, and more prompt batches until `prompts` groups
                whose rewards differ are kept ──▶ train (their rows, pulled from the ranks
                that generated them)
    sample of step t follows train of step t-1: on-policy (the hybrid engine)

DAPO (Yu et al., 2025) as verl's recipe sets it: dynamic sampling (a group whose samples all
scored alike has advantage 0 and is left out, and the batch is refilled from new prompts),
clip-higher (the ratio clipped to [1 - 0.2, 1 + 0.28]), token-mean loss, no KL term and so no
reference. Micro-batches by token budget. metrics.jsonl has dapo/rounds (prompt batches
generated for the step), dapo/kept_groups, dapo/uniform_groups (the share of groups whose
samples all scored alike), dapo/sampled_mean (the reward before the filter) and the actor's
update metrics (reward/*, actor/*; no KL and no validation here).
`max_rounds` bounds the batches a step may draw: past it the run stops with the counts
(verl's max_num_gen_batches); the ten prompts of this task are learned for good within a
few dozen steps, after which every group scores alike.
"""

import next_digit

import asyncrl
from asyncrl.rl import Actor, PromptSource, RewardFn, dynamic_sampling

cfg = asyncrl.config(steps=20, lr=3e-3, prompts=16, group_size=8, clip_high=0.28, seed=0,
                     actor_procs=2, model_path=None, max_new_tokens=2, max_rounds=8,
                     restarts=3)
tok = next_digit.tokenizer(cfg["model_path"])
model = next_digit.model(tok, cfg["model_path"], cfg["seed"])


def reward(prompt, response, answer):
    return next_digit.score(tok.decode(response), answer)


actor = asyncrl.group(
    Actor, model=model, name="actor", nprocs=cfg["actor_procs"], max_restarts=cfg["restarts"],
    rl={"algo": "grpo", "group_size": cfg["group_size"], "clip_high": cfg["clip_high"],
        "agg": "token-mean"},
    train={"lr": cfg["lr"], "max_tokens_per_micro_batch": 4096},
    sampling={"max_new_tokens": cfg["max_new_tokens"], "stop_token_ids": [tok.eos],
              "pad_token_id": tok.pad})
rewards = asyncrl.group(RewardFn, reward, name="reward", max_restarts=cfg["restarts"])

# one reading position for the flow's input and the batches `sample` draws beside it (a
# checkpoint saves it); max_prompt_length pads every batch's prompts to one width, so the
# rows kept from separate batches make one batch
source = PromptSource(next_digit.records(tok, copies=cfg["prompts"]), batch_size=cfg["prompts"],
                      seed=cfg["seed"], repeat=cfg["group_size"], epochs=None,
                      max_prompt_length=32)


@asyncrl.node(follows="train")
async def sample(prompts):
    return await dynamic_sampling(prompts, more=source.next_batch, generate=actor.generate,
                                  score=rewards.score, groups=cfg["prompts"],
                                  group_size=cfg["group_size"], max_rounds=cfg["max_rounds"])


@asyncrl.node
def train(sample):
    return actor.update(sample["rollout"], sample["score"])


# the source never runs out (epochs=None): the flow's own step count ends the run
flow = asyncrl.DataFlow(nodes=[sample, train], inputs={"prompts": source}, steps=cfg["steps"])
