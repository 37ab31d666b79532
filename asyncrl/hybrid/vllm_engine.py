"""The vLLM generation engine (GPU machines, the `vllm` extra), behind the same interface as
the built-in `Sampler`: generate, load_weights, sleep/wake, pause/resume.

SPMD use: every rank of a torchrun group builds its own `LLM` with
`distributed_executor_backend="external_launcher"` (vLLM joins the torch.distributed group
the rank is in); `enable_sleep_mode=True` lets the hybrid engine free the KV cache and
offload weights while training. New weights go in through a worker extension whose method
`collective_rpc` calls on every vLLM worker: no reload from disk.

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
        self.config = sampling or SamplingConfig()
        self._params_cls = sampling_params_cls
        self.llm = llm_cls(model=model_path, tensor_parallel_size=tensor_parallel_size,
                           distributed_executor_backend="external_launcher",
                           enable_sleep_mode=True, gpu_memory_utilization=gpu_memory_utilization,
                           dtype=dtype, seed=seed,
                           worker_extension_cls=f"{__name__}.{WeightLoader.__qualname__}")
        self.asleep = False
        self.paused = False

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                 config: SamplingConfig | None = None) -> TensorBatch:
        cfg = config or self.config
        if self.asleep or self.paused:
            raise RuntimeError(f"the vLLM engine is {'asleep' if self.asleep else 'paused'}: "
                               f"{'wake()' if self.asleep else 'resume()'} it first")
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; give "
                             f"one seed per sample")
        params = [self._params_cls(temperature=cfg.temperature, top_p=cfg.top_p,
                                   max_tokens=cfg.max_new_tokens,
                                   stop_token_ids=list(cfg.stop_token_ids), seed=int(s),
                                   logprobs=0) for s in seeds]
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
        return TensorBatch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                            "response_ids": ids, "response_mask": mask, "logprobs": logp})

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        counts = self.llm.collective_rpc("asyncrl_load_weights", args=(list(named),))
        return int(counts[0])

    def sleep(self) -> None:
        self.llm.sleep(level=1)  # KV cache dropped, weights offloaded to host memory
        self.asleep = True

    def wake(self) -> None:
        self.llm.wake_up()
        self.asleep = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
