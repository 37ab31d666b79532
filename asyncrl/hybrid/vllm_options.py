"""What the vLLM adapter (vllm_engine.py) is given, checked without vLLM (also where a group is
declared): its engine options, the keys vLLM's EngineArgs knows, and the sampling settings
whose log-probs vLLM would report otherwise than the trainer computes them."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from asyncrl.hybrid.sampler import SamplingConfig

# LLM keywords the adapter sets itself (engine_options may give any other)
ADAPTER_SETS = {"model", "distributed_executor_backend", "enable_sleep_mode",
                "skip_tokenizer_init", "logprobs_mode", "worker_extension_cls"}
# vLLM's _MAX_TEMP: SamplingParams raises a temperature in (0, 0.01) to 0.01 (before its
# greedy check), and samples there, while the trainer would divide by the one asked for
LOWEST_TEMPERATURE = 1e-2
# parallel sizes other than 1 refused, and why: each rank runs its own vLLM on its own DP rows
NOT_PARALLEL = {
    "tensor_parallel_size": "every rank of a TP group would need the same prompts",
    "pipeline_parallel_size": "with external_launcher vLLM asserts on every rank but the "
                              "last stage's at the first generate",
    "data_parallel_size": "vLLM's DP ranks step together, and given different rows they "
                          "hang"}


def check_options(options: dict[str, Any]) -> None:
    """VLLMEngine's keywords as it takes them: those this adapter sets, and the settings it
    does not support."""
    taken = sorted(set(options) & ADAPTER_SETS)
    if taken:
        raise ValueError(f"engine_options {taken} are set by asyncrl's vLLM adapter (it "
                         f"runs vLLM inside the rank's torchrun group, with sleep mode "
                         f"and its own weight loading); leave them out")
    quant = options.get("quantization")
    if quant is not None:  # (vLLM quantizes once, after loading)
        raise ValueError(f"engine_options quantization={quant!r}: the vLLM engine cannot take "
                         f"new weights into a model vLLM quantizes once, as it loads: each later "
                         f"load would fail or be cast in with stale scales; leave it out")
    kv_dtype = options.get("kv_cache_dtype", "auto")
    if kv_dtype != "auto":
        raise ValueError(f"engine_options kv_cache_dtype={kv_dtype!r} is not supported: "
                         f"an fp8 KV cache's scales (k_scale/v_scale) are lost when vLLM "
                         f"sleeps at level 2 (it keeps only the model's buffers), and "
                         f"generation after the wake would be garbage; leave it \"auto\"")
    for key, why in NOT_PARALLEL.items():
        size = options.get(key, 1)
        if size != 1:
            raise ValueError(f"VLLMEngine({key}={size}): only 1 is supported (each rank "
                             f"generates its own DP rows, and {why}); use more ranks instead")
    level = options.get("sleep_level", 2)
    if type(level) is not int or level not in (1, 2):
        raise ValueError(f"engine_options sleep_level={level!r}: vLLM sleeps at level 1 (its "
                         f"weights' memory copied to the host and back) or 2 (dropped: no host "
                         f"copy, but tensors a model keeps there besides its parameters and "
                         f"buffers are lost, vLLM issue 29341); give 1 or 2")


def check_keys(options: dict[str, Any], engine_args_cls: Any) -> None:
    """vLLM's LLM hands the keywords it does not name to EngineArgs, a dataclass: an unknown
    one is a TypeError deep in vLLM's start (after the group started); named here, with the
    keys meant."""
    if not dataclasses.is_dataclass(engine_args_cls):
        return
    known = {f.name for f in dataclasses.fields(engine_args_cls)}
    for key in sorted(set(options) - known):
        close = difflib.get_close_matches(key, sorted(known), n=3)
        raise TypeError(f"engine_options {key!r} is not a keyword of vLLM's LLM (its "
                        f"EngineArgs has no such field)"
                        + (f"; did you mean {' or '.join(map(repr, close))}?" if close else
                           "; see vLLM's engine arguments for this version"))


def check_sampling(cfg: SamplingConfig) -> None:
    """vLLM's processed log-probs are renormalised over the top-p nucleus, the trainer's (and
    the built-in Sampler's) are not: with top_p < 1 every ratio would start near top_p, not 1,
    and PPO's clip would silence the negative advantages. vLLM raises a temperature below
    0.01 (but above 0) to 0.01, while the trainer would divide by the one asked for."""
    if 0 < cfg.temperature < LOWEST_TEMPERATURE:
        raise ValueError(f"VLLMEngine: temperature={cfg.temperature} is below vLLM's lowest "
                         f"({LOWEST_TEMPERATURE}), to which vLLM raises it: its samples and "
                         f"log-probs would be at {LOWEST_TEMPERATURE} and the trainer's at "
                         f"this one; use temperature=0 for greedy decoding, or >= "
                         f"{LOWEST_TEMPERATURE}")
    if cfg.top_p < 1:
        raise ValueError(f"VLLMEngine: top_p={cfg.top_p} < 1 is not supported: vLLM's "
                         f"log-probs would be renormalised over the nucleus and differ from "
                         f"the trainer's; sample with top_p=1 (as RL rollouts usually do)")
