"""Text in, token ids out, and back: prompts given as text or as chat messages become the
token ids the engines take (a chat through the tokenizer's chat template, with the
assistant's turn opened), and rewards may read text instead of ids.

A tokenizer is a local Hugging Face tokenizer directory (nothing is downloaded) or a loaded
tokenizer object (`asyncrl.hybrid.user_fn.load_tokenizer`); workers on other ranks are
given the directory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncrl.hybrid.user_fn import load_tokenizer  # noqa: F401 - flow files import it here


def is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def prompt_ids(tok: Any, value: Any, where: str) -> list[int]:
    """The token ids of a prompt: text (tokenized as the model's tokenizer does, its special
    tokens added unless it starts with the BOS: the chat template's text), chat messages
    [{"role", "content"}] (through the chat template, the assistant's turn opened:
    add_generation_prompt), or token ids already; never none."""
    ids = _ids(tok, value, where)
    if not ids:
        raise ValueError(f"{where}: the prompt {value!r} has no tokens; generation needs at "
                         f"least one")
    return ids


def as_list(value: Any) -> Any:
    """A tuple, or a 1-D array (records of pandas' read_parquet), as a list; else `value`."""
    if isinstance(value, tuple):
        return list(value)
    return value.tolist() if hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1 \
        else value


_SCALARS = frozenset({str, int, float, bool, type(None)})


def plain(value: Any) -> Any:
    """`value` as the codec sends it: numpy's object arrays (pandas' read_parquet records:
    chats, list<string> columns) and tuples as lists, numpy scalars as Python's, all the
    way down through dicts and lists; anything else (a numeric array, a tensor: sent as
    they are, and far smaller than lists) as it is."""
    if type(value) in _SCALARS:  # (numpy's float64 is a float: tolist makes it Python's)
        return value
    if isinstance(value, dict):  # (scalars inline: a million records' build time doubled)
        return {k: v if type(v) in _SCALARS else plain(v) for k, v in value.items()}
    if type(value) is list and _SCALARS.issuperset(map(type, value)):
        return value  # the common case, token ids: no copy
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return plain(value.tolist()) if value.dtype.hasobject else value
    if isinstance(value, np.generic):
        return value.item()
    return value


def as_token_ids(value: Any) -> list[int] | None:
    """A list of token ids as plain ints: ints, or numpy or torch integer scalars (records
    a user built from arrays), not bools; None when `value` is something else."""
    if not isinstance(value, list):
        return None
    out = []
    for t in value:
        if getattr(t, "ndim", None) == 0 and hasattr(t, "item"):
            t = t.item()  # a numpy or torch scalar: a bool, an int or a float
        if not isinstance(t, int) or isinstance(t, bool):
            return None
        out.append(t)
    return out


def no_negative_ids(ids: list[int], where: str) -> list[int]:
    """`ids`, or an error naming `where` and the first negative id (the embedding would
    fail on it at the first forward pass, far from the record)."""
    for i, t in enumerate(ids):
        if t < 0:
            raise ValueError(f"{where}: the prompt's token id {t} (position {i}) is negative; "
                             f"token ids are >= 0, as a tokenizer gives them: fix the record")
    return ids


def in_vocabulary(ids: list[int], tok: Any, where: str) -> list[int]:
    """`ids`, or an error naming `where` and the first id the tokenizer has no token for
    (generation failed on it, naming no record)."""
    size = len(tok) if hasattr(tok, "__len__") else None
    for i, t in enumerate(ids):
        if size is not None and t >= size:
            raise ValueError(f"{where}: the prompt's token id {t} (position {i}) is past the "
                             f"tokenizer's vocabulary of {size} tokens; give ids this "
                             f"tokenizer made (another model's tokenizer?), or text")
    return ids


def _ids(tok: Any, value: Any, where: str) -> list[int]:
    # blank text: a BOS-adding tokenizer made it [BOS], a prompt of nothing trained on
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{where}: the prompt {value!r} is blank (empty or only "
                         f"whitespace); give it text, or leave the record out")
    if isinstance(value, str):  # (text the chat template made already starts with its BOS:
        bos = getattr(tok, "bos_token", None)  # not a second one)
        again = not (isinstance(bos, str) and bos and value.startswith(bos))
        return list(tok(value, add_special_tokens=again)["input_ids"])
    value = as_list(value)
    if is_chat(value):
        for m in value:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: chat message {m!r} needs a 'role' and a 'content' "
                                 f"string, as {{'role': 'user', 'content': '...'}}")
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"{where} is a chat (a list of messages), but the tokenizer has "
                             f"no chat template; give the prompt as text, or a tokenizer "
                             f"with a chat template (an instruct model's)")
        try:
            ids = tok.apply_chat_template(value, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # jinja's TemplateError: "roles must alternate", say
            raise ValueError(f"{where}: the tokenizer's chat template refused this chat: "
                             f"{e}") from None
        if not isinstance(ids, list):  # a BatchEncoding in transformers >= 5
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    ids = as_token_ids(value)
    if ids is not None:
        return in_vocabulary(no_negative_ids(ids, where), tok, where)
    raise ValueError(f"{where}: the prompt is {str(value)[:60]!r} ({type(value).__name__}); "
                     f"give text, chat messages [{{'role': 'user', 'content': '...'}}] or a "
                     f"list of token ids")
