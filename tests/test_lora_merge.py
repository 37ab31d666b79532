"""LoRA's merge W + (alpha / rank) B A: computed in fp32 at least, in fp64 for an fp64 model,
and rounded once into the dtype asked for."""

from __future__ import annotations

import torch

from asyncrl.hybrid.lora import LoraConfig, delta, merged


def test_an_fp64_layers_merge_is_fp64_accurate():
    """An fp64 model (ModelConfig dtype="float64", fp64 adapters, an fp64 export) was merged
    through fp32: W rounded to fp32 first, an error of ~1e-7 where fp64 holds ~1e-16."""
    torch.manual_seed(0)
    w, a, b = (torch.randn(shape, dtype=torch.float64) for shape in ((8, 8), (2, 8), (8, 2)))
    weights = {"q.weight": w, "q.lora_A.weight": a, "q.lora_B.weight": b}
    cfg = LoraConfig(rank=2, alpha=4)
    exact = w + cfg.scaling * b @ a
    for dtype in (torch.float64, None):  # asked for, and W's by default
        out = dict(merged(weights, cfg, dtype))["q.weight"]
        assert out.dtype == torch.float64 and (out - exact).abs().max().item() < 1e-12
    assert delta(a, b, cfg.scaling).dtype == torch.float64
    # fp32 weights merged for an fp64 export: computed in fp64, from their fp32 values
    narrow = {k: v.float() for k, v in weights.items()}
    wide = dict(merged(narrow, cfg, torch.float64))["q.weight"]
    w, a, b = (narrow[k].double() for k in ("q.weight", "q.lora_A.weight", "q.lora_B.weight"))
    assert wide.dtype == torch.float64
    assert (wide - (w + cfg.scaling * b @ a)).abs().max().item() < 1e-12
