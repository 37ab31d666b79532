"""Calling a user's function on a batch's rows, for rewards and environments alike: the
meta columns it names, and a local tokenizer when it reads text."""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("asyncrl")


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer from a local directory or a Hub model in the local cache (the id a model
    is given by), or the tokenizer object given."""
    if not isinstance(tokenizer, str | os.PathLike):
        if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
            raise TypeError(f"tokenizer: give a local tokenizer directory or a Hugging Face "
                            f"tokenizer, got {type(tokenizer).__name__}")
        return tokenizer
    from transformers import AutoTokenizer

    from asyncrl.hybrid.models import model_folder

    try:
        folder = model_folder(os.fspath(tokenizer))
    except ValueError:
        raise FileNotFoundError(f"tokenizer {os.fspath(tokenizer)!r} is not a directory; give "
                                f"the local folder of a model or tokenizer (its "
                                f"tokenizer.json or vocabulary files) or the id of a Hub "
                                f"model in the local cache (nothing is downloaded)") from None
    try:  # (not given, transformers asks on a terminal whether to run the folder's code)
        return AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                             trust_remote_code=False)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(f"tokenizer {os.fspath(tokenizer)!r} needs code of its own (an "
                         f"auto_map in its tokenizer_config.json or config.json), and asyncrl "
                         f"does not run a tokenizer's code: give a folder with a plain "
                         f"tokenizer.json and a tokenizer_config.json without auto_map "
                         f"(tokenizer_class 'PreTrainedTokenizerFast'), or, where a tokenizer "
                         f"object is taken (PromptSource), one you loaded yourself") from None


def taken_by(fn: Callable[..., Any], keys: list[str], what: str = "reward function"
             ) -> list[str]:
    """The meta keys `fn` takes as keywords: all of them if it has **kwargs, else those it
    names after (prompt, response) (a column added upstream, such as raw_prompt, does not
    break a function that ignores it). A parameter it needs that no column fills is refused,
    naming the columns; one with a default that none fills, while columns go unused, is
    warned of (a misspelt name would score with its default)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: give it everything
        return keys
    name = getattr(fn, "__name__", repr(fn))
    slots = _response_slots(params)
    # (prompt, response), given positionally: a keyword of the same name would clash
    own = {p.name for p in slots if p.kind is p.POSITIONAL_OR_KEYWORD}
    if own & set(keys) and (name, tuple(sorted(own & set(keys)))) not in _warned:
        _warned.add((name, tuple(sorted(own & set(keys)))))
        log.warning("asyncrl: %s %r is not given the column(s) %s: they are named as its "
                    "own first parameters (the prompt and the response); rename them in the "
                    "prompt records to pass them", what, name, sorted(own & set(keys)))
    keys = [k for k in keys if k not in own]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return keys
    named = [p for p in params if p not in slots
             and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    taken = [k for k in keys if k in {p.name for p in named}]
    missing = [p.name for p in named if p.name not in keys and p.default is p.empty]
    if missing:
        raise TypeError(f"{what} {name!r} takes {missing}, which the batch has no "
                        f"column for; its columns: {keys} (rename the parameters, or add the "
                        f"keys to the prompt records)")
    unused = [k for k in keys if k not in taken]
    defaulted = [p.name for p in named if p.name not in keys and p.default is not p.empty]
    if unused and defaulted and (name, tuple(defaulted)) not in _warned:
        _warned.add((name, tuple(defaulted)))
        log.warning("asyncrl: %s %r gets no column for %s (they keep their defaults) "
                    "while the columns %s go unused: a misspelt parameter?", what, name,
                    defaulted, unused)
    return taken


def _response_slots(params: list[inspect.Parameter]) -> list[inspect.Parameter]:
    """The parameters the prompt and the response fill, given positionally: the first two
    positional ones, or fewer and a *args that takes the rest (`def f(*args, answer)`)."""
    slots: list[inspect.Parameter] = []
    for p in params[:2]:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL):
            break
        slots.append(p)
        if p.kind is p.VAR_POSITIONAL:
            break
    return slots


_warned: set[tuple[str, tuple[str, ...]]] = set()


def say_lost(name: str, timeout_s: float | None, late: Sequence[Any], crashed: Sequence[Any],
             then: str, counted: str) -> None:
    """Warn of the rows a pool's calls lost, by cause: past `timeout_s`, or their process
    killed by a signal (with no timeout_s too); `then`: what becomes of them, `counted`:
    where the batch says which."""
    n = len(late)
    hung = sum(bool(t) and not c for t, c in zip(late, crashed, strict=True))
    if hung:
        log.warning("asyncrl: %s ran past %s s on %d of %d rows; %s", name, timeout_s, hung, n,
                    then)
    if any(crashed):
        log.warning("asyncrl: %s crashed (its process killed by a signal: a segfault, the OOM "
                    "killer) on %d of %d rows; %s (%s)", name, sum(map(bool, crashed)), n,
                    then, counted)
