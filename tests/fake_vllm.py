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
(0, 0.01) is raised to 0.01, as vLLM's SamplingParams does; processed log-probs with
top_p < 1 are renormalised over the nucleus. Level 2 keeps the model's buffers on the host
and copies them back at the first wake_up, whatever its tags (the KV cache woken first:
an illegal address); wake_up(None) while partly awake maps the awake part again (an error).
LLM's keywords go to an EngineArgs dataclass (an unknown one: TypeError). Prompts are
checked as they are added (empty, too long; out of vocabulary only with a tokenizer): a
refused one leaves those before it in the engine. Without a tokenizer an id outside the
vocabulary reaches the embedding kernel: a device-side assert, after which every call fails
(the CUDA context is gone); so does a step (llm_engine.step) while the KV cache sleeps (sleep
does not abort requests: a refused call's rows stay). Building an LLM seeds the process's
RNGs (random, numpy, torch) with `seed`, as vLLM's set_random_seed does. The model's
load_weights takes the weights positionally only (vLLM's loader passes them so; models name
the parameter otherwise), skips lm_head.* where the config ties it (vLLM's models do) and
returns the names it filled. With `pool_tensor` the model holds a tensor in the weights' pool
beside its parameters and buffers (added to the logits, as a rotary cache would be used):
level 2 loses it (NaN), load_weights does not restore it (vLLM issue 29341). Faults on
demand: `kv_wake_ooms` (the next N KV cache wakes run out of memory), `reset_failures` (the
next N reset_prefix_cache calls return False, as newer vLLM does; 0.10-0.11 return None
whatever happened). With FAKE_VLLM_CALLS=DIR each process also writes what it was asked,
one JSON line per call, to DIR/<pid>.jsonl (for tests of torchrun groups)."""

from __future__ import annotations

import importlib
import itertools
import json
import os
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from asyncrl.hybrid.models import ModelConfig, build_model
from asyncrl.hybrid.sampler import Sampler, SamplingConfig, top_p_filter

__version__ = "0.11.0"  # a release the adapter takes (it checks the version it imports)
_MAX_TEMP = 1e-2  # vLLM's: a lower temperature above 0 is raised to it


@dataclass
class EngineArgs:
    """vLLM's EngineArgs (a dataclass: an unknown keyword is a TypeError), with the fields
    asyncrl's adapter and its tests use."""
    model: str = "facebook/opt-125m"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_sleep_mode: bool = False
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    seed: int | None = 0
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    logprobs_mode: str = "raw_logprobs"
    worker_extension_cls: str = ""
    max_model_len: int | None = None
    hf_overrides: Any = None
    trust_remote_code: bool = False
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    quantization: str | None = None  # (vLLM quantizes the weights once, as it loads them)


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
    """vLLM models expose load_weights(iterable of (name, tensor)), by the checkpoint's
    names; their own parameters are named otherwise (fused projections):
    here a prefix stands for that."""

    def __init__(self, model: Any):
        self.module = model

    def named_parameters(self) -> Any:
        return self.module.named_parameters(prefix="vllm_internal")

    def load_weights(self, weights: Any, /) -> set[str]:  # (named otherwise by some)
        """The names of the parameters filled, as vLLM's models return them. A tied model
        skips lm_head.* (vLLM's AutoWeightsLoader(skip_prefixes=["lm_head."])): its head is
        the embeddings."""
        params = dict(self.module.named_parameters())
        tied = getattr(self.module.config, "tie_word_embeddings", False)
        loaded = set()
        for name, tensor in weights:
            if tied and name.startswith("lm_head."):
                continue
            params[name].data.copy_(tensor)
            loaded.add(f"vllm_internal.{name}")
        return loaded


def _record(name: str, arg: Any) -> None:
    LLM.calls.append((name, arg))
    folder = os.environ.get("FAKE_VLLM_CALLS")
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps([name, arg], default=str) + "\n")


class LLM:
    calls: list[tuple[str, Any]] = []  # what the adapter asked of vLLM, for the tests
    pool_tensor = False  # the model holds a tensor in the weights' pool that level 2 loses

    def __init__(self, model: str, **kwargs: Any):
        _record("init", {"model": model, **kwargs})
        EngineArgs(model=model, **kwargs)  # as vLLM's LLM: a TypeError for an unknown key
        seed = kwargs.get("seed", 0)
        if seed is not None:  # vLLM's set_random_seed, on every rank
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)
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
        self._vocab = int(c.vocab_size)  # vLLM's model_config.get_vocab_size()
        self.llm_engine = SimpleNamespace(  # (the rows a refused call left are unfinished)
            model_config=SimpleNamespace(max_model_len=self._max_len,
                                         get_vocab_size=lambda: self._vocab,
                                         hf_config=c, hf_text_config=c),
            has_unfinished_requests=lambda: bool(self._left), step=self._step)
        self._left: list[tuple[dict, SamplingParams]] = []  # requests a refused call left
        self._saved_buffers: dict[str, Any] = {}  # level 2: the buffers, on the host
        self._dead: str | None = None  # a CUDA error that left the context unusable
        self.kv_wake_ooms = 0  # the next N wake_up(["kv_cache"]) run out of memory
        self._kv_wakes = 0
        self.reset_failures = 0  # the next N reset_prefix_cache() return False
        self._pool = torch.zeros(()) if self.pool_tensor else None  # (a rotary cache, say)
        if self._pool is not None:
            self._model.register_forward_hook(self._use_pool)

    def _use_pool(self, module: Any, args: Any, out: Any) -> Any:
        out.logits = out.logits + self._pool
        return out

    def _step(self) -> None:
        """llm_engine.step(): runs the unfinished requests (to their end, here)."""
        self._alive()
        if self._left and "kv_cache" in self.asleep:
            raise self._kill("CUDA error: an illegal memory access (a step ran requests "
                             "into the sleeping KV cache's unmapped memory)")
        self._left.clear()

    def _alive(self) -> None:
        if self._dead:
            raise RuntimeError(f"fake LLM: {self._dead} (an earlier call's; the CUDA "
                               f"context is unusable)")

    def _kill(self, error: str) -> RuntimeError:
        self._dead = error
        return RuntimeError(f"fake LLM: {error}")

    def generate(self, prompts: list[dict], sampling_params: list[SamplingParams],
                 use_tqdm: bool = True) -> list[RequestOutput]:
        self._alive()
        if self.asleep:
            raise RuntimeError(f"fake LLM: generate() while {sorted(self.asleep)} sleep")
        for k, prompt in enumerate(prompts):  # each added as it is checked: up to 0.11.0
            ids = prompt["prompt_token_ids"]  # a refused one left those before it in the
            error = None  # engine, answered by the next call (vLLM's _validate_model_input)
            if not ids:
                error = "The decoder prompt cannot be empty"
            elif not self._skip_tokenizer and not 0 <= max(ids) < self._vocab:
                error = f"Token id {max(ids)} is out of vocabulary"  # (with a tokenizer only)
            elif self._max_len - len(ids) < 1:
                error = (f"the decoder prompt (length {len(ids)}) is longer than the "
                         f"maximum model length of {self._max_len}")
            if error:
                self._left += list(zip(prompts[:k], sampling_params[:k], strict=True))
                raise ValueError(f"fake LLM: {error}")
        requests = self._left + list(zip(prompts, sampling_params, strict=True))
        self._left = []
        if any(not 0 <= t < self._vocab for p, _ in requests for t in p["prompt_token_ids"]):
            raise self._kill("CUDA error: device-side assert triggered (an index out of "
                             "range in the embedding)")
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
            if self._logprobs_mode == "processed_logprobs" and sp.top_p < 1 and \
                    sp.temperature > 0 and tokens:  # renormalised over the nucleus
                lps = _nucleus_logprobs(self._model, prompt["prompt_token_ids"], tokens,
                                        sp.temperature, sp.top_p)
            logprobs = [{t: Logprob(lp)} for t, lp in zip(tokens, lps, strict=True)] \
                if sp.logprobs is not None else None
            out.append(RequestOutput(prompt["prompt_token_ids"],
                                     [CompletionOutput(tokens, logprobs)]))
        return out

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        _record("collective_rpc", method)
        self._alive()
        if "weights" in self.asleep:
            raise RuntimeError("fake LLM: CUDA error: an illegal memory access (the weights' "
                               "memory is released while asleep)")
        return [getattr(self._worker, method)(*args)]

    def reset_prefix_cache(self) -> bool:
        _record("reset_prefix_cache", None)
        self._alive()
        if self.reset_failures:  # vLLM: "some blocks are not freed yet"
            self.reset_failures -= 1
            return False
        return True

    def sleep(self, level: int = 1) -> None:
        _record("sleep", level)
        self._alive()
        if self.asleep:  # vLLM's executor: "already sleeping" while any tag sleeps, even
            return       # with the weights woken alone: nothing is released
        params = dict(self._model.named_parameters())
        self._backup = {k: v.detach().clone() for k, v in params.items()} if level == 1 else None
        if level == 2:  # the weights' pool is discarded, the buffers (in it) kept on the host
            self._saved_buffers = {k: v.detach().cpu().clone()
                                   for k, v in self._model.named_buffers()}
            for v in itertools.chain(params.values(), self._model.buffers()):
                v.data.fill_(float("nan"))  # gone: only new weights make it usable again
            if self._pool is not None:  # (lost for good: no load fills it)
                self._pool.fill_(float("nan"))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        _record("wake_up", tags)
        self._alive()
        if not self.asleep:  # vLLM warns and does nothing
            return
        if tags is None and self.asleep != {"weights", "kv_cache"}:  # every tag mapped again
            raise RuntimeError(f"fake LLM: CUDA error: invalid argument (wake_up(None) maps "
                               f"every tag, and {sorted({'weights', 'kv_cache'} - self.asleep)} "
                               f"is mapped already)")
        tags = ["weights", "kv_cache"] if tags is None else tags
        if not set(tags) <= self.asleep:  # vLLM warns and does nothing
            return
        if "kv_cache" in tags and self.kv_wake_ooms:
            self.kv_wake_ooms -= 1
            self._kv_wakes += 1
            raise torch.OutOfMemoryError(f"fake LLM: CUDA out of memory (waking the KV "
                                         f"cache, attempt {self._kv_wakes})")
        if "weights" in tags and "weights" in self.asleep and self._backup is not None:
            for k, v in self._model.named_parameters():  # level 1: the backup comes back
                v.data.copy_(self._backup[k])
        if self._saved_buffers:  # vLLM's worker: at the first wake, whatever its tags
            if "weights" in self.asleep and "weights" not in tags:
                raise self._kill("CUDA error: an illegal memory access (level 2's buffers "
                                 "copied back into the weights' unmapped memory)")
            for k, v in self._model.named_buffers():
                v.data.copy_(self._saved_buffers[k])
            self._saved_buffers = {}
        self.asleep -= set(tags)


def _nucleus_logprobs(model: Any, prompt: list[int], tokens: list[int], temperature: float,
                      top_p: float) -> list[float]:
    """vLLM's processed log-probs with top_p < 1: after temperature and the top-p mask, so
    renormalised over the nucleus (the trainer's are the whole distribution's)."""
    ids = torch.tensor([list(prompt) + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    logp = F.log_softmax(top_p_filter(logits, top_p), -1)
    return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
