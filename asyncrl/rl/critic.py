"""The critic: a value model (the policy's backbone with a scalar head) trained with value
clipping, on its own group with its own layout.

    values(rollout)                                  -> {"values"} [B, T] (state before
                                                         each response token)
    update(rollout, scores, ref=None, values=...)    -> returns by GAE from the same
                                                         per-token rewards as the actor;
                                                         0.5 * max((V - R)^2,
                                                         (clip(V, V_old +- c) - R)^2)

Like the actor, it drops the samples more than `max_staleness` versions behind. The policy
version it measures them against is its own count of updates (kept in checkpoints): the
actor's when each updates once a step from the start, as in examples/ppo_tiny.py (both
have the same max_staleness, the actor refuses values of a critic with another: an update
whose every row is dropped takes no step and leaves the version, so with other bounds one
may skip where the other does not). A flow that updates them otherwise (a critic warm-up,
a Policy.train_step of the actor) passes the actor's version: `update(..., version=N)`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from asyncrl.actors.protocols import Dispatch
from asyncrl.actors.register import register
from asyncrl.actors.worker import Worker
from asyncrl.comm.batch import TensorBatch
from asyncrl.hybrid.fsdp import TrainConfig
from asyncrl.hybrid.models import ModelConfig
from asyncrl.hybrid.roles import check_backend, make_backend, schedule_moved
from asyncrl.hybrid.settings import from_dict, own_arguments
from asyncrl.rl.actor import mean_stats
from asyncrl.rl.algorithms import masked_mean
from asyncrl.rl.batch import (
    CRITIC_RL,
    STATS,
    advantages,
    assemble,
    count_globally,
    drop_stale,
    global_sums,
    mini_batches,
    share,
    trained_steps,
)
from asyncrl.rl.config import RLConfig

log = logging.getLogger("asyncrl")


def value_loss(cfg: RLConfig) -> Any:
    """The clipped value loss, 0.5 * max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2),
    averaged over the mini-batch's masked tokens (every rank's): always the token mean,
    whatever `cfg.agg` says (the actor's policy, KL and entropy terms follow `agg`; a
    seq-mean mode weights the critic's tokens no differently)."""

    def loss_fn(out: dict[str, torch.Tensor], micro: TensorBatch
                ) -> tuple[torch.Tensor, dict[str, float]]:
        v, mask = out["values"], micro.tensor("loss_mask")
        old, ret = micro.tensor("values"), micro.tensor("returns")
        clipped = old + (v - old).clamp(-cfg.value_clip, cfg.value_clip)
        unclipped_err, clipped_err = (v - ret).pow(2), (clipped - ret).pow(2)
        part = share(micro, "tokens")  # local means -> parts of the global means
        loss = 0.5 * masked_mean(torch.maximum(unclipped_err, clipped_err), mask) * part
        clipfrac = masked_mean((clipped_err > unclipped_err).float(), mask) * part
        return loss, {"vf_loss": loss.detach().item(), "vf_clipfrac": clipfrac.item(),
                      "values_mean": masked_mean(v.detach(), mask).item() * part}

    return loss_fn


def _settings(model: dict[str, Any], rl: dict[str, Any] | None,
              train: dict[str, Any] | None) -> tuple[RLConfig, ModelConfig, TrainConfig]:
    cfg = from_dict(RLConfig, {"algo": "ppo", **(rl or {})}, "Critic rl=")
    if cfg.algo != "ppo":
        raise ValueError(f"a Critic learns PPO's returns: its rl= takes algo 'ppo' (the "
                         f"default), got {cfg.algo!r}; GRPO needs no critic")
    return (cfg, from_dict(ModelConfig, model, "Critic model="),
            from_dict(TrainConfig, train, "Critic train="))


class Critic(Worker):
    def __init__(self, model: dict[str, Any], rl: dict[str, Any] | None = None,
                 train: dict[str, Any] | None = None, backend: str = "fsdp2"):
        self.rl, model_cfg, train_cfg = _settings(model, rl, train)
        self.backend = make_backend(self, backend, model_cfg, train_cfg, head="value")
        self.version = 0  # updates applied: the actor's policy version at the same step

    @classmethod
    def check_settings(cls, *args: Any, **kwargs: Any) -> None:
        """Its settings, where the group is declared (as Policy.check_settings)."""
        given = own_arguments(cls, Critic.__init__, args, kwargs)
        if given is not None:
            _settings(given["model"], given["rl"], given["train"])
            check_backend(given["backend"])

    @register(dispatch=Dispatch.DP)
    def values(self, rollout: TensorBatch) -> TensorBatch:
        return TensorBatch({"values": self.backend.values(rollout).cpu()},
                           {CRITIC_RL: self.rl.returns_fields()})

    @register(dispatch=STATS)
    def update(self, rollout: TensorBatch, scores: TensorBatch, ref: TensorBatch | None = None,
               values: TensorBatch | None = None, version: int | None = None
               ) -> dict[str, float]:
        if version is not None:
            self.version = version
        if values is None:
            raise ValueError("Critic.update needs values=: the result of critic.values(rollout) "
                             "for the same rollout")
        batch = assemble(rollout, scores, ref, values)
        dropped = 0.0
        if "versions" in batch:  # before the returns: as the actor, before its advantages
            _, _, stale = drop_stale(batch, self.version, self.rl.max_staleness)
            (dropped,) = global_sums([float(stale.sum())], self.backend.stats_group)
        _, returns = advantages(batch, self.rl, self.backend.stats_group)
        assert returns is not None  # PPO's (checked when built)
        train = batch.select(["prompt_ids", "prompt_mask", "response_ids", "response_mask",
                              "values", "loss_mask"]).union(TensorBatch({"returns": returns}))
        runs, skipped = self._train(train)
        return {**{f"critic/{k}": v for k, v in (mean_stats(runs) if runs else {}).items()},
                "critic/dropped": dropped, "critic/skipped_steps": float(skipped)}

    def _train(self, train: TensorBatch) -> tuple[list[dict[str, float]], int]:
        """A step per mini-batch with tokens (`trained_steps`), and a new version where the
        optimizer stepped (its schedule moved), as the actor counts: none where every row was
        dropped, one where a step or a later mini-batch failed after the weights moved."""
        moved = schedule_moved(self.backend)

        def step(mini: TensorBatch) -> dict[str, float]:
            return self.backend.train_step(mini, value_loss(self.rl))
        try:
            return trained_steps(
                (count_globally(mini, self.backend.stats_group) for _ in range(self.rl.epochs)
                 for mini in mini_batches(train, self.rl, self.backend.stats_group)), step)
        finally:
            if moved():  # (the schedule's steps: ZeRO steps inside the last backward)
                self.version += 1

    def save_state(self, folder: Path) -> None:
        self.backend.save(folder / "train")
        if self.rank == 0:
            torch.save({"version": self.version}, folder / "critic.pt")

    def load_state(self, folder: Path) -> None:
        self.backend.load(folder / "train")
        saved = folder / "critic.pt"  # absent from checkpoints of before critics dropped rows
        if saved.exists():
            self.version = int(torch.load(saved, weights_only=True)["version"])
        elif self.rl.max_staleness is not None:
            log.warning("asyncrl: %s holds no critic.pt (a checkpoint from before session 15): "
                        "the critic counts policy versions from 0 and drops too few stale "
                        "rows; pass update(..., version=) to set it", folder)
