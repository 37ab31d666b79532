"""The vLLM generation engine (GPU machines, the `vllm` extra), behind the same interface as
the built-in `Sampler`: generate, load_weights, sleep/wake, pause/resume.

SPMD use: every rank of a torchrun group builds its own `LLM` with
`distributed_executor_backend="external_launcher"` (vLLM joins the torch.distributed group
the rank is in); `enable_sleep_mode=True` lets the hybrid engine free the KV cache and
the weights while training (level 2: no host copy; it hands vLLM the trained weights before
each generation, and builds it with `load_format="dummy"`: the checkpoint is never read;
`sleep_level=1` keeps a host copy, for models whose tensors beside their parameters and
buffers level 2 loses, vLLM issue 29341).
New weights go in through a worker extension whose method `collective_rpc` calls on every
vLLM worker: no reload from disk.

Matching the built-in Sampler: log-probs after temperature (`logprobs_mode=
"processed_logprobs"`, vLLM >= 0.10.2; vLLM's default is before it; after top-p too, so
top_p < 1 is refused), token ids in and out
(no tokenizer, no detokenizing), stops on `stop_token_ids` only (`ignore_eos`). Weights
loaded while asleep first wake vLLM's weight memory (loading into slept memory is an illegal
access, and waking after it would restore the old weights over the new); a load that fails
midway (vLLM copies tensor by tensor) leaves generation and checkpoints (state_dict)
refused until the loads since have filled every parameter vLLM holds (its model reports
those it fills) or a whole state went in (load_state_dict). Not supported:
tensor, pipeline or data parallelism inside vLLM (each rank runs its own vLLM on the rows
the DP dispatch gives it), and swapping weights in the middle of a generation (the
Sampler's interruptible rollouts): a load waits for the generation in flight to end; quantized
(or `quantization=`), MLA and MoE checkpoints (vLLM derives tensors from their weights after
a load, which new weights would not redo; a fused MoE's load writes the checkpoint's layout
into the kernel's), and a KV cache dtype other than "auto" (level 2 sleep loses its scales).
A head vLLM's tied model would skip (a trainer that unties it) is refused before a load.
Prompts are checked before vLLM sees them (empty, ids outside the vocabulary: without a
tokenizer vLLM passes a bad id to the embedding kernel, a device-side assert), and so are
`engine_options` keys (against vLLM's EngineArgs).
Roles take it with `engine="vllm"` and `engine_options=` (this constructor's keywords);
the model must be a local checkpoint (`model={"path": DIR}`).

Never imported on a CPU path: `import vllm` happens in the constructor. It has NOT run against
real vLLM yet (vLLM cannot be installed on the CPU machines, and no GPU machine with vLLM has
been available); its logic is tested against a fake that follows vLLM's documented API.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from asyncrl.actors.gpu_slots import require_own_gpu
from asyncrl.actors.worker import rng_state, set_rng_state
from asyncrl.comm.batch import TensorBatch
from asyncrl.hybrid.models import model_file
from asyncrl.hybrid.sampler import SamplingConfig, left_pad
from asyncrl.hybrid.vllm_options import check_keys, check_options, check_sampling

MODULE_ENV = "ASYNCRL_VLLM_MODULE"  # another module with vLLM's LLM and SamplingParams: the
# CPU tests' fake (tests/fake_vllm.py), in real torchrun groups


class WeightLoader:
    """vLLM worker extension (`worker_extension_cls`): methods run on every vLLM worker."""

    model_runner: Any
    _asyncrl_loaded: set[str] | None = None  # the names filled since asyncrl last asked
    _asyncrl_since: set[str] | None = None  # filled since a load asked to recount (None: a
    # load since that the model did not report)

    def asyncrl_load_weights(self, weights: list[tuple[str, torch.Tensor]],
                             recount: bool = False) -> int:
        """`recount`: count the parameters filled from this load on (asyncrl_unfilled)."""
        # (the config check's backstop: a MoE its keys did not reveal)
        fused = _fused_moe(self.model_runner.model)
        if fused:
            raise ValueError(f"the vLLM engine cannot take new weights: the model has fused "
                             f"MoE layers ({fused}), whose weights vLLM rewrites into the "
                             f"kernel's layout after its first load, and load_weights would "
                             f"write the checkpoint's layout over them (garbage rollouts); "
                             f"use the built-in engine (engine='builtin') or a dense model")
        if recount:
            self._asyncrl_since = set()
        # positionally, as vLLM's own loader calls it: models name the parameter otherwise
        loaded = self.model_runner.model.load_weights(weights)
        if isinstance(loaded, set):  # vLLM's models report the parameters they filled
            self._asyncrl_loaded = (self._asyncrl_loaded or set()) | loaded
            if self._asyncrl_since is not None:
                self._asyncrl_since |= loaded
        else:
            self._asyncrl_since = None
        return len(weights)

    def asyncrl_unfilled(self) -> list[str] | None:
        """vLLM's parameters no load filled since the last one given `recount` (None: the
        model does not report what it loaded)."""
        return None if self._asyncrl_since is None else self._left_out(self._asyncrl_since)

    def asyncrl_not_loaded(self) -> list[str] | None:
        """vLLM's parameters no load has filled since the last call (None: the model does
        not report what it loaded)."""
        loaded, self._asyncrl_loaded = self._asyncrl_loaded, set()
        return None if loaded is None else self._left_out(loaded)

    def _left_out(self, filled: set[str]) -> list[str]:
        """vLLM's parameters not in `filled`, sorted."""
        return sorted(n for n, _ in self.model_runner.model.named_parameters()
                      if n not in filled)

    def asyncrl_state(self) -> dict[str, torch.Tensor]:
        """The weights as vLLM holds them (its own names: fused projections), on the host."""
        return {k: v.detach().cpu() for k, v in self.model_runner.model.named_parameters()}

    def asyncrl_set_state(self, state: dict[str, torch.Tensor]) -> int:
        """`asyncrl_state()`'s weights back, by vLLM's own names (the same vLLM and model)."""
        params = dict(self.model_runner.model.named_parameters())
        missing = sorted(set(params) - set(state))
        if missing:
            raise KeyError(f"the saved vLLM weights lack {missing[:3]}: saved by another "
                           f"model or vLLM version")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state[name])
        return len(params)


MIN_VERSION = (0, 10, 2)  # logprobs_mode="processed_logprobs" with temperature applied
EXPANDABLE_OK = (0, 20, 1)  # vLLM PR 40812: expandable segments turned off around its pool
# config.json keys that give a MoE's expert count (Qwen-MoE/OLMoE, Mixtral/Llama 4/GPT-OSS,
# DeepSeek, ERNIE)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
HEAD = "lm_head.weight"  # the output head a tied vLLM model skips (its skip_prefixes)


class VLLMEngine:
    owns_weights = True  # new weights go in by name (load_weights): vLLM fuses projections

    def __init__(self, model_path: str, sampling: SamplingConfig | None = None, *,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 dtype: str = "bfloat16", seed: int = 0, load_format: str = "auto",
                 sleep_level: int = 2, llm_cls: Any = None, sampling_params_cls: Any = None,
                 engine_args_cls: Any = None, **llm_options: Any):
        """`llm_options`: other keywords of vLLM's LLM (max_model_len, hf_overrides,
        enforce_eager, ...), passed on as they are; those this adapter sets are refused, and
        those vLLM's EngineArgs lacks (`engine_args_cls`; vllm.EngineArgs when vLLM is
        imported here) are named with the ones meant. `sleep_level`: the level the hybrid
        engine sleeps vLLM at (2: its weights dropped; 1: kept on the host, for models that
        hold tensors beside their parameters and buffers, which level 2 loses)."""
        check_options({**llm_options, "tensor_parallel_size": tensor_parallel_size,
                       "sleep_level": sleep_level})
        self.sleep_level = sleep_level
        version = None  # (unknown for classes given: the stricter checks)
        if llm_cls is None or sampling_params_cls is None:
            name = os.environ.get(MODULE_ENV, "vllm")
            try:
                vllm = importlib.import_module(name)
            except ImportError as e:
                raise ImportError("the vLLM engine needs vLLM on a GPU machine: pip install "
                                  "'asyncrl[vllm]'; on CPU use the built-in engine "
                                  "(engine='builtin')") from e
            # older: no logprobs_mode (a TypeError), or its "processed" log-probs before
            # temperature (every ratio off 1, unsaid)
            if _too_old(version := getattr(vllm, "__version__", "0")):
                raise ImportError(f"the vLLM engine needs vLLM >= "
                                  f"{'.'.join(map(str, MIN_VERSION))} (log-probs after "
                                  f"temperature), found {vllm.__version__}")
            llm_cls, sampling_params_cls = vllm.LLM, vllm.SamplingParams
            engine_args_cls = engine_args_cls or getattr(vllm, "EngineArgs", None)
        check_keys(llm_options, engine_args_cls)
        _check_reloadable(model_path, llm_options.get("hf_overrides"))
        toggled = version is not None and not _too_old(version, EXPANDABLE_OK) and \
            "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # (newer torch: both)
            if not toggled and "expandable_segments:true" in os.environ.get(name, "").lower():
                raise ValueError(f"{name} has expandable_segments:True, which vLLM's sleep "
                                 f"mode refuses (its memory pool) before 0.20.1, and from then "
                                 f"on turns off around it only if PYTORCH_CUDA_ALLOC_CONF says "
                                 f"so: leave it out, or set it there with vLLM >= 0.20.1")
        require_own_gpu("vLLM needs a GPU per rank (it binds cuda:LOCAL_RANK)")
        self.config = sampling or SamplingConfig()
        check_sampling(self.config)
        self._params_cls = sampling_params_cls
        # vLLM refuses to start if less than gpu_memory_utilization of the GPU is free (a
        # hybrid Policy builds its trainer first: lower it there), and by default sizes for
        # the model's whole context (engine_options max_model_len= for less)
        rng = rng_state()  # vLLM seeds every RNG of the process with `seed` (the same on
        # every rank): the rank's own streams are put back
        self.llm = llm_cls(model=model_path, tensor_parallel_size=1,
                           distributed_executor_backend="external_launcher",
                           enable_sleep_mode=True, gpu_memory_utilization=gpu_memory_utilization,
                           dtype=dtype, seed=seed, load_format=load_format,
                           skip_tokenizer_init=True,
                           logprobs_mode="processed_logprobs",
                           worker_extension_cls=f"{__name__}.{WeightLoader.__qualname__}",
                           **llm_options)
        set_rng_state(rng)
        self.asleep = False
        self._asleep_parts: set[str] = set()  # "weights", "kv_cache": what vLLM has released
        self.paused = False
        self.version = 0  # the policy version of the weights held (set by load_weights)
        self.on_token: Any = None  # not called: vLLM generates a whole batch in one call
        # vLLM is not thread-safe: a weight load (a concurrent call) waits for a generation
        # to end, and its tokens are tagged with the version they were sampled with
        self._busy = threading.Lock()
        self._wake_failure: BaseException | None = None  # why the last wake() failed
        self._unusable: BaseException | None = None  # set: vLLM cannot be slept or woken
        self._stale_prefixes = False  # a load's prefix cache reset failed: not generating
        self._torn: str | None = None  # the load that failed midway: vLLM holds part of it
        # while torn: the names the failed loads were given, those given since (by every
        # load that went through), whether vLLM counts what it fills since, and what not
        self._torn_names: set[str] = set()
        self._since_names: set[str] = set()
        self._counting = False
        self._unfilled: list[str] | None = None

    @property
    def max_model_len(self) -> int | None:
        """vLLM's max_model_len (None where it does not say): a prompt and its response fit."""
        return _max_model_len(self.llm)

    @property
    def vocab_size(self) -> int | None:
        """vLLM's vocabulary size (None where it does not say): multi-turn observations are
        checked against it (an id past it fails in vLLM's embedding kernel)."""
        return _vocab_size(self.llm)

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                 config: SamplingConfig | None = None) -> TensorBatch:
        cfg = config or self.config
        if self.asleep or self.paused:
            raise RuntimeError(f"the vLLM engine is {'asleep' if self.asleep else 'paused'}: "
                               f"{'wake()' if self.asleep else 'resume()'} it first")
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; give "
                             f"one seed per sample")
        check_sampling(cfg)
        limit = _max_model_len(self.llm)
        vocab = _vocab_size(self.llm)
        for i, p in enumerate(prompts):  # before vLLM: up to 0.11.0 it kept the rows added
            if limit is not None and len(p) >= limit:  # before a refused one, and handed
                raise ValueError(  # them to the next call (issue 26081)
                    f"generate: prompt {i} has {len(p)} tokens, which leaves no room for a "
                    f"response within vLLM's max_model_len of {limit}; cut the prompt or "
                    f"raise max_model_len (engine_options)")
            _check_prompt(i, p, vocab)
        params = [self._params_cls(temperature=cfg.temperature, top_p=cfg.top_p,
                                   max_tokens=cfg.max_new_tokens,
                                   stop_token_ids=list(cfg.stop_token_ids),
                                   seed=int(s) % 2**63,  # (vLLM's are int64)
                                   logprobs=0, ignore_eos=True, detokenize=False)
                  for s in seeds]
        with self._busy:
            self._check_usable()
            self._check_whole()
            if self._stale_prefixes:  # a load's reset failed: its cached prefixes are old
                self._reset_prefix_cache()
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                                        params, use_tqdm=False)
            version = self.version
        _check_answers(outputs, prompts)
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
            # missing ones were read as 0: PPO ratios against log p = 0, unsaid
            if sample.logprobs is None or len(sample.logprobs) < len(tokens):
                raise RuntimeError(f"vLLM returned {len(sample.logprobs or [])} log-probs "
                                   f"for {len(tokens)} tokens of prompt {i}; the adapter "
                                   f"asks for logprobs=0 (the sampled token's)")
            for j, (token, entry) in enumerate(zip(tokens, sample.logprobs, strict=False)):
                logp[i, j] = float(entry[token].logprob)  # the sampled token's entry
        versions = torch.where(mask.bool(), version, -1)
        return TensorBatch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                            "response_ids": ids, "response_mask": mask, "logprobs": logp,
                            "versions": versions}, {"temperature": cfg.temperature or 1.0})

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]],
                     version: int | None = None) -> int:
        """Copy new weights in by name (on every vLLM worker); `version` tags the tokens
        sampled from now on. Asleep, vLLM's weight memory is woken first (not its KV cache).
        A head that vLLM's tied model would skip is refused (_check_head), before any load."""
        weights = list(named)
        _check_head(weights, self.llm)
        return self._rpc("asyncrl_load_weights", weights, version)

    def adopt_weights(self, named: Iterable[tuple[str, torch.Tensor]],
                      version: int | None = None, whole: bool = False) -> int:
        """vLLM owns its weights' memory: "adopting" tensors is a copy into it (`whole`:
        vLLM's own loader maps a tied model's names)."""
        return self.load_weights(named, version)

    def not_loaded(self) -> list[str]:
        """vLLM's parameters that no `load_weights` filled since the last call: a hybrid's
        vLLM starts from dummy weights, so the first fill must cover them all."""
        with self._busy:
            return self.llm.collective_rpc("asyncrl_not_loaded")[0] or []

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights held, by vLLM's own names (a checkpoint of a rollout); refused while
        a load that failed midway has left them torn."""
        with self._busy:
            self._check_whole("save its weights (a checkpoint would keep the torn model, "
                              f"under version {self.version})")
            self._wake_weights()
            return dict(self.llm.collective_rpc("asyncrl_state")[0])

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Weights of `state_dict()` back in, with their version."""
        self._rpc("asyncrl_set_state", state, version)

    def _rpc(self, method: str, weights: Any, version: int | None) -> int:
        whole = method == "asyncrl_set_state"  # (every parameter: else a KeyError first)
        names = set(weights) if whole else {n for n, _ in weights}
        with self._busy:
            self._check_usable()
            self._wake_weights()
            # vLLM copies tensor by tensor: one failing (a name it does not know, a shape, a
            # CUDA error) leaves those before it new, under the old version and old prefixes
            args = (weights,) if whole else (weights, self._torn is not None and not
                                             self._counting)
            self._stale_prefixes = True
            try:
                counts = self.llm.collective_rpc(method, args=args)
            except BaseException:
                self._torn_names = names | (self._torn_names if self._torn else set())
                self._torn, self._counting, self._since_names = method, False, set()
                raise
            mended = whole
            if self._torn is not None and not whole:  # torn until the loads since cover
                self._counting, self._since_names = True, self._since_names | names
                self._unfilled = self.llm.collective_rpc("asyncrl_unfilled")[0]
                mended = self._since_names >= self._torn_names if self._unfilled is None \
                    else not self._unfilled  # (None: vLLM's model does not report)
            if mended:
                self._torn, self._unfilled = None, None
            if version is not None:  # (the weights held now, whatever the reset does)
                self.version = version
            self._reset_prefix_cache()
        return int(counts[0])

    def _check_whole(self, action: str = "generate") -> None:
        """Refused while a load that failed midway (vLLM copies tensor by tensor) has left
        part of its weights beside the old ones: until the loads since have filled every
        parameter (vLLM's model reports those it fills), or a whole state went in."""
        if self._torn is not None:
            since = "" if not self._unfilled else (
                f"; the loads since left {len(self._unfilled)} of vLLM's parameters unloaded "
                f"({', '.join(self._unfilled[:3])})")
            raise RuntimeError(f"the vLLM engine refuses to {action}: a weight load "
                               f"({self._torn}) failed midway, and vLLM holds part of the new "
                               f"weights beside the old ones{since}; load the whole weights "
                               f"again (Rollout.load_weights, load_state)")

    def _reset_prefix_cache(self) -> None:
        """vLLM's reset_prefix_cache() returns False when it could not (requests holding
        blocks): tried twice, then an error, and no generation until one goes through."""
        for _ in range(2):
            done = self.llm.reset_prefix_cache()
            engine: Any = getattr(self.llm, "llm_engine", None)  # 0.10-0.11 say nothing:
            if done is None and getattr(engine, "has_unfinished_requests", bool)():  # a failed
                # call's requests hold blocks: run them out (their answers are nobody's),
                # then reset; not while the KV cache sleeps (sleep keeps requests, and a step
                # would run them into its unmapped memory: a dead CUDA context): generate()
                # resets after the wake (_stale_prefixes stays set)
                if "kv_cache" in self._asleep_parts:
                    return
                while engine.has_unfinished_requests():
                    engine.step()
                done = self.llm.reset_prefix_cache()
            if done is not False:
                self._stale_prefixes = False
                return
        raise RuntimeError("vLLM could not reset its prefix cache after a weight load "
                           "(reset_prefix_cache() returned False twice: requests still hold "
                           "cache blocks?); its cached prefixes hold the old weights' KV, so "
                           "generation is refused until a reset succeeds: call again (the "
                           "next generate or load tries it first)")

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise RuntimeError("the vLLM engine is unusable (a failed wake left it neither "
                               "asleep nor awake, see the cause): restart the group") \
                from self._unusable

    def _wake_weights(self) -> None:  # (first: level 2 copies its buffers back at the
        # first wake, into the weights' memory; the KV cache first: an illegal address)
        if "weights" in self._asleep_parts:
            self.llm.wake_up(tags=["weights"])
            self._asleep_parts.discard("weights")

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache, and offload the weights to host memory (level 1) or drop
        them (level 2: for callers that load new weights before the next generation)."""
        with self._busy:
            self._check_usable()
            if self._asleep_parts == {"weights", "kv_cache"}:  # nothing more to release
                return
            if self._asleep_parts:  # partly awake (weights woken to load): vLLM would take
                # itself for asleep and ignore this, keeping the weights on the GPU
                try:
                    self.llm.wake_up(tags=sorted(self._asleep_parts))
                except Exception as e:  # (the wake that failed, again: out of memory)
                    first = self._wake_failure or e
                    self._unusable = first
                    raise RuntimeError(
                        f"the vLLM engine is unusable: restart the group. Waking its "
                        f"{sorted(self._asleep_parts)} failed ({first!r}), and so did the "
                        f"wake needed to put it back to sleep ({e!r}): vLLM sleeps only "
                        f"when wholly awake, so its weights stay on the GPU") from first
            self._wake_failure = None
            self.llm.sleep(level=level)
            self._asleep_parts = {"weights", "kv_cache"}
            self.asleep = True

    def wake(self) -> None:
        with self._busy:
            self._check_usable()
            if self._asleep_parts:  # (both at once, or the KV cache after the weights)
                try:
                    self.llm.wake_up(tags=sorted(self._asleep_parts))
                except BaseException as e:  # (what sleep() reports if it fails again)
                    self._wake_failure = e
                    raise
            self._wake_failure = None
            self._asleep_parts = set()
            self.asleep = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


def _check_reloadable(model_path: str, overrides: Any = None) -> None:
    """New weights go in through the model's load_weights, and vLLM's processing after a
    load (which builds tensors from the weights: quantized kernels' repacked weights, MLA's
    absorbed projections, fused MoE's kernel layout) runs once, at startup: refuse the
    checkpoints that need it (their text config too: multimodal ones nest it), as vLLM
    reads them: `hf_overrides` (a dict) over config.json, a nested config key by key."""
    path = model_file(model_path, "config.json")  # (a Hub id: its cached snapshot's)
    config: dict[str, Any] = json.loads(path.read_text()) if path is not None else {}
    for key, value in (overrides.items() if isinstance(overrides, dict) else ()):
        both = isinstance(value, dict) and isinstance(config.get(key), dict)
        config[key] = {**config[key], **value} if both else value
    for part in (config, config.get("text_config")):
        if not isinstance(part, dict):
            continue
        experts = {k: part[k] for k in EXPERT_KEYS if _most(part.get(k)) > 1}
        if experts:  # vLLM issue 42821: w13 keeps its loader after the kernel's rewrite
            raise ValueError(f"the vLLM engine cannot take new weights for {model_path}: it "
                             f"is a mixture of experts ({experts}), whose fused weights vLLM "
                             f"rewrites into its kernel's layout after the first load, and "
                             f"each later load would write the checkpoint's layout over "
                             f"them (garbage rollouts from the first step, unsaid); use the "
                             f"built-in engine (engine='builtin') or a dense model")
        needs = "it is quantized (quantization_config)" if part.get("quantization_config") \
            else "its attention is MLA (kv_lora_rank)" if part.get("kv_lora_rank") else None
        if needs:
            raise ValueError(f"the vLLM engine cannot take new weights for {model_path}: "
                             f"{needs}, and vLLM would keep generating from tensors it derived "
                             f"from the first weights (its processing after loading is not run "
                             f"again yet); use a dense, unquantized checkpoint with standard "
                             f"attention")


def _most(value: Any) -> int:
    """An expert count from config.json: a number, or a list of them (one per modality)."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, list):
        return max((v for v in value if isinstance(v, int)), default=0)
    return 0


def _fused_moe(model: Any) -> str | None:
    """The first module of vLLM's fused MoE kind (FusedMoE, or one made from it)."""
    modules = getattr(model, "named_modules", None)
    for name, module in (modules() if callable(modules) else ()):
        if any(c.__name__ == "FusedMoE" for c in type(module).__mro__):
            return name
    return None


def _model_config(llm: Any) -> Any:
    """vLLM's ModelConfig (None where this vLLM does not keep it where it is looked for)."""
    engine = getattr(llm, "llm_engine", None)
    return getattr(engine, "model_config", None) or \
        getattr(getattr(engine, "vllm_config", None), "model_config", None)


def _check_head(weights: list[tuple[str, torch.Tensor]], llm: Any) -> None:
    """vLLM's model of a tied config (tie_word_embeddings) skips lm_head.* in load_weights
    (AutoWeightsLoader's skip_prefixes), its head being the embeddings: the head of a trainer
    that unties it would be dropped, unsaid, and the rollouts sampled with the embeddings as
    their head. A tied model's own head (the embeddings' tensor, or a copy) is let through."""
    heads = [(n, v) for n, v in weights if n == HEAD or n.endswith(f".{HEAD}")]
    config = _model_config(llm) if heads else None
    hf = getattr(config, "hf_text_config", None) or getattr(config, "hf_config", None)
    if getattr(hf, "tie_word_embeddings", False) is not True:
        return
    for name, head in heads:
        if any(n != name and v.shape == head.shape and v.dtype == head.dtype and
               v.device == head.device and (v.data_ptr() == head.data_ptr() or
                                            torch.equal(v, head)) for n, v in weights):
            continue  # (a tied model's state dict: its head is its embeddings)
        raise ValueError(
            f"the vLLM engine cannot take {name}: vLLM's model ties lm_head to the "
            f"embeddings (tie_word_embeddings in its config) and the trainer's does not, so "
            f"vLLM would skip it and sample with the embeddings as its head. Give both the "
            f"same tie: drop the trainer's model override {{'tie_word_embeddings': False}}, "
            f"or untie vLLM's with engine_options={{'hf_overrides': {{'tie_word_embeddings': "
            f"False}}}} and a checkpoint saved untied (its lm_head.weight written) or "
            f"'load_format': 'dummy' (random weights until the first sync fills them)")


def _vocab_size(llm: Any) -> int | None:
    """The model's vocabulary size as vLLM holds it (None where this vLLM does not say)."""
    get = getattr(_model_config(llm), "get_vocab_size", None)
    try:
        size = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a vLLM whose config cannot say: vLLM's own checks
        return None
    return size if isinstance(size, int) and size > 0 else None


def _check_prompt(i: int, prompt: Sequence[int], vocab: int | None) -> None:
    """Before vLLM: an empty prompt fails inside its add loop (the rows before it stay in
    the engine, issue 26081), and without a tokenizer it does not check ids against the
    vocabulary: a bad one reaches the embedding kernel, a device-side assert that leaves the
    CUDA context dead (and the group's peers waiting in their next collective)."""
    if len(prompt) == 0:
        raise ValueError(f"generate: prompt {i} is empty; vLLM needs at least one token "
                         f"(a BOS token, say)")
    if vocab is None:
        return
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(f"generate: prompt {i} has token id {bad}, outside the model's "
                         f"vocabulary [0, {vocab}); check the tokenizer matches the model")


def _max_model_len(llm: Any) -> int | None:
    """vLLM's max_model_len (None where this vLLM does not say it where it is looked for)."""
    limit = getattr(_model_config(llm), "max_model_len", None)
    return limit if isinstance(limit, int) else None


def _check_answers(outputs: Sequence[Any], prompts: Sequence[Sequence[int]]) -> None:
    """One answer per prompt, in order: rows of another call (left in vLLM by a refused
    one) must not go into this call's rows."""
    if len(outputs) != len(prompts):
        raise RuntimeError(f"vLLM answered {len(outputs)} requests for {len(prompts)} prompts "
                           f"(requests of an earlier call that failed left in it?); this "
                           f"call's rows are not trusted: call again")
    for i, (out, prompt) in enumerate(zip(outputs, prompts, strict=True)):
        given = getattr(out, "prompt_token_ids", None)
        if given is not None and list(given) != list(prompt):
            raise RuntimeError(f"vLLM's answer {i} is for another prompt (requests of an "
                               f"earlier call that failed left in it?); call again")


def _too_old(text: str, least: tuple[int, ...] = MIN_VERSION) -> bool:
    """Whether vLLM `text` comes before `least`; a pre-release of it too ("0.10.2rc1",
    a nightly "0.10.2.dev5+g1a2b": it may not have what the release has)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text) < Version(".".join(map(str, least)))
    except InvalidVersion:  # (a local build's own naming): its leading numbers
        parts = []
        for piece in text.split(".")[:3]:
            parts.append(int("".join(itertools.takewhile(str.isdigit, piece)) or 0))
        return tuple(parts) < least
