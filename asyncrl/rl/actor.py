"""The actor: a Policy (train + generate on the same ranks) that takes RL steps.

    update(rollout, scores, ref=None, values=None)
        rollout: what generate returned (with the old log-probs "logprobs")
        scores:  the reward group's {"reward"};  ref: the reference's {"logprobs"}
        values:  the critic's {"values"} (PPO)
    -> advantages (GRPO across the ranks, or GAE + whitening) -> `epochs` passes of
       `mini_batches` optimizer steps on the clipped surrogate (+ KL loss, - entropy bonus)
    -> the step's statistics, the same on every rank (one dict comes back)

Every update advances the policy version by one, whatever its mini-batches and epochs (as
verl and AReaL count: a version is what a weight sync carries, so `max_staleness` and a
flow's staleness bound count the same steps); it is saved in checkpoints with the weights
and the optimizer state. An update whose every sample was dropped as too stale takes no
optimizer step (AdamW's momentum would move the weights all the same) and leaves the
version as it was (`actor/skipped_steps` counts the mini-batches without a step).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from asyncrl.actors.register import register
from asyncrl.comm.batch import TensorBatch
from asyncrl.hybrid.engine import BUCKET_BYTES
from asyncrl.hybrid.roles import Policy, check_policy_arguments, schedule_moved
from asyncrl.hybrid.settings import from_dict, own_arguments
from asyncrl.rl.algorithms import (
    TRAINER_KL_CLAMP,
    aggregate,
    kl_penalty,
    masked_mean,
    ppo_policy_loss,
)
from asyncrl.rl.batch import (
    REPORTED,
    STATS,
    advantages,
    assemble,
    check_critic_agrees,
    count_globally,
    drop_stale,
    global_max,
    global_sums,
    mini_batches,
    share,
    trained_steps,
    valid_rows,
)
from asyncrl.rl.config import RLConfig

log = logging.getLogger("asyncrl")

# what the policy loss reads (besides the advantages and, when present, ref_logprobs)
TRAIN_COLUMNS = ["prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs",
                 "loss_mask"]


def importance_weights(prox: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                       cfg: RLConfig) -> torch.Tensor:
    """Per token, the proximal policy's probability over the rollout's (1 outside the mask),
    truncated at `tis_cap` for "tis"; for "decoupled" with a `decoupled_cap`, 0 (the token
    left out) above it."""
    weight = torch.exp(((prox - rollout) * mask).clamp(-20.0, 20.0))  # as the ratio: never inf
    if cfg.correction == "tis":
        return weight.clamp(max=cfg.tis_cap)
    if cfg.correction == "decoupled" and cfg.decoupled_cap is not None:
        return torch.where(weight > cfg.decoupled_cap, torch.zeros_like(weight), weight)
    return weight


def policy_loss(cfg: RLConfig, correct_in_pass: bool = False) -> Any:
    """The loss of one micro-batch: clipped surrogate, + kl_coef * KL to the reference (as a
    loss), - entropy_coef * entropy; with the statistics metrics.jsonl reports.

    correct_in_pass: the off-policy correction with the proximal policy taken from this very
    forward pass (detached). Right when an update is one optimizer step: no weight changes
    between the micro-batches, so a separate forward pass would give the same log-probs
    (verl's on-policy shortcut); it saves that pass."""

    def loss_fn(out: dict[str, torch.Tensor], micro: TensorBatch
                ) -> tuple[torch.Tensor, dict[str, float]]:
        logp, mask = out["logprobs"], micro.tensor("loss_mask")
        per_token = share(micro, "tokens")  # local means -> parts of the global means
        old, adv = micro.tensor("logprobs"), micro.tensor("advantages")
        stats = {}
        if correct_in_pass:  # old: the rollout's log-probs; the ratio's old: this pass's
            weight = importance_weights(logp.detach(), old, mask, cfg)
            old, adv = logp.detach(), adv * weight * mask
            stats["is_weight_mean"] = masked_mean(weight, mask).item() * per_token
        pg, clipfrac = ppo_policy_loss(logp, old, adv, mask, cfg.clip, cfg.agg, cfg.clip_high,
                                       cfg.dual_clip)
        part = share(micro, "tokens" if cfg.agg == "token-mean" else "seqs")
        loss = pg * part
        stats.update(pg_loss=loss.detach().item(), clipfrac=clipfrac.item() * per_token)
        entropy = aggregate(out["entropy"], mask, cfg.agg) * part  # as verl: one agg mode
        stats["entropy"] = entropy.detach().item()
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy
        if "ref_logprobs" in micro:
            kl = aggregate(kl_penalty(logp, micro.tensor("ref_logprobs"), cfg.kl_kind,
                                      clamp=TRAINER_KL_CLAMP), mask, cfg.agg) * part
            stats["kl"] = kl.detach().item()
            if cfg.kl_coef and not cfg.kl_in_reward:
                loss = loss + cfg.kl_coef * kl
        return loss, stats

    return loss_fn


def entropy_mode(cfg: RLConfig) -> bool | str:
    """How the training forward takes the entropy (models.sequence_logprobs): in autograd
    where the loss has an entropy term, else as a metric only ("no_grad": the backward
    keeps no [B, T, vocab] tensors of it)."""
    return True if cfg.entropy_coef else "no_grad"


def mean_stats(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}


class Actor(Policy):
    def __init__(self, model: dict[str, Any], rl: dict[str, Any] | None = None,
                 train: dict[str, Any] | None = None, sampling: dict[str, Any] | None = None,
                 bucket_bytes: int = BUCKET_BYTES, backend: str = "fsdp2", hybrid: bool = True,
                 engine: str = "builtin", engine_options: dict[str, Any] | None = None,
                 multi_turn: dict[str, Any] | None = None, offload_optimizer: bool = True):
        self.rl = from_dict(RLConfig, rl, "Actor rl=")
        super().__init__(model, train, sampling, bucket_bytes, backend, hybrid, engine,
                         engine_options, multi_turn, offload_optimizer)

    @classmethod
    def check_settings(cls, *args: Any, **kwargs: Any) -> None:
        """As Policy.check_settings, rl= too."""
        given = own_arguments(cls, Actor.__init__, args, kwargs)
        if given is not None:
            check_policy_arguments(cls.__name__, given)
            from_dict(RLConfig, given["rl"], f"{cls.__name__} rl=")

    @register(dispatch=STATS)
    def update(self, rollout: TensorBatch, scores: TensorBatch, ref: TensorBatch | None = None,
               values: TensorBatch | None = None) -> dict[str, float]:
        check_critic_agrees(values, self.rl, rollout)
        if self.rl.kl_coef and ref is None:
            raise ValueError(f"RLConfig.kl_coef={self.rl.kl_coef} but update() got no ref=: "
                             f"pass the reference's log-probs (a Reference group's "
                             f"logprobs(rollout), or actor.ref_logprobs(rollout) for a LoRA "
                             f"actor), or set kl_coef=0")
        self.to_train()
        group = self.backend.stats_group
        batch = assemble(rollout, scores, ref, values)
        stale = self._staleness(batch)  # may drop samples: before anything counts them
        adv, _ = advantages(batch, self.rl, group)
        off_policy: dict[str, float] = {}
        in_pass = self.rl.correction != "none" and self.rl.epochs == self.rl.mini_batches == 1
        if self.rl.correction != "none" and not in_pass:
            batch, adv, off_policy = self._correct(batch, adv)
        train = batch.select(TRAIN_COLUMNS + (
            ["ref_logprobs"] if "ref_logprobs" in batch else [])).union(
            TensorBatch({"advantages": adv}))
        waited = self.before_weights_change()  # the last sync may still be pulled
        moved = schedule_moved(self.backend)  # (not counted by steps returned: ZeRO steps
        # inside the last backward, and what follows it in train_step may raise)
        entropy = entropy_mode(self.rl)

        def step(mini: TensorBatch) -> dict[str, float]:
            return self.backend.train_step(mini, policy_loss(self.rl, in_pass), entropy=entropy)
        try:
            runs, skipped = trained_steps(
                (count_globally(mini, group) for _ in range(self.rl.epochs)
                 for mini in mini_batches(train, self.rl, group)), step)
        finally:  # the weights moved (a later mini-batch may have failed): a new version;
            if moved():  # else the policy is the one that generated (its version too)
                self.version += 1
        if not runs and self.rank == 0:
            log.warning("asyncrl: actor update skipped: no token to train on%s", (
                f" (every sample was older than RLConfig.max_staleness="
                f"{self.rl.max_staleness} policy versions; give the actor rl={{"
                f"'max_staleness': k}} with k >= the flow's max_staleness)")
                if stale.get("staleness/dropped") else "")
        stats = mean_stats(runs) if runs else {}
        return {**{f"actor/{k}": v for k, v in stats.items()}, **off_policy, **stale,
                "time/sync_wait_s": waited, "actor/skipped_steps": float(skipped),
                **self._batch_stats(batch), "actor/version": float(self.version)}

    def _staleness(self, batch: TensorBatch) -> dict[str, float]:
        """Samples beyond `max_staleness` dropped (`drop_stale`); a histogram of the lags."""
        if "versions" not in batch:
            return {}
        lag, real, dropped = drop_stale(batch, self.version, self.rl.max_staleness)
        top = float(lag[real].max()) if real.any() else 0.0
        width = int(global_max(top, self.backend.stats_group)) + 1  # the same on every rank
        counts = global_sums([float(((lag == k) & real).sum()) for k in range(width)] +
                             [float(real.sum()), float((lag * real).sum()),
                              float(dropped.sum())], self.backend.stats_group)
        *hist, n, total, drop = counts
        out = {f"staleness/lag_{k}": c / max(n, 1.0) for k, c in enumerate(hist)}
        return {**out, "staleness/mean": total / max(n, 1.0), "staleness/dropped": drop}

    def _correct(self, batch: TensorBatch, adv: torch.Tensor
                 ) -> tuple[TensorBatch, torch.Tensor, dict[str, float]]:
        """Off-policy correction: the trainer's current log-probs become the old policy of
        the PPO ratio; tokens are weighted by current / rollout probability."""
        mask = batch.tensor("loss_mask")
        prox = self.backend.logprobs(batch).cpu() * mask
        weight = importance_weights(prox, batch.tensor("logprobs"), mask, self.rl)
        n, w_sum = global_sums([float(mask.sum()), float((weight * mask).sum())],
                               self.backend.stats_group)
        batch = batch.select([k for k in batch.keys() if k != "logprobs"]).union(
            TensorBatch({"logprobs": prox}))
        return batch, adv * weight * mask, {"actor/is_weight_mean": w_sum / max(n, 1.0)}

    def _batch_stats(self, batch: TensorBatch) -> dict[str, float]:
        """Reward and lengths over the real rows of every rank."""
        valid = valid_rows(batch)
        resp = batch.tensor("response_mask").float().sum(1) * valid  # dropped rows too: n has
        # them (loss_mask leaves out the rows dropped as too stale)
        prompt = batch.tensor("prompt_mask").float().sum(1) * valid
        reward = batch.tensor("reward") * valid
        reported = {f"reward/{k}": batch.tensor(k).float() for k in REPORTED if k in batch}
        if "turns" in batch:  # a multi-turn rollout: its turns, and the env's tokens
            reported["multi_turn/turns"] = batch.tensor("turns").float()
            reported["multi_turn/env_tokens"] = (batch.tensor("response_mask") * (
                1 - batch.tensor("policy_mask"))).sum(1).float()
        if "env_truncated" in batch:  # observations cut to max_observation_tokens
            reported["multi_turn/env_truncated"] = batch.tensor("env_truncated").float()
        if "env_timeouts" in batch:
            reported["multi_turn/env_timeouts"] = batch.tensor("env_timeouts").float()
        n, r_sum, r_sq, len_sum, tokens, *sums = global_sums(
            [float(valid.sum()), float(reward.sum()), float((reward * reward).sum()),
             float(resp.sum()), float(resp.sum() + prompt.sum()),
             *[float((v * valid).sum()) for v in reported.values()]],
            self.backend.stats_group)
        mean = r_sum / max(n, 1.0)
        return {"reward/mean": mean, "reward/std": max(r_sq / max(n, 1.0) - mean * mean, 0.0)
                ** 0.5, "response_length/mean": len_sum / max(n, 1.0), "perf/tokens": tokens,
                **{k: v / max(n, 1.0) for k, v in zip(reported, sums, strict=True)}}

    # -- checkpoints --------------------------------------------------------------------------
