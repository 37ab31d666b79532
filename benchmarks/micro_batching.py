"""Micro-batching benchmark: one FSDP2 train step over a batch of RL-shaped sequences
(prompts of 16-64 tokens, responses long-tailed from 8 to 512), three ways in the same run:

  padded        micro-batches of `micro_batch_size` rows over all the batch's columns (as
                verl computes without use_remove_padding or use_dynamic_bsz; asyncrl before
                it trimmed columns)
  rows          the same micro-batches, each trimmed to the columns its rows use (as a
                collator that pads per micro-batch: transformers' Trainer's)
  token_budget  rows sorted by length and cut by `max_tokens_per_micro_batch` (verl's
                use_dynamic_bsz), the budget no larger than a padded micro-batch

One JSON line per way: {"bench": "micro_batching", "mode": ..., "step_s": ...,
"tokens_per_s": (real tokens), "computed_tokens": (rows x columns over the micro-batches),
"largest_micro_tokens": (what bounds activation memory), "loss": ...}; the losses agree.
Run: `.venv/bin/python benchmarks/micro_batching.py [--rows 32] [--repeat 3]`. Driver code
stays behind __main__ (the rank imports this file to find MicroBench).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch
from machine import describe, version

import asyncrl
from asyncrl import TensorBatch
from asyncrl.hybrid import models
from asyncrl.hybrid.fsdp import FSDPBackend, TrainConfig

MODEL = {"preset": "tiny-llama", "overrides": {
    "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 4096,
    "max_position_embeddings": 1024}}
PROMPT, RESPONSE = 64, 512


def rl_batch(rows: int, seed: int = 0) -> TensorBatch:
    """Left-padded prompts of 16-64 tokens, right-padded responses of log-normal length
    (median 96, clipped to 8-512): most short, a few near the limit, as sampled answers are."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    plens = [rng.randint(16, PROMPT) for _ in range(rows)]
    rlens = [min(RESPONSE, max(8, int(math.exp(rng.gauss(math.log(96), 0.8)))))
             for _ in range(rows)]
    pm = torch.tensor([[0] * (PROMPT - p) + [1] * p for p in plens])
    rm = torch.tensor([[1] * r + [0] * (RESPONSE - r) for r in rlens])
    return TensorBatch({"prompt_ids": torch.randint(3, 4096, (rows, PROMPT), generator=gen) * pm,
                        "prompt_mask": pm,
                        "response_ids": torch.randint(3, 4096, (rows, RESPONSE),
                                                      generator=gen) * rm,
                        "response_mask": rm})


class MicroBench(asyncrl.Worker):
    def __init__(self, train: dict, trim: bool):
        if not trim:  # every forward pass over all the batch's columns
            models.used_columns = lambda pm, rm: (0, rm.shape[1])
        # lr 0: every repeat trains the same weights (the steps' losses comparable)
        self.backend = FSDPBackend(models.ModelConfig(**MODEL), TrainConfig(lr=0.0, **train),
                                   self.device_mesh)
        self.computed: list[int] = []
        self.backend.model.register_forward_pre_hook(
            lambda _m, _a, kw: self.computed.append(kw["input_ids"].numel()), with_kwargs=True)

    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def steps(self, batch: TensorBatch, repeat: int) -> dict:
        times, loss = [], 0.0
        for _ in range(repeat + 1):  # the first warms the allocator
            self.computed.clear()
            t0 = time.perf_counter()
            loss = self.backend.train_step(batch)["loss"]
            times.append(time.perf_counter() - t0)
        return {"step_s": statistics.median(times[1:]), "loss": loss,
                "computed_tokens": sum(self.computed), "largest": max(self.computed)}


MODES = {"padded": ({"micro_batch_size": 8}, False), "rows": ({"micro_batch_size": 8}, True),
         "token_budget": ({"max_tokens_per_micro_batch": 8 * (PROMPT + RESPONSE)}, True)}


async def bench(rows: int, repeat: int) -> None:
    batch = rl_batch(rows)
    real = int(batch.tensor("prompt_mask").sum() + batch.tensor("response_mask").sum())
    async with asyncrl.Controller(construct_timeout=600) as ctl:
        for mode, (train, trim) in MODES.items():
            group = await ctl.spawn(MicroBench, train, trim, nprocs=1, name=mode)
            got = await group.steps(batch, repeat)
            print(json.dumps({"bench": "micro_batching", "mode": mode, "rows": rows,
                              "real_tokens": real, "step_s": round(got["step_s"], 3),
                              "tokens_per_s": round(real / got["step_s"]),
                              "computed_tokens": got["computed_tokens"],
                              "largest_micro_tokens": got["largest"],
                              "loss": round(got["loss"], 6), "train": train,
                              "repeat": repeat, "torch": torch.__version__,
                              **describe(torch=torch.__version__,
                                         transformers=version("transformers"),
                                         asyncrl=asyncrl.__version__)}), flush=True)
            await ctl.close_group(group)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    asyncrl.run(bench(args.rows, args.repeat))


if __name__ == "__main__":
    main()
