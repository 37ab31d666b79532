"""Causal language models: Hugging Face `transformers`, from a local directory or a preset
config with random weights (tiny ones for CPU runs and tests). Nothing is downloaded.

Token log-probs are computed one way for training and for checking generation:
`sequence_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def tiny_llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, tie_word_embeddings=False)


def tiny_gpt2() -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)


def llama_100m() -> Any:
    """~100M parameters: for benchmarks, not tests."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                       num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                       max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)


PRESETS: dict[str, Callable[[], Any]] = {
    "tiny-llama": tiny_llama, "tiny-gpt2": tiny_gpt2, "llama-100m": llama_100m}


@dataclass(kw_only=True)
class ModelConfig:
    """A preset name (random weights from `seed`) or a local checkpoint directory."""

    preset: str | None = "tiny-llama"
    path: str | None = None
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.path is None):
            raise ValueError("ModelConfig: give exactly one of preset= (a name from "
                             f"{sorted(PRESETS)}) and path= (a local checkpoint directory)")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"ModelConfig.preset: unknown preset {self.preset!r}; known: "
                             f"{sorted(PRESETS)}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"ModelConfig.dtype: {self.dtype!r} is not a torch dtype")


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    """The model, in eval mode; the same weights on every rank for the same config."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, cfg.dtype)
    if cfg.path is not None:
        model = AutoModelForCausalLM.from_pretrained(cfg.path, local_files_only=True,
                                                     dtype=dtype)
    else:
        assert cfg.preset is not None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(PRESETS[cfg.preset]()).to(dtype)
    return model.eval()


def default_device() -> torch.device:
    """This rank's GPU when there is one (ranks bind their threads to it), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: 0 at each row's first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_logprobs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      response_ids: torch.Tensor, response_mask: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """log p(response token | everything before it), [B, N]; 0 where response_mask is 0.

    Prompts are left-padded, responses right-padded (their mask is a prefix of each row)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    response_ids, response_mask = response_ids.to(device), response_mask.to(device)
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    p = prompt_ids.shape[1]
    logits = logits[:, p - 1:-1].float() / temperature  # the logits that predict responses
    logp = torch.gather(F.log_softmax(logits, -1), 2, response_ids.unsqueeze(-1)).squeeze(-1)
    return logp * response_mask
