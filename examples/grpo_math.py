"""GRPO on math word problems with a local instruct model: what verl's GSM8K recipe does.

    asyncrl launch examples/grpo_math.py model_path=/models/Qwen2.5-0.5B-Instruct \
        data=gsm8k_train.jsonl val_data=gsm8k_test.jsonl engine=vllm actor_procs=8
    asyncrl export runs/<time> qwen-gsm8k-grpo     (the trained model, Hugging Face format)

Records, JSONL or Parquet: GSM8K's own {"question", "answer": "...worked solution... #### 72"}
(or a bare "72"), or verl's preprocessed parquet {"prompt": [chat], "reward_model":
{"ground_truth": "72"}}. Each question goes into a chat through the model's chat template;
the reward reads the response as text: 1 when its last "#### 72" is the ground truth
(commas ignored), else 0 (verl's strict GSM8K score). Generation
stops at the model's end-of-turn tokens (its generation_config.json, as vLLM does). Every
`val_every` steps the actor answers val_data greedily: val/reward; with val_samples=n, n
samples per question at val_temperature: val/reward (mean@n), val/pass@1 and val/pass@n.

Written for GPUs (a real model, vLLM; never run on one yet). The tests run it on CPUs with
a tiny Llama and a word tokenizer, and export its result.
"""

import math

import torch
from gsm8k import ground_truth, reward  # a module of its own: the reward ranks import it alone

import asyncrl
from asyncrl.rl import (
    Actor,
    PromptSource,
    Reference,
    RewardFn,
    load_tokenizer,
    pass_at_k,
    read_records,
)

cfg = asyncrl.config(model_path=None, data=None, val_data=None, steps=100, prompts=32,
                     group_size=8, lr=1e-6, kl_coef=1e-3, max_prompt_length=512,
                     max_new_tokens=512, micro_batch_size=8, max_tokens_per_micro_batch=0,
                     overlong_buffer=0, reward_timeout_s=0.0, actor_procs=1, backend="fsdp2",
                     engine="builtin", gradient_checkpointing=False, val_every=10, seed=0,
                     val_samples=1, val_temperature=1.0,
                     instruction="Let's think step by step and output the final answer "
                                 "after \"####\".")
if not cfg["model_path"] or not cfg["data"]:
    raise SystemExit("grpo_math.py needs model_path=DIR (a local instruct model) and "
                     "data=FILE (JSONL or Parquet of {\"question\", \"answer\"} records)")
tok = load_tokenizer(cfg["model_path"])


def end_of_turn_ids() -> list[int]:
    """The ids generation stops at: the model's generation_config eos (an instruct model's
    end-of-turn token among them), else the tokenizer's eos."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(cfg["model_path"]).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    eos = tok.eos_token_id if eos is None else eos
    return sorted({eos} if isinstance(eos, int) else set(eos))


def as_chat(record: dict) -> dict:
    """A record as a chat prompt and its ground truth."""
    if "question" in record and "answer" in record:  # GSM8K's own files
        chat = [{"role": "user", "content": f"{record['question']} {cfg['instruction']}"}]
        return {"prompt": chat, "answer": ground_truth(record["answer"])}
    if "prompt" in record and "ground_truth" in (record.get("reward_model") or {}):  # verl's
        return {"prompt": list(record["prompt"]),
                "answer": ground_truth(record["reward_model"]["ground_truth"])}
    raise SystemExit(f"grpo_math.py: a record has the keys {sorted(record)}; give "
                     f"{{\"question\", \"answer\"}} records (GSM8K) or verl's {{\"prompt\", "
                     f"\"reward_model\": {{\"ground_truth\"}}}}")


stops = end_of_turn_ids()
sampling = {"max_new_tokens": cfg["max_new_tokens"], "stop_token_ids": stops,
            "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else stops[0]}
model = {"path": cfg["model_path"]}
actor = asyncrl.group(
    Actor, model=model, name="actor", nprocs=cfg["actor_procs"], backend=cfg["backend"],
    engine=cfg["engine"], sampling=sampling,
    rl={"algo": "grpo", "group_size": cfg["group_size"], "kl_coef": cfg["kl_coef"]},
    # micro-batches of max_tokens_per_micro_batch tokens (verl's use_dynamic_bsz), else of
    # micro_batch_size rows
    train={"lr": cfg["lr"], "micro_batch_size": cfg["micro_batch_size"],
           "max_tokens_per_micro_batch": cfg["max_tokens_per_micro_batch"] or None,
           "gradient_checkpointing": cfg["gradient_checkpointing"]})
ref = asyncrl.group(Reference, model=model, name="ref", micro_batch_size=cfg["micro_batch_size"],
                    max_tokens_per_micro_batch=cfg["max_tokens_per_micro_batch"] or None
                    ) if cfg["kl_coef"] else None
# overlong_buffer > 0: DAPO's soft overlong punishment over the last that many tokens;
# reward_timeout_s > 0: the reward runs in child processes, a row past it scores 0 (a
# verifier such as math_verify may hang on a pathological answer)
rewards = asyncrl.group(RewardFn, reward, tokenizer=cfg["model_path"], name="reward",
                        overlong={"max_length": cfg["max_new_tokens"],
                                  "buffer": cfg["overlong_buffer"]}
                        if cfg["overlong_buffer"] else None,
                        processes=2 if cfg["reward_timeout_s"] else 0,
                        timeout_s=cfg["reward_timeout_s"] or None)

train_records = [as_chat(r) for r in read_records(cfg["data"])]
prompts = PromptSource(train_records, batch_size=cfg["prompts"], seed=cfg["seed"],
                       repeat=cfg["group_size"], tokenizer=tok,
                       max_prompt_length=cfg["max_prompt_length"])
# enough epochs of the prompts kept (overlong ones left out) for `steps` steps
prompts.epochs = math.ceil(cfg["steps"] * cfg["prompts"] / len(prompts.records))
# validation in batches of about a training batch's rows (memory: as a rollout's): each
# question answered greedily, or sampled val_samples times (verl's val_kwargs.n)
val_batches = []
if cfg["val_data"]:
    val_records = [as_chat(r) for r in read_records(cfg["val_data"])]
    val_batches = list(PromptSource(
        val_records, batch_size=max(1, cfg["prompts"] * cfg["group_size"] // cfg["val_samples"]),
        shuffle=False, tokenizer=tok, max_prompt_length=cfg["max_prompt_length"],
        repeat=cfg["val_samples"], seed=cfg["seed"]))


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
def train(rollout, score, reference=None):
    return actor.update(rollout, score, reference)


@asyncrl.node
async def validate(step, train):
    if not val_batches or (step + 1) % cfg["val_every"]:
        return {}
    n = cfg["val_samples"]
    sampling = {"temperature": 0} if n == 1 else {"temperature": cfg["val_temperature"]}
    scores = [rewards.score(actor.generate(batch, sampling=sampling)) for batch in val_batches]
    values = [await s for s in scores]
    reward = torch.cat([v["reward"] for v in values]).double()
    out = {"val/reward": float(reward.mean())}  # mean@n
    if n > 1:  # the share of questions answered right in k of n samples (unbiased)
        right = torch.cat([v["score"] if "score" in v else v["reward"] for v in values]) > 0
        out.update({f"val/pass@{k}": pass_at_k(right, n, k) for k in sorted({1, n})})
    return out


nodes = [rollout, score, train, validate] + ([reference] if ref is not None else [])
flow = asyncrl.DataFlow(nodes=nodes, inputs={"prompts": prompts}, steps=cfg["steps"])
