"""LoRA: low-rank adapters on a frozen model (Hu et al. 2021; verl's lora_rank, peft's
LoraConfig). Only the adapters train, so gradients and optimizer state are theirs alone, and a
weight sync or a hybrid switch moves them and not the model.

    model={"preset": ..., "lora": {"rank": 16, "alpha": 32, "target_modules": "all-linear"}}

Each targeted nn.Linear becomes a `LoraLinear` in place: the same `weight` and `bias` under the
same names (frozen), plus `lora_A.weight` [rank, in] (random, seeded) and `lora_B.weight`
[out, rank] (zeros: the model starts as it was), named as peft names them, and

    y = x W^T + b + (alpha / rank) * (x A^T) B^T

kept unmerged everywhere the built-in code runs (trainer, built-in engine, rollouts), so the
engine's log-probs are the trainer's. An engine that takes whole weights by name (vLLM) and
`asyncrl export` get the merged W + (alpha / rank) B A.

The adapters are fp32 on a bf16 (or fp16) model, as peft makes them: an update of the size
AdamW makes at a LoRA learning rate (1e-5 of a weight ~0.03) is below a bf16 weight's
resolution and would round away. Each factor is a module of its own, so FSDP2 can shard them
apart from the layer's bf16 weight (one dtype per FSDP unit). Under DeepSpeed ZeRO with bf16
they compute in bf16 (DeepSpeed casts every parameter; its fp32 master copies keep the
updates), and what it syncs or saves of them is bf16-rounded: a little log-prob noise.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.hybrid.settings import whole_number

ADAPTERS = ("lora_A", "lora_B")  # the factors LoRA adds to each targeted layer


@dataclass(kw_only=True)
class LoraConfig:
    rank: int
    alpha: float = 16.0  # the update is scaled by alpha / rank (verl's default; peft's is 8)
    # "all-linear": every nn.Linear but the output head; or the layers' own names, e.g.
    # ["q_proj", "v_proj"] (a name matches the last part of a module's path, as in peft)
    target_modules: str | list[str] = "all-linear"
    # modules trained whole beside the adapters (peft's modules_to_save), e.g. ["lm_head"]
    modules_to_save: list[str] | None = None

    def __post_init__(self) -> None:
        if not whole_number(self.rank) or self.rank < 1:
            raise ValueError(f"lora.rank must be an int >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, numbers.Real) or \
                not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"lora.alpha must be a number > 0, got {self.alpha!r}")
        # numpy's numbers (a sweep's np.arange) as Python's: compared and written as JSON
        self.rank, self.alpha = int(self.rank), float(self.alpha)
        if self.target_modules != "all-linear":
            self.target_modules = _names(self.target_modules, "target_modules",
                                         "'all-linear' or a list of layer names (e.g. "
                                         "['q_proj', 'v_proj'])")
        if isinstance(self.modules_to_save, list | tuple) and not self.modules_to_save:
            self.modules_to_save = None  # (a YAML `modules_to_save: []`): none, as peft reads it
        if self.modules_to_save is not None:
            self.modules_to_save = _names(self.modules_to_save, "modules_to_save",
                                          "a list of module names (e.g. ['lm_head'])")
            both = set(self.modules_to_save) & set(self.target_modules) \
                if self.target_modules != "all-linear" else set()
            if both:
                raise ValueError(f"lora: {sorted(both)} in both target_modules (adapted) and "
                                 f"modules_to_save (trained whole); name each in one")

    def described(self) -> dict[str, Any]:
        """As plain data (alpha a float), for a rollout to compare with its own."""
        return {"rank": self.rank, "alpha": float(self.alpha),
                "target_modules": self.target_modules, "modules_to_save": self.modules_to_save}

    def trains_whole(self, name: str) -> bool:
        """Whether parameter `name` belongs to a module of modules_to_save (at any depth)."""
        return bool(set(name.split(".")[:-1]) & set(self.modules_to_save or ()))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _names(given: Any, key: str, what: str) -> list[str]:
    """A list of names, sorted: the same config however given (a rollout compares it with
    its own)."""
    names = list(given) if isinstance(given, list | tuple | set) else None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"lora.{key} is {what}, got {given!r}")
    return sorted(names)


def lora_config(given: dict[str, Any] | LoraConfig | None) -> LoraConfig | None:
    """A model config's `lora` entry checked: None (no LoRA) or a LoraConfig."""
    if given is None or isinstance(given, LoraConfig):
        return given
    if not isinstance(given, dict):
        raise TypeError(f"model lora= is a dict such as {{'rank': 16, 'alpha': 32}}, got "
                        f"{type(given).__name__}")
    try:
        return LoraConfig(**given)
    except TypeError as e:
        raise ValueError(f"model lora=: {e}; its keys are rank, alpha, target_modules, "
                         f"modules_to_save") from e


class LoraFactor(torch.nn.Module):
    """One low-rank factor: a `weight` alone (peft's are bias-free nn.Linear layers; not one
    here, so that nothing looking for layers to adapt or shard takes it for one)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # called, not read: FSDP2 gathers it in its hook


class LoraLinear(torch.nn.Linear):
    """An nn.Linear with a low-rank update beside its frozen weight."""

    scaling: float
    adapters_on: bool  # off: the frozen model alone (a reference's log-probs)
    lora_A: LoraFactor
    lora_B: LoraFactor

    @classmethod
    def around(cls, linear: torch.nn.Linear, rank: int, scaling: float) -> LoraLinear:
        """The layer with adapters: `linear`'s own weight and bias (no copy), frozen."""
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        for p in (new.weight, new.bias):
            if p is not None:
                p.requires_grad_(False)
        w = linear.weight
        dtype = adapter_dtype(w.dtype)
        a = torch.empty(rank, linear.in_features, dtype=dtype, device=w.device)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as peft, nn.Linear
        new.lora_A = LoraFactor(a)
        new.lora_B = LoraFactor(torch.zeros(linear.out_features, rank, dtype=dtype,
                                            device=w.device))
        new.scaling, new.adapters_on = scaling, True
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapters_on:
            return out
        # in the adapters' dtype (fp32 beside a bf16 weight), scaled at rank width, where it
        # is cheapest
        low = self.lora_A(x.to(self.lora_A.weight.dtype)) * self.scaling
        return out + self.lora_B(low).to(out.dtype)


def adapter_dtype(weight: torch.dtype) -> torch.dtype:
    """fp32 for the adapters of a bf16 or fp16 layer (fp64 for an fp64 one)."""
    return torch.promote_types(weight, torch.float32)


def merge_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype a merge computes in: fp32 at least (bf16 would round the update away), fp64
    where any of `dtypes` is (an fp64 model's merge is fp64-accurate)."""
    wide = torch.float32
    for dtype in dtypes:
        wide = torch.promote_types(wide, dtype)
    return wide


def delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """What adapters A, B add to their layer's weight: scaling * B A (in merge_dtype)."""
    wide = merge_dtype(a.dtype, b.dtype)
    return (b.to(wide) @ a.to(wide)).mul_(scaling)


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """W + scaling * B A, computed in merge_dtype (of W, A, B and `dtype`), then rounded
    once into `dtype` (default: W's)."""
    dtype = dtype or weight.dtype
    wide = merge_dtype(weight.dtype, a.dtype, b.dtype, dtype)
    return (weight.to(wide) + delta(a.to(wide), b.to(wide), scaling)).to(dtype)


def _output_heads(model: torch.nn.Module) -> set[int]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {id(head)} if head is not None else set()


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """Adapters on `model`'s targeted layers, every other parameter frozen but those of
    `modules_to_save`; the layers' names. Draws A from torch's generator: seed it for the
    same adapters on every rank."""
    heads = _output_heads(model)
    wanted = None if cfg.target_modules == "all-linear" else set(cfg.target_modules)
    chosen = [(name, m) for name, m in model.named_modules()
              if type(m) is torch.nn.Linear and id(m) not in heads and
              (wanted is None or name.rsplit(".", 1)[-1] in wanted)]
    found = {name.rsplit(".", 1)[-1] for name, _ in chosen}
    head_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if id(m) in heads}
    if wanted is not None and wanted & head_names:
        raise ValueError(f"lora.target_modules: {sorted(wanted & head_names)} is the model's "
                         f"output head, which LoRA does not adapt here; train it whole "
                         f"instead: modules_to_save={sorted(wanted & head_names)}")
    if not chosen or (wanted is not None and wanted - found):
        layers = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if type(m) is torch.nn.Linear and id(m) not in heads})
        what = f"named {sorted(wanted - found)}" if wanted is not None else "to adapt"
        raise ValueError(f"lora.target_modules={cfg.target_modules!r}: "
                         f"{type(model).__name__} has no nn.Linear layer {what}; its "
                         f"nn.Linear layers: {layers or 'none'} "
                         f"(LoRA adapts nn.Linear layers: Llama, Qwen or Mistral-style models; "
                         f"GPT-2 uses Conv1D)")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, linear in chosen:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr,
                LoraLinear.around(linear, cfg.rank, cfg.scaling))
    _train_whole(model, cfg)
    return [name for name, _ in chosen]


def _train_whole(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """The parameters of modules_to_save's modules trainable (`cfg.trains_whole`), none of
    them an adapted layer's or tied to a parameter outside them (peft's adapter would not
    hold what trained)."""
    names = set(cfg.modules_to_save or ())
    if not names:
        return
    owners: dict[int, list[str]] = {}  # a parameter's names: a tied one has several
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    found = {part for paths in owners.values() for n in paths
             for part in n.split(".")[:-1]} & names
    if names - found:
        raise ValueError(f"lora.modules_to_save: {type(model).__name__} has no module with "
                         f"parameters named {sorted(names - found)}")
    for name, m in model.named_modules():
        if isinstance(m, LoraLinear) and set(name.split(".")) & names:
            raise ValueError(f"lora.modules_to_save: {name} is adapted by LoRA (all-linear "
                             f"or target_modules): leave it out of one of them")
    for p in model.parameters():
        paths = owners[id(p)]
        saved = [n for n in paths if cfg.trains_whole(n)]
        if saved:
            others = [n for n in paths if n not in saved]
            if others:
                raise ValueError(f"lora.modules_to_save: {saved[0]} is tied to {others} "
                                 f"(tie_word_embeddings?), which would train too; untie them "
                                 f"(model overrides {{'tie_word_embeddings': False}}) or "
                                 f"leave it out")
            p.requires_grad_(True)


def lora_layers(model: torch.nn.Module) -> dict[str, LoraLinear]:
    """The layers with adapters, by path (empty for a model without LoRA)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is a LoRA factor's (`<layer>.lora_A.weight`)."""
    parts = name.rsplit(".", 2)
    return len(parts) == 3 and parts[1] in ADAPTERS and parts[2] == "weight"


def legacy_adapter_names(names: Iterable[str]) -> list[str]:
    """Adapters as checkpoints before 2026-12-04 name them: `<layer>.lora_A`, no `.weight`."""
    return [n for n in names if n.rsplit(".", 1)[-1] in ADAPTERS]


def adapter_modules(module: torch.nn.Module) -> list[LoraFactor]:
    """The LoRA factors inside `module` (a decoder layer's: FSDP2 shards them as a unit)."""
    return [m for m in module.modules() if isinstance(m, LoraFactor)]


class adapters_off:
    """A context in which `model`'s LoRA layers run without their adapters: the frozen model
    (verl's reference without a reference model)."""

    def __init__(self, model: torch.nn.Module):
        self.layers = list(lora_layers(model).values())
        self.were: list[bool] = []

    def __enter__(self) -> None:
        self.were = [m.adapters_on for m in self.layers]
        for m in self.layers:
            m.adapters_on = False

    def __exit__(self, *exc: Any) -> None:
        for m, on in zip(self.layers, self.were, strict=True):
            m.adapters_on = on


def merged(weights: dict[str, torch.Tensor], cfg: LoraConfig,
           dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA model's full weights (by name) as the plain model's: W + scaling * B A under
    W's name, the adapters dropped. One layer's merge at a time (`merge`: in fp32, fp64 for
    fp64 weights or `dtype`), then in `dtype` (default: W's; an fp32 export of a bf16 model
    rounded the update through bf16 first)."""
    for name, value in weights.items():
        if is_adapter(name):
            continue
        prefix = name.removesuffix(".weight")
        a, b = weights.get(f"{prefix}.lora_A.weight"), weights.get(f"{prefix}.lora_B.weight")
        if name.endswith(".weight") and a is not None and b is not None:
            value = merge(value, a, b, cfg.scaling, dtype)
        yield name, value
