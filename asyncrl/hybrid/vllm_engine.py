"""The vLLM generation engine (GPU machines, the `vllm` extra), behind the same interface as
the built-in `Sampler`: generate, load_weights, sleep/wake, pause/resume.

SPMD use: every rank of a torchrun group builds its own `LLM` with
`distributed_executor_backend="external_launcher"` (vLLM joins the torch.distributed group
the rank is in); `enable_sleep_mode=True` lets the hybrid engine free the KV cache and
offload weights while training. New weights go in through a worker extension whose method
`collective_rpc` calls on every vLLM worker: no reload from disk.

Matching the built-in Sampler: log-probs after temperature (`logprobs_mode=
"processed_logprobs"`, vLLM >= 0.10.2; vLLM's default is before it; after top-p too, so
top_p < 1 is refused), token ids in and out
(no tokenizer, no detokenizing), stops on `stop_token_ids` only (`ignore_eos`). Weights
loaded while asleep first wake vLLM's weight memory (loading into slept memory is an illegal
access, and waking after it would restore the old weights over the new). Not supported:
tensor parallelism (every rank of a TP group would need the same prompts, and the DP
dispatch gives each its own), and swapping weights in the middle of a generation (the
Sampler's interruptible rollouts).

Never imported on a CPU path: `import vllm` happens in the constructor. It has NOT run against
real vLLM yet (vLLM cannot be installed on the CPU machines, and no GPU machine with vLLM has
been available); its logic is tested against a fake that follows vLLM's documented API.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from asyncrl.comm.batch import TensorBatch
from asyncrl.hybrid.sampler import SamplingConfig, left_pad


class WeightLoader:
    """vLLM worker extension (`worker_extension_cls`): methods run on every vLLM worker."""

    model_runner: Any

    def asyncrl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)


class VLLMEngine:
    def __init__(self, model_path: str, sampling: SamplingConfig | None = None, *,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 dtype: str = "bfloat16", seed: int = 0, llm_cls: Any = None,
                 sampling_params_cls: Any = None):
        if llm_cls is None or sampling_params_cls is None:
            try:
                from vllm import LLM, SamplingParams
            except ImportError as e:
                raise ImportError("the vLLM engine needs vLLM on a GPU machine: pip install "
                                  "'asyncrl[vllm]'; on CPU use the built-in Sampler") from e
            llm_cls, sampling_params_cls = LLM, SamplingParams
        if tensor_parallel_size != 1:
            raise ValueError(f"VLLMEngine(tensor_parallel_size={tensor_parallel_size}): only 1 "
                             f"is supported (each rank generates its own DP rows); use more "
                             f"ranks instead")
        self.config = sampling or SamplingConfig()
        _check_top_p(self.config)
        self._params_cls = sampling_params_cls
        # vLLM refuses to start if less than gpu_memory_utilization of the GPU is free: build
        # it before the trainer on a shared GPU, or lower it
        self.llm = llm_cls(model=model_path, tensor_parallel_size=1,
                           distributed_executor_backend="external_launcher",
                           enable_sleep_mode=True, gpu_memory_utilization=gpu_memory_utilization,
                           dtype=dtype, seed=seed, skip_tokenizer_init=True,
                           logprobs_mode="processed_logprobs",
                           worker_extension_cls=f"{__name__}.{WeightLoader.__qualname__}")
        self.asleep = False
        self._asleep_parts: set[str] = set()  # "weights", "kv_cache": what vLLM has released
        self.paused = False
        self.version = 0  # the policy version of the weights held (set by load_weights)
        self.on_token: Any = None  # not called: vLLM generates a whole batch in one call

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                 config: SamplingConfig | None = None) -> TensorBatch:
        cfg = config or self.config
        if self.asleep or self.paused:
            raise RuntimeError(f"the vLLM engine is {'asleep' if self.asleep else 'paused'}: "
                               f"{'wake()' if self.asleep else 'resume()'} it first")
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; give "
                             f"one seed per sample")
        _check_top_p(cfg)
        params = [self._params_cls(temperature=cfg.temperature, top_p=cfg.top_p,
                                   max_tokens=cfg.max_new_tokens,
                                   stop_token_ids=list(cfg.stop_token_ids), seed=int(s),
                                   logprobs=0, ignore_eos=True, detokenize=False)
                  for s in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                    use_tqdm=False)
        prompt_ids, prompt_mask = left_pad(prompts, cfg.pad_token_id)
        n = cfg.max_new_tokens
        ids = torch.full((len(prompts), n), cfg.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), n), dtype=torch.long)
        logp = torch.zeros((len(prompts), n), dtype=torch.float32)
        for i, out in enumerate(outputs):
            sample = out.outputs[0]
            tokens = list(sample.token_ids)[:n]
            ids[i, :len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
            mask[i, :len(tokens)] = 1
            for j, (token, entry) in enumerate(zip(tokens, sample.logprobs or [], strict=False)):
                logp[i, j] = float(entry[token].logprob)  # the sampled token's entry
        versions = torch.where(mask.bool(), self.version, -1)
        return TensorBatch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                            "response_ids": ids, "response_mask": mask, "logprobs": logp,
                            "versions": versions}, {"temperature": cfg.temperature})

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]],
                     version: int | None = None) -> int:
        """Copy new weights in by name (on every vLLM worker); `version` tags the tokens
        sampled from now on. Asleep, vLLM's weight memory is woken first (not its KV cache)."""
        if "weights" in self._asleep_parts:
            self.llm.wake_up(tags=["weights"])
            self._asleep_parts.discard("weights")
        counts = self.llm.collective_rpc("asyncrl_load_weights", args=(list(named),))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        if version is not None:
            self.version = version
        return int(counts[0])

    # vLLM owns its weights' memory: "adopting" tensors is a copy into it
    adopt_weights = load_weights

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache, and offload the weights to host memory (level 1) or drop
        them (level 2: for callers that load new weights before the next generation)."""
        self.llm.sleep(level=level)
        self._asleep_parts = {"weights", "kv_cache"}
        self.asleep = True

    def wake(self) -> None:
        if self._asleep_parts:
            self.llm.wake_up(tags=sorted(self._asleep_parts))
        self._asleep_parts = set()
        self.asleep = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


def _check_top_p(cfg: SamplingConfig) -> None:
    """vLLM's processed log-probs are renormalised over the top-p nucleus, the trainer's (and
    the built-in Sampler's) are not: with top_p < 1 every ratio would start near top_p, not 1,
    and PPO's clip would silence the negative advantages."""
    if cfg.top_p < 1:
        raise ValueError(f"VLLMEngine: top_p={cfg.top_p} < 1 is not supported: vLLM's "
                         f"log-probs would be renormalised over the nucleus and differ from "
                         f"the trainer's; sample with top_p=1 (as RL rollouts usually do)")
