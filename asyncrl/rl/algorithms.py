"""RL algorithms as plain tensor functions (`mask` is 1 on the response tokens that count: a
prefix of each row, with gaps where a multi-turn rollout's observations are). Trainers are
built from these; each is tested against hand-computed values."""

from __future__ import annotations

import math

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                    std_normalize: bool = True) -> torch.Tensor:
    """(r - group mean) / (group std + eps) for contiguous groups of `group_size` rows; std
    is torch.std (unbiased). With group_size=1, or a group of equal rewards, the advantages
    are 0 (with eps=0 too)."""
    if not eps >= 0:
        raise ValueError(f"grpo_advantages: eps must be >= 0 (it keeps a small std from "
                         f"blowing the advantages up; 1e-6 by default), got {eps}")
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"grpo_advantages: {rewards.numel()} rewards do not split into "
                         f"groups of {group_size}; sample group_size responses per prompt, "
                         f"each group's rows contiguous")
    bad = (~rewards.isfinite()).nonzero().flatten()
    if len(bad):  # (std_normalize gave a NaN's group 0 silently: std > 0 is false for NaN)
        raise ValueError(f"grpo_advantages: sample {int(bad[0])} has the reward "
                         f"{float(rewards[bad[0]])}, {len(bad)} sample(s) in all are not "
                         f"finite; a reward must be a finite number: fix the scorer")
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=torch.float32)
    # in float64: a float32 group mean of equal rewards (9.9 x 8) may be one rounding off
    # them, and that difference over a std of 0 (+ eps) gave the whole group an advantage
    # of -0.47 (float32 rewards sum exactly in float64: equal ones give exactly 0)
    r = rewards.double().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:  # (a group of equal rewards: 0 / 0 with eps=0, kept at 0)
        std = r.std(dim=1, keepdim=True)
        adv = torch.where(std > 0, adv / (std + eps), torch.zeros_like(adv))
    return adv.float().reshape(-1)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's response tokens; raw (whitening is a
    separate step). returns = advantages + values; positions with mask 0 get 0. Masked
    positions inside a row (a multi-turn rollout's observations) are skipped, not ends: a
    turn's tokens see the next turn's values and rewards, as if the gap were not there."""
    if not rewards.shape == values.shape == mask.shape:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} "
                         f"and mask {tuple(mask.shape)} must have the same [B, T] shape")
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0 <= value <= 1:  # (past 1 the returns grow without bound; NaN spoils all)
            raise ValueError(f"gae: {name} must be in [0, 1] (a discount: 1 for none), got "
                             f"{value}")
    m = mask.float()
    r, v = rewards.float() * m, values.float() * m
    adv = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    next_value = torch.zeros_like(running)
    for t in reversed(range(r.shape[1])):
        here = m[:, t] > 0
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = torch.where(here, delta + gamma * lam * running, running)
        adv[:, t] = running * m[:, t]
        next_value = torch.where(here, v[:, t], next_value)  # 0 past a row's last token
    return adv, (adv + v) * m


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip: float = 0.2, agg: str = "token-mean",
                    clip_high: float | None = None, dual_clip: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate: per token max(-A*ratio, -A*clip(ratio, 1-clip, 1+clip_high)),
    ratio = exp(logp - old_logp), clip_high = clip unless given (DAPO's clip-higher); with
    `dual_clip` c > 1, a negative advantage's term is at most -A*c (dual-clip PPO, verl's
    clip_ratio_c). Aggregated as `agg` says (see aggregate: padding and dropped rows count
    in no mean). clipfrac: the share of masked tokens where the clipped term is the
    larger. `advantages` is per token, or [B] (a row's, as grpo_advantages gives: spread
    over its tokens)."""
    check_clips(clip, clip_high, dual_clip)
    if logp.dim() == 2 and advantages.dim() == 1 and len(advantages) == len(logp):
        advantages = advantages[:, None]
    check_per_token("ppo_policy_loss", "logp", logp, old_logp=old_logp, mask=mask,
                    advantages=advantages)
    m = mask.to(logp.dtype)
    # clamped as verl does: e^89 is inf in fp32, and inf * a zero advantage is NaN
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + (clip if clip_high is None
                                                              else clip_high))
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * dual_clip),
                                per_token)
    loss = aggregate(per_token, m, agg)
    clipfrac = masked_mean((clipped > unclipped).to(logp.dtype), m)
    return loss, clipfrac.detach()


def check_clips(clip: float, clip_high: float | None, dual_clip: float | None,
                who: str = "ppo_policy_loss: ") -> None:
    """ppo_policy_loss's ranges (RLConfig's too, `who` naming it)."""
    if not 0 < clip < 1 or (clip_high is not None and not clip_high > 0):
        raise ValueError(f"{who}clip must be in (0, 1) (the ratio's lower bound is 1 - clip; "
                         f"0.2 is usual) and clip_high > 0 or None, got {clip} and {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"{who}dual_clip must be > 1 (a negative advantage's loss is at most "
                         f"-A * dual_clip; verl uses 3.0) or None, got {dual_clip}")


def check_per_token(who: str, name: str, like: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Each of `tensors` has the shape of `like`, per token; "advantages" may have a 1 for a
    dim (a row's value along its tokens). Broadcast, a [B] one beside [B, T] gave each column
    one row's value where B == T, and a bare size mismatch elsewhere."""
    for key, x in tensors.items():
        fits = x.shape == like.shape or (key == "advantages" and x.dim() == like.dim() and all(
            a in (1, b) for a, b in zip(x.shape, like.shape, strict=True)))
        if not fits:
            rows = " (advantages may be [B]: one per row)" if key == "advantages" else ""
            raise ValueError(f"{who}: {key} has the shape {tuple(x.shape)} and {name} "
                             f"{tuple(like.shape)}; give each per token, of one [B, T] "
                             f"shape{rows}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


# verl's loss_agg_mode names (seq-mean-token-sum-norm as the Dr. GRPO paper: see aggregate)
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean"
              ) -> torch.Tensor:
    """A per-token loss term's mean, as verl's loss_agg_mode applies to the policy, KL and
    entropy terms alike: over the masked tokens ("token-mean"), or over the rows with a
    token of each row's mean ("seq-mean-token-mean"), sum ("seq-mean-token-sum") or sum
    divided by the response width, a constant ("seq-mean-token-sum-norm": Dr. GRPO, no
    length bias). The last averages over the rows as the Dr. GRPO paper does; verl's
    agg_loss sums them, a loss (and gradient) larger by a micro-batch's rows: a learning
    rate or grad_clip ported from verl with it needs that factor."""
    m = mask.to(per_token.dtype)
    if agg == "token-mean":
        return masked_mean(per_token, m)
    if agg not in AGGS:
        raise ValueError(f"agg is one of {', '.join(AGGS)}, got {agg!r}")
    per_row = (per_token * m).sum(1)
    if agg == "seq-mean-token-mean":
        per_row = per_row / m.sum(1).clamp(min=1)
    elif agg == "seq-mean-token-sum-norm":
        per_row = per_row / m.shape[1]
    return per_row.sum() / (m.sum(1) > 0).sum().clamp(min=1)


TRAINER_KL_CLAMP = 10.0  # the bound the trainer gives k3, as verl's low_var_kl


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3", *,
               clamp: float | None = None) -> torch.Tensor:
    """Per-token KL estimates against the reference policy: k1 logp - ref, k2 (logp - ref)^2
    / 2, k3 exp(ref - logp) - (ref - logp) - 1, unclamped. `clamp` bounds k3 to [-clamp,
    clamp] as verl's low_var_kl does with 10 (the trainer's setting: one token far below the
    reference would give e^30 and outweigh everything else); k1 and k2 stay as they are."""
    check_per_token("kl_penalty", "logp", logp, ref_logp=ref_logp)
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "k2":
        return diff.pow(2) / 2
    if kind == "k3":  # expm1: exp(-d) - 1 + d without cancelling away small d
        if clamp is None:
            return torch.expm1(-diff) + diff
        if not clamp > 0:
            raise ValueError(f"kl_penalty: clamp is a bound > 0, or None (unclamped), got "
                             f"{clamp!r}")
        # d bounded where k3 is already >= clamp on either side (k3(c + 1) > c, and
        # k3(-log(1 + c) - 1) = e(1 + c) - log(1 + c) - 2 >= c): the same result, without
        # e^89 = inf in fp32 (whose gradient through the clamp is NaN)
        diff = diff.clamp(-(math.log1p(clamp) + 1.0), clamp + 1.0)
        return torch.clamp(torch.expm1(-diff) + diff, -clamp, clamp)
    raise ValueError(f"kl_penalty: kind is 'k1', 'k2' or 'k3', got {kind!r}")


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked positions (the trainer's whitening step), the
    variance unbiased as verl's masked_whiten takes it."""
    check_per_token("whiten", "values", values, mask=mask)
    m = mask.to(values.dtype)
    n = m.sum().clamp(min=1)
    mean = (values * m).sum() / n
    var = ((values - mean).pow(2) * m).sum() / (n - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * m


def pass_at_k(correct: torch.Tensor, n: int, k: int) -> float:
    """The unbiased pass@k (Chen et al., 2021) of contiguous groups of `n` samples per
    prompt, averaged over the prompts: per prompt with c correct, 1 - C(n - c, k) / C(n, k),
    the chance that k of its n samples drawn without replacement hold a correct one. pass@1
    is the mean; pass@n, the share of prompts with a correct sample."""
    if not 1 <= k <= n or correct.dim() != 1 or correct.numel() % n or not correct.numel():
        raise ValueError(f"pass_at_k: {correct.numel()} samples in groups of n={n} with "
                         f"1 <= k={k} <= n; give each prompt's n samples contiguous")
    if not bool(((correct == 0) | (correct == 1)).all()):  # a raw reward (-1 wrong, 0.1
        # for format) would count as correct wherever it is not 0
        raise ValueError(f"pass_at_k: give whether each sample is correct (bools or 0/1), "
                         f"got values {sorted(set(correct.unique().tolist()))[:5]}: compare "
                         f"rewards first, e.g. rewards > 0")
    counts = correct.bool().view(-1, n).sum(1).tolist()
    return sum(1.0 - math.comb(n - c, k) / math.comb(n, k) for c in counts) / len(counts)
