"""A fake of the parts of vLLM's API that asyncrl uses (LLM, SamplingParams, RequestOutput,
sleep mode, collective_rpc with a worker extension), following vLLM's documentation. It
samples with a tiny HF model through asyncrl's own Sampler, so outputs are real tokens with
real log-probs. Used because vLLM cannot be installed on the CPU machines.

What it holds vLLM to: log-probs are vLLM's default "raw_logprobs" (before temperature)
unless `logprobs_mode="processed_logprobs"` (raw is only modelled at temperature 1: it
refuses otherwise, which is the point); sleep level 1 backs the weights up and wake_up
restores that backup; level 2 drops them; sleep while any part still sleeps (the weights
woken alone) does nothing, as vLLM's executor is "already sleeping"; weights loaded while
the weights sleep are an illegal memory access; generating needs everything awake;
`load_format="dummy"` starts from random weights, not the checkpoint's; a temperature in
(0, 0.01) is raised to 0.01, as vLLM's SamplingParams does. With
FAKE_VLLM_CALLS=DIR each process also writes what it was asked, one JSON line per call, to
DIR/<pid>.jsonl (for tests of torchrun groups)."""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from asyncrl.hybrid.models import ModelConfig, build_model
from asyncrl.hybrid.sampler import Sampler, SamplingConfig

__version__ = "0.11.0"  # a release the adapter takes (it checks the version it imports)
_MAX_TEMP = 1e-2  # vLLM's: a lower temperature above 0 is raised to it


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    detokenize: bool = True

    def __post_init__(self) -> None:
        if 0 < self.temperature < _MAX_TEMP:
            self.temperature = _MAX_TEMP


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class _ModelRunner:
    def __init__(self, model: Any):
        self.model = _LoadableModel(model)


class _LoadableModel:
    """vLLM models expose load_weights(weights=iterable of (name, tensor)), by the
    checkpoint's names; their own parameters are named otherwise (fused projections):
    here a prefix stands for that."""

    def __init__(self, model: Any):
        self.module = model

    def named_parameters(self) -> Any:
        return self.module.named_parameters(prefix="vllm_internal")

    def load_weights(self, weights: Any) -> set[str]:
        """The names of the parameters filled, as vLLM's models return them."""
        params = dict(self.module.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)
        return {f"vllm_internal.{name}" for name, _ in weights}


def _record(name: str, arg: Any) -> None:
    LLM.calls.append((name, arg))
    folder = os.environ.get("FAKE_VLLM_CALLS")
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps([name, arg], default=str) + "\n")


class LLM:
    calls: list[tuple[str, Any]] = []  # what the adapter asked of vLLM, for the tests

    def __init__(self, model: str, **kwargs: Any):
        _record("init", kwargs)
        required = {"distributed_executor_backend", "enable_sleep_mode", "worker_extension_cls"}
        missing = required - set(kwargs)
        if missing:
            raise TypeError(f"fake LLM: missing {missing}")
        module, _, name = kwargs["worker_extension_cls"].rpartition(".")
        ext = getattr(importlib.import_module(module), name)
        self._logprobs_mode = kwargs.get("logprobs_mode", "raw_logprobs")
        self._skip_tokenizer = kwargs.get("skip_tokenizer_init", False)
        self._model = build_model(ModelConfig(path=model) if os.path.isdir(model) else
                                  ModelConfig(preset=model))
        if kwargs.get("load_format", "auto") == "dummy":  # as vLLM's dummy weights
            for p in self._model.parameters():
                p.data.uniform_(-1e-3, 1e-3)
        self._worker = type("Worker", (ext,), {})()  # vLLM mixes the extension in
        self._worker.model_runner = _ModelRunner(self._model)
        self.asleep: set[str] = set()  # "weights", "kv_cache"
        self._backup: dict[str, Any] | None = None
        c = self._model.config  # vLLM's default: the model's own limit
        self._max_len = kwargs.get("max_model_len") or getattr(
            c, "max_position_embeddings", None) or c.n_positions
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(
            max_model_len=self._max_len))
        self._left: list[tuple[dict, SamplingParams]] = []  # requests a refused call left

    def generate(self, prompts: list[dict], sampling_params: list[SamplingParams],
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if self.asleep:
            raise RuntimeError(f"fake LLM: generate() while {sorted(self.asleep)} sleep")
        for k, prompt in enumerate(prompts):  # each added as it is checked: up to 0.11.0
            room = self._max_len - len(prompt["prompt_token_ids"])  # a refused one left
            if room < 1:  # those before it in the engine, answered by the next call
                self._left += list(zip(prompts[:k], sampling_params[:k], strict=True))
                raise ValueError(f"fake LLM: the decoder prompt (length "
                                 f"{len(prompt['prompt_token_ids'])}) is longer than the "
                                 f"maximum model length of {self._max_len}")
        requests = self._left + list(zip(prompts, sampling_params, strict=True))
        self._left = []
        out = []
        for prompt, sp in requests:
            if self._logprobs_mode == "raw_logprobs" and sp.logprobs is not None and \
                    sp.temperature != 1.0:
                raise NotImplementedError("fake LLM: raw log-probs (before temperature) are "
                                          "not modelled at temperature != 1")
            if self._skip_tokenizer and (sp.detokenize or not sp.ignore_eos):
                raise ValueError("fake LLM: skip_tokenizer_init needs detokenize=False, and "
                                 "EOS is unknown without a tokenizer (ignore_eos=True)")
            if sp.seed is not None and not -2**63 <= sp.seed < 2**63:  # (its int64 arrays)
                raise OverflowError("Python int too large to convert to C long")
            room = self._max_len - len(prompt["prompt_token_ids"])
            # past max_model_len a request ends (FINISHED_LENGTH_CAPPED), at any token
            cfg = SamplingConfig(temperature=sp.temperature, top_p=sp.top_p,
                                 max_new_tokens=min(sp.max_tokens, room),
                                 stop_token_ids=tuple(sp.stop_token_ids))
            res = Sampler(self._model, cfg).generate([prompt["prompt_token_ids"]], [sp.seed or 0])
            n = int(res["response_mask"][0].sum())
            tokens = res["response_ids"][0, :n].tolist()
            lps = res["logprobs"][0, :n].tolist()
            logprobs = [{t: Logprob(lp)} for t, lp in zip(tokens, lps, strict=True)] \
                if sp.logprobs is not None else None
            out.append(RequestOutput(prompt["prompt_token_ids"],
                                     [CompletionOutput(tokens, logprobs)]))
        return out

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        _record("collective_rpc", method)
        if "weights" in self.asleep:
            raise RuntimeError("fake LLM: CUDA error: an illegal memory access (the weights' "
                               "memory is released while asleep)")
        return [getattr(self._worker, method)(*args)]

    def reset_prefix_cache(self) -> bool:
        _record("reset_prefix_cache", None)
        return True

    def sleep(self, level: int = 1) -> None:
        _record("sleep", level)
        if self.asleep:  # vLLM's executor: "already sleeping" while any tag sleeps, even
            return       # with the weights woken alone: nothing is released
        params = dict(self._model.named_parameters())
        self._backup = {k: v.detach().clone() for k, v in params.items()} if level == 1 else None
        if level == 2:
            for v in params.values():
                v.data.fill_(float("nan"))  # gone: only new weights make it usable again
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        _record("wake_up", tags)
        tags = ["weights", "kv_cache"] if tags is None else tags
        if not self.asleep or not set(tags) <= self.asleep:  # vLLM warns and does nothing
            return
        if "weights" in tags and "weights" in self.asleep and self._backup is not None:
            for k, v in self._model.named_parameters():  # level 1: the backup comes back
                v.data.copy_(self._backup[k])
        self.asleep -= set(tags)
