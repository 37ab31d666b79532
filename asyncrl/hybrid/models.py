"""Causal language models: Hugging Face `transformers`, from a local directory, a Hub model in
the local cache (`model_folder`) or a preset config with random weights (tiny ones for CPU
runs and tests). Nothing is downloaded.

Token log-probs are computed one way for training and for checking generation:
`sequence_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask)`. Critics and
reward models are the same backbone with a scalar head (`ValueModel`): `sequence_values`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.hybrid.lora import LoraConfig, apply_lora, lora_config
from asyncrl.hybrid.settings import check_kinds


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
DEFAULT_PRESET = "tiny-llama"


@dataclass(kw_only=True)
class ModelConfig:
    """A preset name (random weights from `seed`) or a checkpoint: a local directory or the
    id of a Hub model in the local cache; neither given: the tiny-llama preset."""

    preset: str | None = None
    path: str | None = None
    dtype: str = "float32"
    seed: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)  # config fields, e.g. vocab_size
    # LoRA adapters, the model frozen: {"rank", "alpha", "target_modules", "modules_to_save"}
    # given as a dict or a LoraConfig (asyncrl.hybrid.lora), held as a LoraConfig
    lora: LoraConfig | None = None
    # a checkpoint whose config.json maps to its own code (auto_map): run that code. Off,
    # such a checkpoint fails at once, naming this (transformers would ask on the terminal)
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.trust_remote_code, bool):
            raise TypeError(f"ModelConfig.trust_remote_code is True or False, got "
                            f"{self.trust_remote_code!r}")
        if self.preset is not None and self.path is not None:
            raise ValueError(f"ModelConfig: give preset= (a name from {sorted(PRESETS)}) or "
                             f"path= (a checkpoint directory or cached Hub id), not both: got "
                             f"preset={self.preset!r} and path={self.path!r}")
        if self.preset is None and self.path is None:
            self.preset = DEFAULT_PRESET
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"ModelConfig.preset: unknown preset {self.preset!r}; known: "
                             f"{sorted(PRESETS)}")
        dtype = getattr(torch, self.dtype, None) if isinstance(self.dtype, str) else None
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"ModelConfig.dtype: {self.dtype!r} is not a torch floating "
                             f"point dtype (float32, bfloat16, float16)")
        self.lora = lora_config(self.lora)  # a bad entry fails before any group starts
        # (else seed="3" or overrides=[...] failed every rank's build, after groups started)
        check_kinds(self, "ModelConfig")
        self.seed = int(self.seed)  # (numpy's: model.json is written with json)
        if not isinstance(self.overrides, dict):
            raise TypeError(f"ModelConfig.overrides is a dict of config fields (e.g. "
                            f"{{'vocab_size': 256}}), got {self.overrides!r}")
        for key in ("dtype", "torch_dtype"):  # (set on the config, it changed nothing)
            if key in self.overrides:
                raise ValueError(f"ModelConfig.overrides: {key!r} does not set the weights' "
                                 f"dtype; give model={{..., 'dtype': "
                                 f"{str(self.overrides[key]).removeprefix('torch.')!r}}} "
                                 f"(ModelConfig.dtype=) instead")

    def frozen_model(self) -> dict[str, Any]:
        """What fixes a LoRA model's frozen weights (a preset's seed; a checkpoint's path, as
        given: hosts may mount it in different places), and its adapters' shapes: a trainer
        and a rollout exchanging adapters agree on it."""
        return {"preset": self.preset, "seed": self.seed if self.path is None else None,
                "path": self.path, "overrides": self.overrides,
                "lora": self.lora.described() if self.lora else None}


# RL compares the log-probs of one sequence under the engine, the trainer and the reference:
# dropout in the trainer's forward passes would make them differ (verl turns it off too).
# Config fields name their rates many ways (StarCoder2's residual_dropout, MPT's emb_pdrop,
# OPT's layerdrop, some in a sub-config: DBRX's attn_config.attn_pdrop): matched by name
DROPOUT = re.compile("dropout|pdrop|layerdrop", re.IGNORECASE)


def zero_dropout(node: Any, seen: set[int] | None = None) -> None:
    """Every non-zero float field of `node` (a transformers config or a dict) named like a
    dropout rate set to 0, in the sub-configs and dicts it holds too."""
    from transformers import PretrainedConfig

    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    items = node if isinstance(node, dict) else vars(node)
    for key, value in list(items.items()):
        if isinstance(value, float) and value and isinstance(key, str) and DROPOUT.search(key):
            if isinstance(node, dict):
                node[key] = 0.0
            else:
                setattr(node, key, 0.0)
        elif isinstance(value, dict | PretrainedConfig):
            zero_dropout(value, seen)


def model_folder(path: str) -> Path:
    """The folder of the model `path` names: `path` itself (a local directory), absolute,
    else the snapshot folder of the Hugging Face Hub model `path` in the local cache, as
    from_pretrained(local_files_only=True) loads it ("Qwen/Qwen2.5-0.5B"). Resolved where
    its files are read: hosts may hold it in different places."""
    if os.path.isdir(path):
        return Path(os.path.abspath(path))
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, local_files_only=True))
    except (ValueError, OSError) as e:
        # a partial download (files its cached listing names are missing): from_pretrained
        # found what it needs there all the same
        if snapshot := getattr(e, "snapshot_path", None):
            return Path(snapshot)
        raise ValueError(f"ModelConfig path={path!r} is neither a local directory nor a model "
                         f"in the local Hugging Face cache ({e}); give the directory of a "
                         f"model, or download it first (hf download {path})") from e


def model_file(path: str, name: str) -> Path | None:
    """The file `name` of the model `path` names (`model_folder`); None when it has none,
    or `path` names no model here (its loading says what is wrong)."""
    try:
        file = model_folder(path) / name
    except ValueError:
        return None
    return file if file.is_file() else None


def hf_config(cfg: ModelConfig, dropout_off: bool = True) -> Any:
    """The transformers config of the model `cfg` describes, dropout off (unless not
    `dropout_off`: as given, for an export), with its overrides applied (an override may
    turn dropout back on)."""
    if cfg.path is not None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model_folder(cfg.path), local_files_only=True,
                                                trust_remote_code=cfg.trust_remote_code)
        except ValueError as e:
            if cfg.trust_remote_code or "trust_remote_code" not in str(e):
                raise
            raise ValueError(f"{cfg.path} holds a model with code of its own (its "
                             f"config.json's auto_map): give model={{..., "
                             f"'trust_remote_code': True}} to run that code (as verl's "
                             f"trust_remote_code)") from None
    else:
        assert cfg.preset is not None
        config = PRESETS[cfg.preset]()
    if dropout_off:
        zero_dropout(config)
    for key, value in cfg.overrides.items():
        if key == "attn_implementation":  # transformers' keyword; its config's field is
            key = "_attn_implementation"  # private (set there, the model is built with it)
        if not hasattr(config, key):
            raise ValueError(f"ModelConfig.overrides: {type(config).__name__} has no field "
                             f"{key!r}")
        setattr(config, key, value)
    return config


def _build(cfg: ModelConfig, auto: Any) -> torch.nn.Module:
    """The model (random weights from `cfg.seed`, or the checkpoint's) with its LoRA adapters
    (drawn from `cfg.seed`): the same on every rank."""
    dtype = getattr(torch, cfg.dtype)
    config = hf_config(cfg)
    # drawn on the CPU; started CUDA generators are seeded too, and restored (each rank's
    # went on from cfg.seed after a build); unstarted ones are left alone (torch.manual_seed
    # would queue cfg.seed for their start)
    cuda = torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if cuda else []):
        if cuda:
            torch.manual_seed(cfg.seed)
        else:
            torch.random.default_generator.manual_seed(cfg.seed)
        if cfg.path is not None:
            model = _pretrained(cfg, auto, config, dtype)
            if cfg.overrides.get("tie_word_embeddings") is False:
                _untied(model, cfg)
        else:  # its parameters cast, not its buffers (as from_pretrained): a bf16 engine's
            # RoPE frequencies rounded to bf16 placed tokens apart from its fp32 trainer's
            model = auto.from_config(config)
            for param in model.parameters():
                param.data = param.data.to(dtype)
        if cfg.lora is not None:
            apply_lora(model, cfg.lora)
        return model


def _pretrained(cfg: ModelConfig, auto: Any, config: Any, dtype: torch.dtype) -> Any:
    assert cfg.path is not None
    try:  # from the folder: given a Hub id, transformers 5 looks for a peft adapter online
        # (local_files_only not passed on), retrying ~23 s where there is no network
        return auto.from_pretrained(model_folder(cfg.path), config=config,
                                    local_files_only=True, dtype=dtype,
                                    trust_remote_code=cfg.trust_remote_code)
    except RuntimeError as e:
        if not cfg.overrides or "ignore_mismatched_sizes" not in str(e):  # (its advice
            raise  # names no asyncrl option)
        raise ValueError(f"ModelConfig.overrides {cfg.overrides}: the weights of checkpoint "
                         f"{cfg.path} do not fit the shapes these give the model (transformers' "
                         f"load report above lists them). To change the vocabulary, resize "
                         f"the checkpoint once: load it with transformers, call "
                         f"model.resize_token_embeddings(n), save_pretrained it, and give "
                         f"that folder as path= without the override") from None


def _untied(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """A tied checkpoint untied by an override (to train its head apart: LoRA's
    modules_to_save): its files hold no head, the embeddings being it, and from_pretrained
    left the head random. It starts as a copy of the embeddings."""
    from transformers import AutoConfig

    assert cfg.path is not None
    if getattr(AutoConfig.from_pretrained(model_folder(cfg.path), local_files_only=True,
                                          trust_remote_code=cfg.trust_remote_code),
                "tie_word_embeddings", False):
        lm: Any = model
        head, embeddings = lm.get_output_embeddings(), lm.get_input_embeddings()
        if head is None:  # a bare backbone (a critic's): no head to untie
            return
        head.weight = torch.nn.Parameter(embeddings.weight.detach().clone())


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    """The causal LM, in eval mode; the same weights on every rank for the same config."""
    from transformers import AutoModelForCausalLM

    return _build(cfg, AutoModelForCausalLM).eval()


class ValueModel(torch.nn.Module):
    """A causal LM's backbone with a scalar head: one value per position (critics, reward
    models). The backbone is `self.model`, so sharding finds its layers as in the LM."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.model = backbone
        self.config = backbone.config
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)  # values start at 0, not at noise
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=False).last_hidden_state
        values = self.value_head(hidden.to(self.value_head.weight.dtype))
        # a fresh [B, T] tensor, not a view: FSDP hooks the module's output for backward
        return values.squeeze(-1).clone()


# a scalar head as checkpoints name it: ours and OpenRLHF's, transformers'
# *ForSequenceClassification with num_labels=1, TRL's AutoModelForCausalLMWithValueHead
HEAD_NAMES = ("value_head", "score", "v_head.summary", "v_head")
LM_HEADS = ("lm_head", "embed_out")  # output heads of HF causal LMs (GPT-NeoX: embed_out)


def checkpoint_head(path: str) -> dict[str, torch.Tensor] | None:
    """The scalar head saved in the checkpoint `path` names (a directory or a cached Hub
    id: `model_folder`) ({"weight": [1, H], maybe "bias"}), or None when it holds none (a
    causal LM's checkpoint)."""
    import json

    folder = model_folder(path)
    files: list[Path] = []
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).exists():
            weight_map = json.loads((folder / index).read_text())["weight_map"]
            files = [folder / f for f in dict.fromkeys(weight_map.values())]
            break
    else:
        files = [f for f in (folder / "model.safetensors", folder / "pytorch_model.bin")
                 if f.exists()]
    wanted = {f"{name}.{part}" for name in HEAD_NAMES for part in ("weight", "bias")}
    found: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as st:
                found.update({k: st.get_tensor(k) for k in st.keys() if k in wanted})
        else:
            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            found.update({k: v for k, v in state.items() if k in wanted})
    for name in HEAD_NAMES:
        if f"{name}.weight" in found:
            weight = found[f"{name}.weight"]
            if weight.dim() != 2 or weight.shape[0] != 1:
                raise ValueError(f"checkpoint {path}: head {name!r} has shape "
                                 f"{tuple(weight.shape)}; a value or reward head gives one "
                                 f"number per token ([1, hidden], num_labels=1)")
            head = {"weight": weight}
            if f"{name}.bias" in found:
                head["bias"] = found[f"{name}.bias"]
            return head
    return None


def build_value_model(cfg: ModelConfig, require_head: bool = False) -> ValueModel:
    """The backbone of `cfg`'s LM (a checkpoint's LM head is dropped) with a scalar head: the
    checkpoint's own when it has one (a reward model, a critic saved before), else zeros
    (a critic starting from the policy); `require_head`: a checkpoint without one is an error
    (a reward model whose head was dropped would score every sample 0)."""
    from transformers import AutoModel

    if cfg.lora is not None and cfg.lora.modules_to_save:
        # the backbone has no LM head (the value head, trained whole, takes its place): the
        # actor's model config, head in modules_to_save, serves the critic too
        kept = [n for n in cfg.lora.modules_to_save if n not in LM_HEADS] or None
        cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, modules_to_save=kept))
    backbone = _build(cfg, AutoModel)
    config: Any = backbone.config
    hidden = config.hidden_size if hasattr(config, "hidden_size") else config.n_embd
    model = ValueModel(backbone, hidden)
    head = checkpoint_head(cfg.path) if cfg.path is not None else None
    if head is not None:
        with torch.no_grad():
            model.value_head.weight.copy_(head["weight"])
            if "bias" in head:
                model.value_head.bias.copy_(head["bias"])
            if require_head and getattr(config, "normalize_reward", False):
                # OpenRLHF's --normalize_reward: its reward model returns (r - mean) / std,
                # the two kept in config.json; folded into the head (a reward on another
                # scale would shift its weight against the KL penalty and the clip)
                mean, std = float(config.mean), float(config.std)
                model.value_head.weight.div_(std)
                model.value_head.bias.sub_(mean).div_(std)
    elif require_head and cfg.path is not None:
        raise ValueError(f"checkpoint {cfg.path} has no scalar head (looked for "
                         f"{[n + '.weight' for n in HEAD_NAMES]}): a reward model needs one; "
                         f"save it with AutoModelForSequenceClassification(num_labels=1)")
    model.value_head.to(getattr(torch, cfg.dtype))  # (the backbone's is; LoRA's fp32 stay)
    return model.eval()


def default_device() -> torch.device:
    """This rank's GPU when there is one (ranks bind their threads to it), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: 0 at each row's first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def used_columns(prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[int, int]:
    """(first prompt column, end of the response columns) that some row uses: the columns
    outside are padding in every row (left of the prompts, right of the responses), and a
    forward pass without them gives the same values for a fraction of the cost. At least
    one prompt column stays (the logits before the first response token come from it)."""
    used_p = prompt_mask.any(0)
    first = min(int(used_p.int().argmax()) if bool(used_p.any()) else 0, prompt_mask.shape[1] - 1)
    used_r = response_mask.any(0).nonzero()
    return first, int(used_r.max()) + 1 if used_r.numel() else 0


def joined(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
            response_ids: torch.Tensor, response_mask: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """prompt + response ids and mask on the model's device, and the response mask there,
    without the columns no row uses (the callers pad their [B, N] results back)."""
    device = next(model.parameters()).device
    first, end = used_columns(prompt_mask, response_mask)
    prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]
    response_ids, response_mask = response_ids[:, :end], response_mask[:, :end]
    ids = torch.cat([prompt_ids.to(device), response_ids.to(device)], dim=1)
    mask = torch.cat([prompt_mask.to(device), response_mask.to(device)], dim=1)
    return ids, mask, response_mask.to(device)


def sampled_at(batch: Any) -> float:
    """The temperature a batch's responses were sampled at (its meta, set by the generation
    engines; 1.0 for sequences from elsewhere): log-probs and entropies are taken at it, so
    the trainer's ratio starts at 1 and the reference's KL compares like with like."""
    return float(batch.meta.get("temperature", 1.0))


def sequence_logprobs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      response_ids: torch.Tensor, response_mask: torch.Tensor,
                      temperature: float = 1.0, entropy: bool | str = False
                      ) -> Any:
    """log p(response token | everything before it), [B, N]; 0 where response_mask is 0.
    With `entropy=True`, also the entropy of each of those next-token distributions; with
    `entropy="no_grad"`, the entropy as a metric only, outside autograd (a loss without an
    entropy term keeps no [B, N, vocab] tensors of it for the backward).

    Prompts are left-padded, responses right-padded (their mask is a prefix of each row)."""
    if entropy not in (False, True, "no_grad"):
        raise ValueError(f"sequence_logprobs: entropy is False, True or 'no_grad', got "
                         f"{entropy!r}")
    ids, mask, rmask = joined(model, prompt_ids, prompt_mask, response_ids, response_mask)
    # no KV cache: one pass over whole sequences needs none (it would only take memory)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                   use_cache=False).logits
    p, width = ids.shape[1] - rmask.shape[1], response_ids.shape[1]
    logits = logits[:, p - 1:-1].float() / temperature  # the logits that predict responses
    logp_all = F.log_softmax(logits, -1)
    logp = torch.gather(logp_all, 2, ids[:, p:].unsqueeze(-1)).squeeze(-1) * rmask
    if not entropy:
        return _widened(logp, width)
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy != "no_grad"):
        ent = -(logp_all.exp() * logp_all).sum(-1) * rmask
    return _widened(logp, width), _widened(ent, width)


def _widened(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, n] -> [B, width]: zeros for the trimmed response columns."""
    return F.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x


def sequence_values(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    response_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A ValueModel's value of the state before each response token, [B, N]; 0 where
    response_mask is 0 (the positions whose logits `sequence_logprobs` reads)."""
    ids, mask, rmask = joined(model, prompt_ids, prompt_mask, response_ids, response_mask)
    values = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask))
    p = ids.shape[1] - rmask.shape[1]
    return _widened(values[:, p - 1:-1].float() * rmask, response_ids.shape[1])
