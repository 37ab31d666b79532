"""The examples' task: answer the digit that follows the one in the prompt ("7>" -> "8",
"9>" -> "0"). Its reward is verifiable and depends on the prompt: a policy that ignores the
prompt answers one prompt in ten (0.1), whatever it does.

The CPU examples use their own vocabulary, built here; with `model_path=DIR` they use that
checkpoint's tokenizer (local files only).
"""

from __future__ import annotations

from typing import Any

DIGITS = "0123456789"


class Vocab:
    """A character vocabulary: pad 0, bos 1, eos 2, then digits and ">"."""

    pad, bos, eos = 0, 1, 2
    chars = DIGITS + ">"

    def __len__(self) -> int:
        return 3 + len(self.chars)

    def encode(self, text: str) -> list[int]:
        return [self.bos] + [3 + self.chars.index(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        out = []
        for i in ids:
            if i == self.eos:
                break
            if i >= 3:
                out.append(self.chars[i - 3])
        return "".join(out)


class HFTokenizer:
    """A local Hugging Face tokenizer behind the same encode/decode/pad/eos."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.eos = self.tok.eos_token_id
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos

    def __len__(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok(f"What digit comes after {text[0]}? Answer: ")["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True).strip()


def tokenizer(model_path: str | None) -> Any:
    return HFTokenizer(model_path) if model_path else Vocab()


def records(tok: Any, copies: int) -> list[dict[str, Any]]:
    """Every digit `copies` times: the prompt's token ids and the expected answer."""
    return [{"prompt": tok.encode(f"{d}>"), "answer": DIGITS[(int(d) + 1) % 10]}
            for d in DIGITS for _ in range(copies)]


def score(text: str, answer: str) -> float:
    """1 when the response starts with the right digit, else 0."""
    return 1.0 if text[:1] == answer else 0.0


def model(tok: Any, model_path: str | None, seed: int) -> dict[str, Any]:
    """A tiny Llama sized to the vocabulary (random weights from `seed`), or the checkpoint."""
    if model_path:
        return {"path": model_path}
    return {"preset": "tiny-llama", "seed": seed,
            "overrides": {"vocab_size": len(tok), "max_position_embeddings": 32}}
