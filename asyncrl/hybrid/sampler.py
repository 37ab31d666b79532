"""The built-in generation engine: batched sampling with a KV cache, in plain torch.

    prompts (left-padded) ─▶ prefill ─▶ loop: last logits / temperature ─▶ top-p ─▶ sample
                                             (one uniform per sample: hash of its seed, step)
                                        ─▶ append, extend the cache, stop on a stop token

Reports each sampled token's log-prob under log_softmax(logits / temperature) — the same
quantity `models.sequence_logprobs` computes in a training forward pass at that temperature,
which the result's meta carries ("temperature": training and the reference read it, as
verl's actor divides by the rollout temperature) — and the policy version of the weights
that produced it ("versions").

Interruptible: `load_weights` may be called from another thread (a `concurrent=True` method)
while a generation runs; it waits for the current token step to end, swaps the weights in
place, and the generation continues the same sequences with the new weights (its KV cache
and the tokens produced so far are kept, each token tagged with its version).
"""

from __future__ import annotations

import inspect
import math
import numbers
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from asyncrl.comm import codec
from asyncrl.comm.batch import TensorBatch
from asyncrl.hybrid.models import positions
from asyncrl.hybrid.settings import whole_number


@dataclass(kw_only=True)
class SamplingConfig:
    temperature: float = 1.0  # 0: greedy (the most likely token; log-probs at temperature 1)
    top_p: float = 1.0  # < 1: log-probs are still the whole temperature-scaled distribution's
    # (what the trainer computes: the ratio starts at 1), not the nucleus the token was drawn
    # from (their log Z higher): an off-policy correction sees that bias, as with verl's vLLM
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # ("0.7" failed with Python's TypeError)
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"SamplingConfig.{name} must be a number, got {value!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:  # (NaN failed
            # every step, blamed on the weights)
            raise ValueError(f"SamplingConfig.temperature must be >= 0 (0: greedy decoding), "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if not whole_number(self.max_new_tokens) or self.max_new_tokens < 1:  # (2.5 failed deep
            raise ValueError(f"SamplingConfig.max_new_tokens must be an int >= 1, got "  # in
                             f"{self.max_new_tokens!r}")  # torch)
        stops = self.stop_token_ids
        ids = [self.pad_token_id, *stops] if isinstance(stops, list | tuple) else None
        if ids is None or not all(whole_number(i) and i >= 0 for i in ids):
            raise ValueError(f"SamplingConfig: pad_token_id and stop_token_ids are token ids "
                             f"(an int >= 0, and a list of them), got {self.pad_token_id!r} "
                             f"and {stops!r}")
        # plain ints (a tokenizer's may be numpy's)
        self.max_new_tokens, self.pad_token_id = int(self.max_new_tokens), int(self.pad_token_id)
        self.stop_token_ids = type(stops)(int(i) for i in stops)


def with_overrides(cfg: SamplingConfig, overrides: dict[str, Any] | None) -> SamplingConfig:
    """`cfg` with some fields changed for one call (validation's greedy decoding, say)."""
    if not overrides:
        return cfg
    known = {f.name for f in fields(SamplingConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"sampling={overrides!r}: {unknown} are not sampling settings; they "
                         f"are {sorted(known)}")
    return replace(cfg, **overrides)  # checked again


# a prompt batch's meta: the width generation pads its prompt columns to at least (a
# PromptSource's max_prompt_length), so that rollouts of separate calls concatenate
PROMPT_WIDTH = "prompt_width"
# the columns generation writes beside the prompts' (here; multi-turn's Turns adds
# env_truncated and env_timeouts): a prompt record must not have one (PromptSource refuses it)
GENERATED = frozenset({"prompt_ids", "prompt_mask", "response_ids", "response_mask",
                       "logprobs", "versions", "policy_mask", "turns", "env_truncated",
                       "env_timeouts"})


def left_pad(prompts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(list(p))
        mask[i, width - len(p):] = 1
    return ids, mask


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits outside the smallest set of tokens whose probability reaches top_p -> -inf."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # ties at the
    # boundary kept by lowest token id, on every device
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's stream increment
TURN_SEED = 0x632BE59BD9B4E019  # turn t of a sample draws from seed + t * TURN_SEED


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a sample's turn `turn`: below 2**63, as vLLM keeps seeds (int64 arrays)."""
    return (int(seed) + turn * TURN_SEED) % 2**63


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: uint64 -> uint64, every output bit depends on every input bit
    (numpy's uint64 arithmetic wraps modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def streams(seeds: Sequence[int]) -> np.ndarray:
    """Each sample's random stream, from its seed (any Python int, taken modulo 2**64)."""
    return _mix(np.asarray([int(s) % 2**64 for s in seeds], dtype=np.uint64))


def uniforms(stream: np.ndarray, step: int | Sequence[int]) -> torch.Tensor:
    """One uniform in [0, 1) per sample for token `step` (one for all, or one per sample), a
    function of (seed, step) only: a sample draws the same tokens whatever batch it is in,
    on any device, and the whole batch draws at once (a generator per sample cost 40 % of
    generation in a Python loop)."""
    steps = np.asarray([step] if isinstance(step, int) else step, dtype=np.int64)
    # uint64 arrays wrap modulo 2**64 (negative steps too: a fed row's draw, never used)
    z = _mix(np.atleast_1d(stream) + (steps.astype(np.uint64) + np.uint64(1)) *
             np.uint64(_GOLDEN))
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, a row per sample: the first token whose cumulative probability
    exceeds u times the row's total. Never a zero-probability token (one top-p removed): its
    cumulative value is made its predecessor's (a GPU's parallel scan adds in another order
    per element, so it may differ, even decrease), and a u that rounds up to the total takes
    the last token with a probability. In fp32, as the probabilities (a 150k vocabulary's
    fp64 cumsum is large)."""
    if probs.isnan().any():
        raise ValueError("sampling: the next-token probabilities contain NaN (NaN or inf "
                         "logits: check the model's weights and dtype)")
    cdf = probs.float().cumsum(-1)
    cdf = torch.where(probs > 0, cdf, 0.0).cummax(-1).values
    target = u.to(cdf.device, torch.float32)[:, None] * cdf[:, -1:]
    token = torch.searchsorted(cdf, target, right=True)[:, 0]
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(token, last)
# (fp32's spacing near a cumulative 0.5 is 6e-8: a token less likely than that is drawn with
# 0 or 6e-8, not its probability; on a 150k vocabulary ~6e-4 of total variation between
# the distribution sampled and the one whose log-probs are reported)


def _cache_of(res: Any) -> Any:
    cache = next((res[k] for k in ("cache", "past_key_values") if k in res), None)
    if cache is None:  # (a bare KeyError('cache') after the prefill said nothing of why)
        raise ValueError(f"the model returned no KV cache (use_cache=True ignored); the "
                         f"built-in engine needs one ({type(res).__name__} has no "
                         f"past_key_values): have the model's forward (or a wrapper's) pass "
                         f"use_cache and past_key_values through and return them, or use "
                         f"engine='vllm'")
    return cache


class Sampler:
    """Generation engine interface: generate, load_weights, sleep/wake, pause/resume."""

    owns_weights = False  # its model's parameters may be written directly (the hybrid engine)

    def __init__(self, model: torch.nn.Module, config: SamplingConfig | None = None):
        self.model = model
        self.config = config or SamplingConfig()
        # transformers 5 names the KV cache `cache`; earlier releases `past_key_values`
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # the prefill needs the last position's logits only: [B, T, vocab] of them would be
        # tens of GB for long prompts and a 150k vocabulary
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.asleep = False
        self._running = threading.Event()  # cleared while paused: generation holds at a
        self._running.set()  # token boundary until resume()
        self.version = 0  # the policy version of the weights held (set by load_weights)
        self._step = threading.Lock()  # one forward pass, or one weight swap, at a time
        self.on_token: Any = None  # called with the step index between token steps

    continues_turns = True  # generate(..., respond=) runs a multi-turn rollout in one loop

    @property
    def vocab_size(self) -> int:
        """The token ids its model embeds: 0 .. vocab_size - 1."""
        embeddings: Any = self.model.get_input_embeddings()  # type: ignore[operator]
        return int(embeddings.num_embeddings)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                 config: SamplingConfig | None = None, respond: Any = None,
                 max_turns: int = 1) -> TensorBatch:
        """prompt_ids/prompt_mask (left-padded), response_ids/response_mask (a prefix of
        each row), logprobs of the response tokens (0 elsewhere), and versions: the policy
        version that sampled each token (-1 elsewhere).

        Multi-turn (asyncrl.hybrid.turns): `respond([(row, turn, said, response), ...])`
        is called at the end of a token step for the rows whose turn just ended at a stop
        token with turns and budget left; each row it answers with tokens feeds them in,
        one a step, through the KV cache (no prefill again, no row waiting for another's
        turn), then samples its next turn from seed + turn * TURN_SEED; a row answered
        with none is done. The result then holds policy_mask (1 where sampled) and turns."""
        cfg = config or self.config
        if self.asleep or self.paused:
            raise RuntimeError("the engine is asleep (its weights were released): wake() it "
                               "before generating" if self.asleep else
                               "the engine is paused: resume() it before generating")
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; give "
                             f"one seed per sample")
        vocab = self.vocab_size
        for i, p in enumerate(prompts):  # else an IndexError deep in torch's embedding
            outside = [t for t in p if not 0 <= t < vocab]
            if outside:
                raise ValueError(f"generate: prompt {i} has token ids outside the model's "
                                 f"vocabulary of {vocab} ({outside[:5]}): tokenize with the "
                                 f"model's own tokenizer")
        if not 0 <= cfg.pad_token_id < vocab:  # left padding is embedded too
            raise ValueError(f"generate: pad_token_id={cfg.pad_token_id} is outside the "
                             f"model's vocabulary of {vocab}; use one of its ids (0, or its "
                             f"tokenizer's pad_token_id)")
        # learned positions (GPT-2): past them an IndexError (a GPU: an assert that ends the
        # CUDA context); rotary ones (Llama): positions never trained on, said by nothing
        # (vLLM refuses or cuts such rows at max_model_len), unless rope_scaling extends
        # them (YaRN keeps the original max_position_embeddings)
        c = self.model.config
        rope = getattr(c, "rope_parameters" if hasattr(c, "rope_parameters") else  # (5.x:
                       "rope_scaling", None) or {}  # rope_scaling deprecated; "default" there)
        extended = rope.get("rope_type", rope.get("type", "default")) != "default"
        limit = getattr(c, "n_positions", None) or (
            None if extended else getattr(c, "max_position_embeddings", None))
        longest = max((len(p) for p in prompts), default=0) + cfg.max_new_tokens
        if limit is not None and longest > limit:
            raise ValueError(
                f"generate: the longest prompt plus max_new_tokens={cfg.max_new_tokens} is "
                f"{longest} positions, beyond the model's {limit}: shorten the prompts or "
                f"lower max_new_tokens")
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask = (t.to(device) for t in left_pad(prompts, cfg.pad_token_id))
        stream = streams(seeds)
        b, n = len(prompts), cfg.max_new_tokens
        out_ids = torch.full((b, n), cfg.pad_token_id, dtype=torch.long, device=device)
        out_mask = torch.zeros((b, n), dtype=torch.long, device=device)
        out_logp = torch.zeros((b, n), dtype=torch.float32, device=device)
        out_version = torch.full((b, n), -1, dtype=torch.long)
        sampled = torch.ones((b, n), dtype=torch.long)  # 0: a token fed in by `respond`
        alive = torch.ones(b, dtype=torch.bool, device=device)
        stops = torch.as_tensor(list(cfg.stop_token_ids), dtype=torch.long, device=device)
        turn, began = [0] * b, [0] * b  # each row's turn, and the step its turn began at
        forced: list[list[int]] = [[] for _ in range(b)]  # tokens to feed each row next
        feeding: set[int] = set()  # the rows with some
        mask = prompt_mask
        with self._step:
            res = self.model(input_ids=prompt_ids, attention_mask=mask,
                             position_ids=positions(mask), use_cache=True, **self._last_only)
            version = self.version  # of the weights behind `logits`
        cache, logits = _cache_of(res), res.logits[:, -1]
        for step in range(n):
            if step and self.on_token is not None:
                self.on_token(step)  # between token steps: weights may be swapped here
            self._running.wait()  # paused: held here, between token steps, until resume()
            scaled = logits.float() / (cfg.temperature or 1.0)
            logp_all = F.log_softmax(scaled, -1)
            if cfg.temperature == 0:  # greedy (as vLLM: log-probs before any temperature)
                if scaled.isnan().any() or scaled.isposinf().any():  # (argmax takes NaN
                    # or +inf for the largest: garbage out, a log-prob of NaN)
                    raise ValueError("greedy decoding: the next-token logits contain NaN or "
                                     "+inf (check the model's weights and dtype)")
                token = scaled.argmax(-1)
            else:
                probs = top_p_filter(scaled, cfg.top_p).softmax(-1)
                token = sample(probs, uniforms(stream, [step - k for k in began]
                                               if respond is not None else step))
            token = torch.where(alive, token, torch.full_like(token, cfg.pad_token_id))
            logp = torch.where(alive, logp_all.gather(1, token[:, None])[:, 0],
                               torch.zeros_like(token, dtype=torch.float))
            fed = sorted(i for i in feeding if forced[i])  # the environment's tokens, in
            if fed:  # place of what was sampled: one write for all the rows
                at = torch.tensor(fed, device=device)
                token[at] = torch.tensor([forced[i].pop(0) for i in fed], device=device)
                logp[at] = 0.0
                sampled[fed, step] = 0
            out_ids[:, step] = token
            out_mask[:, step] = alive.long()
            out_version[:, step] = torch.where(alive.cpu(), version, -1)
            if fed:
                out_version[fed, step] = -1
            out_logp[:, step] = logp
            if stops.numel():
                ended = alive & torch.isin(token, stops)
                if fed:  # a fed token never ends a turn
                    ended[at] = False
                if respond is not None and step < n - 1 and bool(ended.any()):
                    stream = self._next_turns(respond, ended, turn, began, forced, stream,
                                              seeds, out_ids, step, max_turns)
                    feeding = {i for i in range(b) if forced[i]}
                    ended &= torch.tensor([not f for f in forced], device=device)
                alive = alive & ~ended
            if not alive.any() or step == n - 1:
                break
            mask = torch.cat([mask, alive.long()[:, None] | out_mask[:, step:step + 1]], dim=1)
            pos = positions(mask)[:, -1:]
            with self._step:  # a forward pass reads the weights: no swap in the middle
                res = self.model(input_ids=token[:, None], attention_mask=mask,
                                 position_ids=pos, use_cache=True, **{self._cache_arg: cache})
                version = self.version
            cache, logits = _cache_of(res), res.logits[:, -1]
        columns = {"prompt_ids": prompt_ids.cpu(), "prompt_mask": prompt_mask.cpu(),
                   "response_ids": out_ids.cpu(), "response_mask": out_mask.cpu(),
                   "logprobs": out_logp.cpu(), "versions": out_version}
        if respond is not None:
            columns["policy_mask"] = sampled * out_mask.cpu()
            columns["turns"] = torch.tensor([t + 1 for t in turn], dtype=torch.long)
        return TensorBatch(columns, {"temperature": cfg.temperature or 1.0})

    @staticmethod
    def _next_turns(respond: Any, ended: torch.Tensor, turn: list[int], began: list[int],
                    forced: list[list[int]], stream: np.ndarray, seeds: Sequence[int],
                    out_ids: torch.Tensor, step: int, max_turns: int) -> np.ndarray:
        """Ask `respond` about the rows whose turn ended at `step`; queue its answers (cut
        to the budget) and start those rows' next turns: their own random streams."""
        rows = [i for i in ended.nonzero()[:, 0].tolist() if turn[i] < max_turns - 1]
        if not rows:
            return stream
        ids = out_ids[rows, :step + 1].tolist()
        answers = respond([(i, turn[i], ids[j][began[i]:], ids[j])
                           for j, i in enumerate(rows)])
        stream = stream.copy()
        room = out_ids.shape[1] - step - 1
        for i, seen in zip(rows, answers, strict=True):
            seen = list(seen)[:room]
            if seen and len(seen) < room:  # room left to sample after it
                forced[i] = seen
                turn[i] += 1
                began[i] = step + 1 + len(seen)
                stream[i] = streams([turn_seed(seeds[i], turn[i])])[0]
            elif seen:  # the budget ends inside the observation: it is the row's last
                forced[i] = seen
        return stream

    def _match(self, named: Iterable[tuple[str, torch.Tensor]], what: str,
               whole: bool = False) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(parameter, new value) for each entry, all checked before any is used: a bad
        entry changes nothing. Tied weights answer to each of their names, with one value;
        `whole`: every weight of the model is given (a trainer's full pack)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        pairs = []
        given: dict[int, tuple[str, torch.Tensor]] = {}  # id(parameter): its name, value
        tie = ("(the trainer's model and this engine's tie lm_head to the embeddings "
               "differently: give both the same tie_word_embeddings)")
        for name, value in named:
            param = params.get(name)
            if param is None:
                raise KeyError(f"{what}: the engine's model has no parameter {name!r}")
            if value.shape != param.shape:
                raise ValueError(f"{what}: {name} is {tuple(value.shape)}, the model's is "
                                 f"{tuple(param.shape)}")
            first = given.setdefault(id(param), (name, value))
            if first[1] is not value and first[1].data_ptr() != value.data_ptr() and \
                    not torch.equal(first[1], value):  # (a copy of a tied model's: one)
                raise ValueError(f"{what}: {first[0]} and {name} are one tied weight in the "
                                 f"engine's model, but two weights were given {tie}")
            pairs.append((param, value))
        left = [n for n, p in self.model.named_parameters() if id(p) not in given] \
            if whole else []
        if left:
            raise ValueError(f"{what}: the weights given leave out {left[:4]} of the "
                             f"engine's model {tie}")
        return pairs

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]],
                     version: int | None = None) -> int:
        """Copy new weights in, by name, in place (the model's memory kept), between two
        token steps of a running generation; `version` tags the tokens sampled from now on."""
        pairs = self._match(named, "load_weights")
        # every value checked before any is copied in: one that has no values to copy (a
        # meta tensor) leaves the old weights whole under the old version. Copied one at a
        # time, not converted all first: a resume's CPU state dict would hold a second copy
        # of the model on the GPU (only one tensor's conversion can fail midway: memory)
        for _, value in pairs:
            try:
                codec.check_sendable(value)  # (its raw values are all of it)
            except TypeError as e:
                raise TypeError(f"load_weights: a weight cannot be copied in: {e}") from None
        with self._step, torch.no_grad():
            for param, value in pairs:
                param.copy_(value)
            if version is not None:
                self.version = version
        return len(pairs)

    def adopt_weights(self, named: Iterable[tuple[str, torch.Tensor]],
                      version: int | None = None, whole: bool = False) -> int:
        """Make the given tensors the model's weights (no copy: e.g. views into a buffer just
        pulled from a trainer; a copy where the device or dtype differs: a bf16 trainer's
        pack for an fp32 engine), between two token steps; how many. `whole`: they are
        every weight of the model."""
        pairs = self._match(named, "adopt_weights", whole)
        # every copy made before any is adopted: one failing (out of memory) leaves the old
        # weights whole, never some new ones under the old version (and none made under
        # the step lock: generation goes on meanwhile). The price: a pack of another device
        # or dtype holds a second copy of the weights it converts for that moment
        made = [value.to(param.device, param.dtype) for param, value in pairs]
        with self._step:
            for (param, _), value in zip(pairs, made, strict=True):
                param.data = value
            if version is not None:
                self.version = version
        return len(pairs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights held, by name (a checkpoint of a rollout)."""
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Weights of `state_dict()` back in, with their version."""
        self.load_weights(state.items(), version)

    def sleep(self, level: int = 1) -> None:
        self.asleep = True

    def wake(self) -> None:
        self.asleep = False

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self) -> None:
        """Hold a generation in flight at its next token boundary (its tokens kept; weights
        may be loaded meanwhile, from another thread), and refuse new ones, until resume()."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()
