"""Multi-turn rollouts: the policy generates, an environment answers, the policy goes on.

    turn 0   prompt ──────────────────────────▶ engine ─▶ tokens ─▶ env(...) ─▶ observation
    turn 1   prompt + turn 0 + observation ────▶ engine ─▶ tokens ─▶ env(...) ─▶ ...
    until the env returns nothing, `max_turns` turns, or the response budget (the sampling's
    max_new_tokens, observations included) is spent

The rollout's response holds every turn's tokens and the observations between them, so the
trainer's forward pass sees what the policy saw. `policy_mask` is 1 on the tokens the
policy sampled and 0 on the environment's: the losses leave those out (their log-probs are
0 and their versions -1, as the engines mark positions without a sampled token), and
`turns` counts each row's turns. The built-in engine continues turns inside its decode
loop (Sampler.generate's `respond`: a row's observation goes through the KV cache as its
turn ends, and no row waits for another's); other engines (vLLM) get one generate call per
turn for the rows still going, each prompted with its row so far (vLLM's prefix cache makes
reading it again cheap). Turn t samples from seed + t * TURN_SEED: a row's first turn draws
what a single-turn generation would, and both ways draw the same tokens.

The environment is a module-level function (it travels by reference, as a reward function
does) called on the generating rank, for each row whose turn ended:

    env(prompt, response, **meta) -> observation, or None (or an empty one) when the row
                                      is done

`response` is the turn just generated; meta holds the prompt records' columns it names
("answer", say), `turn` (0 for the first), `transcript` (the whole response so far) and
`stop` (the id of the stop token that ended the turn: with a tokenizer the text leaves it
out, and Llama 3.1's <|eom_id|>, a tool call, and <|eot_id|>, an answer, read alike; None
had the budget ended it). A column named as one of these is refused. With
`tokenizer=` (a local directory) the prompt, response and transcript are text (special
tokens left out, as rewards read them) and an observation may be text (tokenized without
special tokens added) or chat messages, {"role": "tool", "content": ...} or a list of them,
written as the chat template writes them after the assistant's turn, with the next
assistant turn opened (`chat_turns`, as verl's tool agent loop does; a message the template
leaves out, a role it does not know, is refused). Without a tokenizer, they are token ids
(an observation's: a list or tuple, or a 1-D integer numpy array or torch tensor, which
the pool's frames carry as a list). Every id is checked against the engine's
vocabulary (the built-in engine's, vLLM's), text and chat messages' too.
An observation longer than `max_observation_tokens`, or than the budget left, keeps its
first tokens (chat messages keep their markers: their contents are cut; a text is cut to
CHARS_PER_TOKEN characters a token before it is tokenized). A row's budget is the
sampling's max_new_tokens, and with vLLM what its max_model_len leaves after the prompt.
Every rank that generates a row calls the env for it: with tensor parallelism each replica
of a DP chunk does (their calls agree, and one result is kept), so a tool whose side effects
reach outside its row runs once per replica.

With `processes=N` the calls asked together (the rows whose turns ended at one token step,
or in one call) run N at a time in child processes (asyncrl.hybrid.fn_pool: a tool that
runs code, say); with `timeout_s` a call past it ends its row (its process, with whatever
it started, is killed and replaced), and so does a call whose process a signal killed (a
segfault, the OOM killer): the rollout's `env_timeouts` counts both (the log says which).
"""

from __future__ import annotations

import logging
import reprlib
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from asyncrl.comm.batch import TensorBatch
from asyncrl.hybrid.fn_pool import pool_for, pool_settings_ok
from asyncrl.hybrid.sampler import SamplingConfig, left_pad, turn_seed
from asyncrl.hybrid.settings import from_dict, whole_number
from asyncrl.hybrid.user_fn import load_tokenizer, say_lost, taken_by

# a row's turn the environment is asked about: (row, turn, its tokens, the response so far)
Asked = tuple[int, int, list[int], list[int]]
TURN_KEYS = ("turn", "transcript", "stop")  # what the env may take beside the columns
NOT_META = {"prompt", "seed"}
# an observation's text (a chat message's content) is cut to this many characters a token
# before it is tokenized: a tool's 6 MB output took seconds to tokenize, then was cut
CHARS_PER_TOKEN = 64

log = logging.getLogger("asyncrl")


@dataclass(kw_only=True)
class MultiTurn:
    """A role's `multi_turn=` settings."""

    env: Callable[..., Any]
    max_turns: int = 2
    max_observation_tokens: int = 64
    tokenizer: str | None = None
    processes: int = 0  # > 0: the env runs in this many child processes per rank
    timeout_s: float | None = None  # a row's env call past it ends the row (one process)

    def __post_init__(self) -> None:
        if not callable(self.env):
            raise TypeError(f"multi_turn={{'env': ...}} is a module-level function "
                            f"env(prompt, response, **meta), got {self.env!r}")
        counts = (self.max_turns, self.max_observation_tokens)  # (8.0 failed at the first
        if not all(whole_number(n) and n >= 1 for n in counts):  # answer, 2.5 on vLLM only)
            raise ValueError(f"multi_turn: max_turns and max_observation_tokens must be >= 1 "
                             f"(whole numbers), got {self.max_turns!r} and "
                             f"{self.max_observation_tokens!r}")
        self.max_turns, self.max_observation_tokens = int(self.max_turns), int(
            self.max_observation_tokens)
        if not pool_settings_ok(self.processes, self.timeout_s):
            raise ValueError(f"multi_turn: processes must be an int >= 0 and timeout_s a "
                             f"finite number > 0 (or None), got {self.processes!r} and "
                             f"{self.timeout_s!r}")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise TypeError(f"multi_turn={{'tokenizer': ...}} is a local tokenizer directory "
                            f"(each rank loads it), got {type(self.tokenizer).__name__}")


def check_stops(cfg: SamplingConfig) -> None:
    """A turn ends at a stop token: with none, every rollout had one turn and the
    environment was never asked, silently."""
    if not cfg.stop_token_ids:
        raise ValueError("multi_turn= needs stop tokens (a turn ends at one, then the "
                         "environment answers): give sampling={'stop_token_ids': [...]} "
                         "(a preset model has none; a checkpoint's are its "
                         "end-of-sequence ids)")


def multi_turn_config(settings: dict[str, Any] | None) -> MultiTurn | None:
    if settings is None:
        return None
    known = {f.name for f in fields(MultiTurn)}
    if not isinstance(settings, dict) or "env" not in settings:
        raise TypeError(f"multi_turn= is a dict with 'env' (a function) and optionally "
                        f"{sorted(known - {'env'})}; got {settings!r}")
    return from_dict(MultiTurn, settings, "multi_turn=")


def sampled_mask(batch: TensorBatch) -> torch.Tensor:
    """1.0 on the response tokens the policy sampled: all of them, but for a multi-turn
    rollout's observations (its policy_mask)."""
    mask = batch.tensor("response_mask").float()
    return mask * batch.tensor("policy_mask").float() if "policy_mask" in batch else mask


class Turns:
    """Runs multi-turn generations with one engine's `generate`."""

    def __init__(self, cfg: MultiTurn):
        self.cfg = cfg
        self.name = getattr(cfg.env, "__name__", repr(cfg.env))
        self._vocab: int | None = None  # the engine's, where it says (set per generation)
        self._stops: tuple[int, ...] = ()  # the sampling's stop tokens (set per generation)
        self.tok = load_tokenizer(cfg.tokenizer) if cfg.tokenizer is not None else None
        self.pool = pool_for(cfg.env, cfg.processes, cfg.timeout_s, "environment")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def generate(self, engine: Any, batch: TensorBatch, prompts: list[list[int]],
                 seeds: list[int], cfg: SamplingConfig) -> TensorBatch:
        """A multi-turn generation on `engine`: inside its decode loop when it can continue
        turns there (the built-in Sampler), else one `generate` call per turn."""
        check_stops(cfg)
        n = len(prompts)
        self._vocab = getattr(engine, "vocab_size", None)  # (the built-in engine's: checked)
        self._stops = tuple(cfg.stop_token_ids)
        columns = [k for k in batch.keys() if k not in NOT_META and isinstance(batch[k], list)]
        meta_keys = taken_by(self.cfg.env, columns + list(TURN_KEYS), what="environment")
        clash = sorted(set(meta_keys) & set(columns) & set(TURN_KEYS))
        if clash:  # else the turn's value silently replaced the column's
            raise ValueError(f"the prompt records have the column(s) {clash}, and environment "
                             f"{self.name!r} takes {clash} as the turn's own values (of "
                             f"{list(TURN_KEYS)}): rename the column(s) in the records")
        real = batch.real_rows  # a DP chunk's padding rows: one turn, no
        # env call (a tool with side effects would run twice for one row)
        timeouts, crashes, cut = [0] * n, [0] * n, [0] * n

        def respond(asked: list[Asked]) -> list[list[int]]:
            mine = [a for a in asked if a[0] < real]
            seen = dict(zip([a[0] for a in mine],
                            self._observe(batch, prompts, mine, meta_keys, timeouts, crashes,
                                          cut), strict=True))
            return [seen.get(a[0], []) for a in asked]

        if getattr(engine, "continues_turns", False):
            out = engine.generate(prompts, seeds, cfg, respond=respond,
                                  max_turns=self.cfg.max_turns)
        else:
            out = self._turn_by_turn(engine.generate, prompts, seeds, cfg, respond,
                                     getattr(engine, "max_model_len", None))
        # the observations cut to max_observation_tokens, per row: a text one may lose the
        # template's markers that open the next turn, so it is said, not only done
        out = out.union(TensorBatch({"env_truncated": torch.tensor(cut)}))
        if any(cut):
            log.warning("asyncrl: environment %r's observations were cut to "
                        "max_observation_tokens=%d on %d of %d rows (their first tokens "
                        "kept); raise max_observation_tokens to keep them whole", self.name,
                        self.cfg.max_observation_tokens, sum(map(bool, cut)), n)
        if self.pool is not None:  # the env calls that ended their rows: past timeout_s,
            # or their process killed by a signal (with no timeout too: else such a row read
            # as the env's "done", and trained as a finished trajectory, unmarked)
            out = out.union(TensorBatch({"env_timeouts": torch.tensor(timeouts)}))
            say_lost(self.pool.name, self.cfg.timeout_s, timeouts, crashes, "they end there",
                     "counted in env_timeouts")
        return out

    def _turn_by_turn(self, generate: Callable[..., TensorBatch], prompts: list[list[int]],
                      seeds: list[int], cfg: SamplingConfig,
                      respond: Callable[[list[Asked]], list[list[int]]],
                      limit: int | None = None) -> TensorBatch:
        """One engine call per turn for the rows still going, each prompted with its row so
        far (vLLM's prefix cache makes reading it again cheap). A row's budget is
        max_new_tokens, and what `limit` (vLLM's max_model_len) leaves after its prompt: a
        single-turn generation stops there, and an observation past it would make the next
        call refuse the whole batch."""
        n = len(prompts)
        budget = [cfg.max_new_tokens if limit is None else
                  min(cfg.max_new_tokens, limit - len(p)) for p in prompts]
        rows = [_Row() for _ in range(n)]
        active, temperature = list(range(n)), 1.0
        for turn in range(self.cfg.max_turns):
            if not active:
                break
            # (a prompt past the limit has none: the engine refuses it, naming it)
            room = max(1, *(budget[i] - len(rows[i].ids) for i in active))
            out = generate([prompts[i] + rows[i].ids for i in active],
                           [turn_seed(seeds[i], turn) for i in active],
                           replace(cfg, max_new_tokens=room))
            temperature = float(out.meta.get("temperature", 1.0))
            ids, mask, logp, vers = (out.tensor(k).tolist() for k in
                                     ("response_ids", "response_mask", "logprobs", "versions"))
            asked: list[Asked] = []  # the rows the environment answers: budget, turns left
            for j, i in enumerate(active):
                k = min(sum(mask[j]), budget[i] - len(rows[i].ids))  # the mask is a prefix
                rows[i].add(ids[j][:k], 1, logp[j][:k], vers[j][:k])
                rows[i].turns += 1
                # a turn that ended at a stop token, as the built-in engine continues: one
                # cut short (vLLM's max_model_len) is not a turn to answer, and its next
                # prompt would be past the limit (vLLM fails the whole batch)
                stopped = k > 0 and ids[j][k - 1] in cfg.stop_token_ids
                if stopped and len(rows[i].ids) < budget[i] and turn < self.cfg.max_turns - 1:
                    asked.append((i, turn, ids[j][:k], list(rows[i].ids)))
            active = []
            for (i, *_), seen in zip(asked, respond(asked), strict=True):
                seen = seen[:budget[i] - len(rows[i].ids)]
                if seen:
                    rows[i].add(seen, 0, [0.0] * len(seen), [-1] * len(seen))
                    if len(rows[i].ids) < budget[i]:
                        active.append(i)
        return self._batch(rows, prompts, cfg, temperature)

    def _observe(self, batch: TensorBatch, prompts: list[list[int]], asked: list[Asked],
                 meta_keys: list[str], timeouts: list[int], crashes: list[int],
                 cut: list[int]) -> list[list[int]]:
        """The env's observation after each asked row's turn, as token ids within
        max_observation_tokens ([]: the row is done; one cut is counted in `cut`); in this
        process row by row, or in the pool's (a row past its timeout, or whose process a
        signal killed, is done, and counted in `timeouts`; the latter in `crashes` too)."""
        text = self.tok is not None
        jobs = []
        for i, turn, said, response in asked:
            # the stop token that ended the turn (None: the budget did; no engine asks then)
            stop = said[-1] if said and said[-1] in self._stops else None
            extra = {"turn": turn, "stop": stop,
                     "transcript": self._text(response) if text else list(response)}
            jobs.append((self._text(prompts[i]) if text else list(prompts[i]),
                         self._text(said) if text else list(said),
                         {k: extra[k] if k in extra else batch[k][i] for k in meta_keys}))
        if self.pool is not None:
            values, late = self.pool.call(jobs, [f"row {i}, turn {t}" for i, t, *_ in asked])
            for (i, *_), timed_out, crashed in zip(asked, late, self.pool.crashed,
                                                   strict=True):
                timeouts[i] += timed_out
                crashes[i] += crashed
            return [[] if t else self._ids(v, i, turn, said, cut)
                    for (i, turn, said, _), v, t in zip(asked, values, late, strict=True)]
        out = []
        for (i, turn, said, _), (prompt, reply, meta) in zip(asked, jobs, strict=True):
            try:
                value = self.cfg.env(prompt, reply, **meta)
            # as the pool reports it; a sys.exit() in it, too, fails its row, not the rank
            except (Exception, SystemExit, KeyboardInterrupt, GeneratorExit) as e:
                raise ValueError(f"environment {self.name!r} failed on row {i}, turn {turn}:"
                                 f"\n{traceback.format_exc()}") from e
            out.append(self._ids(value, i, turn, said, cut))
        return out

    def _text(self, ids: Sequence[int]) -> str:
        assert self.tok is not None
        return str(self.tok.decode(list(ids), skip_special_tokens=True))

    def _ids(self, value: Any, i: int, turn: int, said: list[int], cut: list[int]
             ) -> list[int]:
        """An observation as token ids within the model's vocabulary, cut to
        max_observation_tokens (counted in `cut`)."""
        if value is None:
            return []
        if isinstance(value, dict) and self.tok is not None:
            value = [value]
        # (a tuple as a list: through the pool's frames a tuple arrives as one)
        if isinstance(value, list | tuple) and value and \
                all(isinstance(m, dict) for m in value) and self.tok is not None:
            ids, shortened = self._chat(list(value), said, f"row {i}, turn {turn}")
            cut[i] += shortened
            return self._in_vocab(ids, i, turn, "chat messages")
        limit = self.cfg.max_observation_tokens
        if isinstance(value, str) and self.tok is not None:  # its first characters only
            ids = self._encode(value[:limit * CHARS_PER_TOKEN])
            cut[i] += len(value) > limit * CHARS_PER_TOKEN or len(ids) > limit
            return self._in_vocab(ids[:limit], i, turn, "text")
        ids = self._in_vocab(self._token_ids(value, i, turn), i, turn)
        cut[i] += len(ids) > limit
        return ids[:limit]

    def _in_vocab(self, ids: list[int], i: int, turn: int, tokenized: str | None = None
                  ) -> list[int]:
        """`ids`, each within the model's vocabulary: past it, the built-in engine failed
        with torch's IndexError deep in its decode loop, vLLM refused the next turn blaming
        the prompt, or (the row's budget spent) the id reached the trainer's embedding.
        `tokenized`: what the tokenizer made them of (its ids may pass the model's)."""
        # the vocabulary unknown (an engine that does not say), what a token tensor holds
        limit = self._vocab if self._vocab is not None else 2 ** 63
        outside = [t for t in ids if not 0 <= t < limit]
        if not outside:
            return ids
        of = f" of {self._vocab}" if self._vocab is not None else ""
        what, fix = "token ids", f"; return ids in [0, {limit})" if of else "; return ids >= 0"
        if tokenized:
            what = f"{tokenized} whose token ids (multi_turn's tokenizer's) are"
            fix = "; give multi_turn the model's own tokenizer (this one has ids it lacks)"
        raise ValueError(f"environment {self.name!r} returned {what} outside the model's "
                         f"vocabulary{of} ({outside[:5]}) for row {i}, turn {turn}{fix}")

    def _token_ids(self, value: Any, i: int, turn: int) -> list[int]:
        ids = value
        if getattr(value, "ndim", None) == 1 and callable(getattr(value, "tolist", None)):
            ids = value.tolist()  # a numpy array's or torch tensor's (floats refused below)
        if isinstance(ids, list | tuple) and all(map(whole_number, ids)):
            return [int(t) for t in ids]
        hint = "text, chat messages or token ids" if self.tok is not None else \
            "token ids (text needs multi_turn={'tokenizer': DIR})"
        kind = f" (a {type(value).__name__})" if not isinstance(value, list | tuple) else ""
        raise TypeError(f"environment {self.name!r} returned {reprlib.repr(value)}{kind} for "
                        f"row {i}, turn {turn}: it returns an observation as {hint} (a list, "
                        f"or a 1-D integer array), or None when the row is done")

    def _encode(self, text: str) -> list[int]:
        assert self.tok is not None
        return [int(t) for t in self.tok(text, add_special_tokens=False)["input_ids"]]

    def _chat(self, messages: list[dict[str, Any]], said: list[int], where: str
              ) -> tuple[list[int], bool]:
        """Rendered chat messages within max_observation_tokens, and whether they were cut:
        the messages' contents are (their last tokens first), never the template's markers,
        which the next turn needs whole."""
        limit = self.cfg.max_observation_tokens
        chars = limit * CHARS_PER_TOKEN  # a text content's first characters only
        long = any(isinstance(m.get("content"), str) and len(m["content"]) > chars
                   for m in messages)
        messages = [{**m, "content": m["content"][:chars]} if isinstance(m.get("content"), str)
                    else m for m in messages]
        ids = self._encode(chat_turns(self.tok, messages, said, where, self._stops))
        untouched = False
        for attempt in range(3):  # re-tokenizing a cut content may shift a token or two
            over = len(ids) - limit
            if over <= 0:
                return ids, long or attempt > 0
            messages = [dict(m) for m in messages]
            for m in reversed(messages):
                if not isinstance(m.get("content"), str):  # none, or parts (text, images):
                    untouched = True  # cut as text they would become their Python repr
                    continue
                content = self._encode(m["content"])
                keep = max(0, len(content) - over)
                over -= len(content) - keep
                m["content"] = self._text(content[:keep])
                if over <= 0:
                    break
            ids = self._encode(chat_turns(self.tok, messages, said, where, self._stops))
        if len(ids) > limit and untouched:
            raise ValueError(f"{where}: the environment's messages take {len(ids)} tokens, more "
                             f"than max_observation_tokens={limit}, and a content that is not "
                             f"text (None, or a list of parts) cannot be cut: return text "
                             f"contents, or raise the limit")
        if len(ids) > limit:
            raise ValueError(f"{where}: the chat template's markers around the environment's "
                             f"messages take {len(ids)} tokens, more than max_observation_tokens"
                             f"={limit}; raise it")
        return ids, True

    @staticmethod
    def _batch(rows: list[_Row], prompts: list[list[int]], cfg: SamplingConfig,
               temperature: float) -> TensorBatch:
        """The engines' columns (the response right-padded to the budget), with
        policy_mask and turns."""
        n, width = len(rows), cfg.max_new_tokens
        prompt_ids, prompt_mask = left_pad(prompts, cfg.pad_token_id)
        cols = {"response_ids": torch.full((n, width), cfg.pad_token_id, dtype=torch.long),
                "response_mask": torch.zeros((n, width), dtype=torch.long),
                "logprobs": torch.zeros((n, width), dtype=torch.float32),
                "versions": torch.full((n, width), -1, dtype=torch.long),
                "policy_mask": torch.zeros((n, width), dtype=torch.long)}
        for i, row in enumerate(rows):
            k = len(row.ids)
            cols["response_ids"][i, :k] = torch.tensor(row.ids, dtype=torch.long)
            cols["response_mask"][i, :k] = 1
            cols["logprobs"][i, :k] = torch.tensor(row.logp, dtype=torch.float32)
            cols["versions"][i, :k] = torch.tensor(row.versions, dtype=torch.long)
            cols["policy_mask"][i, :k] = torch.tensor(row.own, dtype=torch.long)
        return TensorBatch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, **cols,
                            "turns": torch.tensor([r.turns for r in rows], dtype=torch.long)},
                           {"temperature": temperature})


MARK = "asyncrl-assistant-turn"  # an assistant message's content, found again in the text


def chat_turns(tok: Any, messages: list[dict[str, Any]], said: list[int], where: str,
               stops: Sequence[int] = ()) -> str:
    """Chat messages (a tool's answer, a user's reply) as the tokenizer's chat template writes
    them after an assistant turn, the next assistant turn opened: the template's text of a
    conversation ending with them after the assistant's content, less the end-of-turn token
    the generated turn stopped at (the newline the template puts after it stays), or, for a
    turn that stopped at one of `stops` (the sampling's), another of them the template closes
    the turn with (see `_held`). Only the text after the assistant's content is read: a
    template may write earlier turns differently once later ones follow (Qwen3 drops an
    empty think block). A message whose text content the template leaves out (Qwen's writes
    only the roles it knows) is refused: the observation would have lost it, unsaid."""
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{where}: the environment returned chat messages, but the tokenizer "
                         f"has no chat template; return text or token ids")
    for m in messages:
        if not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"{where}: the environment's chat message {reprlib.repr(m)} needs "
                             f"a str 'role' and a 'content' (a tool's output: "
                             f"{{'role': 'tool', 'content': ...}}); or return it as text")
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": MARK}]
    text = _render(tok, base + messages, messages, where)
    if MARK not in text:
        raise ValueError(f"{where}: this chat template does not write the assistant's content "
                         f"as given; return the observation as text")
    after = text[text.rindex(MARK) + len(MARK):]
    unseen = [k for k, m in enumerate(messages)  # (stripped: some templates trim a content)
              if isinstance(m["content"], str) and m["content"].strip() not in after]
    if unseen:  # or written escaped (a template's tojson): a mark in its place must show
        probe = _render(tok, base + [{**m, "content": f"asyncrl-message-{k}-end"}
                                     for k, m in enumerate(messages)], messages, where)
        for k in unseen:
            if f"asyncrl-message-{k}-end" not in probe:
                raise ValueError(f"{where}: the chat template leaves out the environment's "
                                 f"message with role {messages[k]['role']!r} (a role it does "
                                 f"not write); use a role the template writes (a tool's "
                                 f"output: 'tool')")
    return after[_held(tok, after, said, stops):]


def _held(tok: Any, after: str, said: list[int], stops: Sequence[int]) -> int:
    """How much of `after` (the template's text after the assistant's content) the turn
    already holds: the end-of-turn marker it stopped at (ChatML's <|im_end|>), with the
    whitespace before it; for a turn stopped at a stop token that is a special token (an
    end-of-turn marker), another stop token's marker too: Llama 3.1 stops a tool call at
    <|eom_id|> and its template closes the turn with <|eot_id|>, which the transcript would
    have after it. A turn stopped at a plain stop token (Qwen's </tool_call>, not special)
    keeps the template's marker: without it, the assistant's turn would never be closed."""
    if not said:
        return 0
    added = (getattr(tok, "added_tokens_decoder", None) or {}).get(said[-1])
    special = getattr(added, "special", False) or \
        said[-1] in set(getattr(tok, "all_special_ids", None) or ())  # (Llama 3.1's are only
    # flagged special where they are added: its special tokens map names bos and eos alone)
    ended = [said[-1]] + ([s for s in stops if s != said[-1]]
                          if special and said[-1] in stops else [])
    marks = [str(tok.decode([t], skip_special_tokens=False)).strip() for t in ended]
    space = len(after) - len(after.lstrip())
    found = [len(m) for m in marks if m and after[space:].startswith(m)]
    return space + max(found) if found else 0


def _render(tok: Any, conversation: list[dict[str, Any]], messages: list[dict[str, Any]],
            where: str) -> str:
    try:
        return str(tok.apply_chat_template(conversation, tokenize=False,
                                           add_generation_prompt=True))
    except Exception as e:  # jinja's TemplateError: a role the template does not know
        raise ValueError(f"{where}: the tokenizer's chat template refused the environment's "
                         f"messages {reprlib.repr(messages)}: {e}") from None


class _Row:
    """One row's response so far: tokens, who produced each, log-probs, versions."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.own: list[int] = []
        self.logp: list[float] = []
        self.versions: list[int] = []
        self.turns = 0

    def add(self, ids: list[int], own: int, logp: list[float], versions: list[int]) -> None:
        self.ids += ids
        self.own += [own] * len(ids)
        self.logp += logp
        self.versions += versions
