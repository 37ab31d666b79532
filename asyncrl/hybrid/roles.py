"""Model roles as workers, for DataFlows and drivers.

    Policy     train (FSDP2, optional TP) + generate (hybrid: the same ranks) + log-probs
    Rollout    generate only; receives weights (load_weights)
    Reference  frozen: log-probs of given sequences

Batches are TensorBatches with prompt_ids/prompt_mask (left-padded) and response_ids/
response_mask (prefix masks), as `generate` returns them; prompts come as a TensorBatch with
a list column "prompt" (token ids) and a column "seed". `generate` passes the prompt batch's
columns through (an "answer" the reward needs travels with its sample).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.actors.protocols import Dispatch
from asyncrl.actors.register import register
from asyncrl.actors.worker import Worker
from asyncrl.comm.batch import TensorBatch
from asyncrl.hybrid.engine import BUCKET_BYTES, HybridEngine
from asyncrl.hybrid.fsdp import FSDPBackend, TrainConfig
from asyncrl.hybrid.models import ModelConfig, build_model, default_device, sequence_logprobs
from asyncrl.hybrid.sampler import Sampler, SamplingConfig


def _prompts(batch: TensorBatch) -> tuple[list[list[int]], list[int]]:
    for key in ("prompt", "seed"):
        if key not in batch:
            raise KeyError(f"generate needs a prompt batch with columns 'prompt' (token ids) "
                           f"and 'seed' (one per sample); it has {batch.keys()}")
    prompts = [list(p) for p in batch["prompt"]]
    seeds = [int(s) for s in batch["seed"]]
    return prompts, seeds


def with_prompts(out: TensorBatch, prompts: TensorBatch) -> TensorBatch:
    """Generation's columns beside the prompt batch's (its meta, padding marks included)."""
    extra = [k for k in prompts.keys() if k not in out]
    return out.union(prompts.select(extra)) if extra else out


def make_backend(worker: Worker, backend: str, model_cfg: ModelConfig, train_cfg: TrainConfig,
                 head: str = "lm") -> Any:
    """The training backend named in a role's config: "fsdp2", "zero2" or "zero3"."""
    if backend == "fsdp2":
        return FSDPBackend(model_cfg, train_cfg, worker.device_mesh, head)
    if backend in ("zero2", "zero3"):
        from asyncrl.hybrid.zero import ZeroBackend

        return ZeroBackend(model_cfg, train_cfg, stage=int(backend[-1]), head=head)
    raise ValueError(f"backend is 'fsdp2', 'zero2' or 'zero3', got {backend!r}")


class Policy(Worker):
    def __init__(self, model: dict[str, Any], train: dict[str, Any] | None = None,
                 sampling: dict[str, Any] | None = None, bucket_bytes: int = BUCKET_BYTES,
                 backend: str = "fsdp2"):
        model_cfg = ModelConfig(**model)
        train_cfg = TrainConfig(**(train or {}))
        self.backend = make_backend(self, backend, model_cfg, train_cfg)
        self.hybrid = HybridEngine(self.backend, model_cfg, SamplingConfig(**(sampling or {})),
                                   bucket_bytes)

    @register(dispatch=Dispatch.DP)
    def generate(self, prompts: TensorBatch) -> TensorBatch:
        self.hybrid.to_generate()
        return with_prompts(self.hybrid.generate(*_prompts(prompts)), prompts)

    @register(dispatch=Dispatch.DP)
    def logprobs(self, batch: TensorBatch) -> TensorBatch:
        self.hybrid.to_train()
        return TensorBatch({"logprobs": self.backend.logprobs(batch).cpu()})

    @register(dispatch=Dispatch.DP)
    def train_step(self, batch: TensorBatch) -> dict:
        self.hybrid.to_train()
        return self.backend.train_step(batch)

    @register
    def weights(self, layout: str = "train") -> dict[str, torch.Tensor]:
        """Full weights as training holds them, or as the generation engine holds them."""
        if layout == "engine":
            return {k: v.detach().clone() for k, v in self.hybrid.engine.model.state_dict().items()}
        if layout != "train":
            raise ValueError(f"layout is 'train' or 'engine', got {layout!r}")
        return self.backend.state_dict()

    @register
    def switch_report(self) -> dict:
        """Where the last switch stood: its mode and the largest tensor it gathered."""
        return {"mode": self.hybrid.mode, "peak_gather_bytes": self.hybrid.peak_gather_bytes}


class Rollout(Worker):
    def __init__(self, model: dict[str, Any], sampling: dict[str, Any] | None = None):
        self.engine = Sampler(build_model(ModelConfig(**model)).to(default_device()),
                              SamplingConfig(**(sampling or {})))

    @register(dispatch=Dispatch.DP)
    def generate(self, prompts: TensorBatch) -> TensorBatch:
        return with_prompts(self.engine.generate(*_prompts(prompts)), prompts)

    @register(concurrent=True)
    def load_weights(self, weights: dict[str, torch.Tensor]) -> int:
        return self.engine.load_weights(weights.items())


class Reference(Worker):
    def __init__(self, model: dict[str, Any]):
        self.model = build_model(ModelConfig(**model)).to(default_device())

    @register(dispatch=Dispatch.DP)
    @torch.no_grad()
    def logprobs(self, batch: TensorBatch) -> TensorBatch:
        return TensorBatch({"logprobs": sequence_logprobs(
            self.model, batch.tensor("prompt_ids"), batch.tensor("prompt_mask"),
            batch.tensor("response_ids"), batch.tensor("response_mask")).cpu()})
