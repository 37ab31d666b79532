"""The hybrid engine: the same ranks train (FSDP2) and generate (the built-in engine).

    train mode ──to_generate()──▶ every sharded parameter is all-gathered *one at a time*
                                  straight into the engine's own weights (copy_, no new
                                  tensor kept): never a second full copy of the model;
                                  optimizer state leaves the GPU; the engine wakes
    generate   ──to_train()────▶ the engine sleeps (no KV cache is kept between calls);
                                  optimizer state comes back

Nothing is reloaded from disk. On a CPU-only host there is no device memory to free: the
optimizer state stays where it is.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.hybrid.fsdp import FSDPBackend
from asyncrl.hybrid.models import ModelConfig, build_model
from asyncrl.hybrid.sampler import Sampler, SamplingConfig


def _full(param: Any) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param


class HybridEngine:
    def __init__(self, backend: FSDPBackend, model_cfg: ModelConfig,
                 sampling: SamplingConfig | None = None):
        self.backend = backend
        self.engine = Sampler(build_model(model_cfg), sampling)
        self.engine.sleep()
        self.mode = "train"
        self.peak_gather_bytes = 0  # the largest gathered tensor alive at once, last switch

    @torch.no_grad()
    def to_generate(self) -> None:
        if self.mode == "generate":
            return
        targets = dict(self.engine.model.named_parameters())
        self.peak_gather_bytes = 0
        for name, param in self.backend.model.named_parameters():
            full = _full(param.detach())  # a collective on every rank, in the same order
            self.peak_gather_bytes = max(self.peak_gather_bytes,
                                         full.numel() * full.element_size())
            targets[name].copy_(full)
            del full
        self._move_optimizer("cpu")
        self.engine.wake()
        self.mode = "generate"

    def to_train(self) -> None:
        if self.mode == "train":
            return
        self.engine.sleep()
        device = next(self.backend.model.parameters()).device
        self._move_optimizer(device)
        self.mode = "train"

    def _move_optimizer(self, device: Any) -> None:
        """Optimizer state to `device` (off the GPU while generating; a no-op on CPU)."""
        for state in self.backend.opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != torch.device(device):
                    state[key] = value.to(device, non_blocking=True)

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> Any:
        if self.mode != "generate":
            raise RuntimeError("the hybrid engine is in train mode: call to_generate() first")
        return self.engine.generate(prompts, seeds)
