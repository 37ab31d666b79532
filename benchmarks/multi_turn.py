"""Multi-turn benchmark: what the turns cost the built-in engine, in one process, four ways
in the same run on the same model and prompts:

  single_turn        one generation of `budget` tokens per row, no stop token
  multi_turn         turns ended by stop tokens (1 vocabulary id in 64: about 64 tokens a
                     turn), an environment answering each with 16 tokens, until the
                     budget is spent or 8 turns; continued inside the engine's decode loop
                     (the observation fed through the KV cache as the row's turn ends)
  multi_turn_calls   the same turns as one generate call per turn, as the vLLM adapter runs
                     them: each turn waits for the batch's longest and prefills rows again
  multi_turn_procs   multi_turn with the environment in 2 child processes (the pool a tool
                     with a timeout runs in: a message round trip per call)

One JSON line per way: {"bench": "multi_turn", "system": ..., "s": (median of the repeats
after one untimed warm-up),
"sampled_tokens_per_s": (the policy's tokens), "response_tokens": (observations included),
"turns_mean": ...}. Run: `.venv/bin/python benchmarks/multi_turn.py [--rows 32]
[--budget 256] [--repeat 3]`. Driver code stays behind __main__ (the pool's processes
import this file to find `tool`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch
from machine import describe, version

MODEL = {"preset": "tiny-llama", "overrides": {
    "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 4096,
    "max_position_embeddings": 1024}}
OBSERVATION = list(range(100, 116))  # 16 tokens


def tool(prompt, response, turn):
    """The environment: the same 16 tokens after every turn."""
    return OBSERVATION


def measure(run, repeat: int) -> tuple[float, object]:
    run()  # untimed warm-up: the first run also starts a pool's processes and fills caches
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    from asyncrl import TensorBatch
    from asyncrl.hybrid.models import ModelConfig, build_model
    from asyncrl.hybrid.sampler import Sampler, SamplingConfig
    from asyncrl.hybrid.turns import MultiTurn, Turns

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sampler = Sampler(build_model(ModelConfig(**MODEL)).eval())
    prompts = [torch.randint(3, 4096, (32,)).tolist() for _ in range(args.rows)]
    seeds = list(range(args.rows))
    batch = TensorBatch({"prompt": prompts, "seed": seeds})
    single = SamplingConfig(max_new_tokens=args.budget)
    stopping = SamplingConfig(max_new_tokens=args.budget,
                              stop_token_ids=tuple(range(200, 4096, 64)))
    systems = {"single_turn": lambda: sampler.generate(prompts, seeds, single)}
    pools = {}
    calls = SimpleNamespace(generate=sampler.generate)  # no turn loop of its own
    for name, processes, engine in (("multi_turn", 0, sampler), ("multi_turn_calls", 0, calls),
                                    ("multi_turn_procs", 2, sampler)):
        turns = pools[name] = Turns(MultiTurn(env=tool, max_turns=8, processes=processes,
                                              max_observation_tokens=len(OBSERVATION)))
        systems[name] = lambda t=turns, e=engine: t.generate(e, batch, prompts, seeds,
                                                             stopping)
    try:
        for name, run in systems.items():
            s, out = measure(run, args.repeat)
            mask = out["response_mask"]
            sampled = mask * out["policy_mask"] if "policy_mask" in out else mask
            print(json.dumps({
                "bench": "multi_turn", "system": name, "rows": args.rows,
                "budget": args.budget, "s": round(s, 3),
                "sampled_tokens_per_s": round(float(sampled.sum()) / s, 1),
                "response_tokens": int(mask.sum()),
                "turns_mean": float(out["turns"].float().mean()) if "turns" in out else 1.0,
                "repeat": args.repeat, "warmup": 1, "torch": torch.__version__,
                **describe(torch=torch.__version__, transformers=version("transformers"),
                           asyncrl=version("asyncrl"))}), flush=True)
    finally:
        for turns in pools.values():
            turns.close()


if __name__ == "__main__":
    main()
