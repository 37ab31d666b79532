"""What the actor and the critic share: a step's training batch built from its pieces,
per-token rewards, advantages across the data-parallel ranks, and the `STATS` protocol.

A DP call pads the last ranks' chunks so that every rank runs the same steps; padding rows
get `loss_mask` 0 and are left out of every sum, so a padded batch trains exactly as the
unpadded one would.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.actors.protocols import _dp_split, _rank_zero_collect, register_protocol
from asyncrl.comm.batch import PAD_KEY, TensorBatch
from asyncrl.hybrid.turns import sampled_mask
from asyncrl.rl.algorithms import TRAINER_KL_CLAMP, gae, grpo_advantages, kl_penalty
from asyncrl.rl.config import RLConfig

log = logging.getLogger("asyncrl")

# what a RewardFn's scores may hold beside "reward", reported as reward/<name> (batch means)
REPORTED = ("overlong_penalty", "timed_out", "crashed")
# the columns assemble() puts beside a rollout's: a prompt record's key of one of these names
# would clash with it at the first update (PromptSource refuses them)
ASSEMBLED = frozenset({"reward", "ref_logprobs", "values", "loss_mask", *REPORTED})
SAMPLES_PER_PROMPT = "samples_per_prompt"  # a prompt batch's meta: its source's repeat=

# Batches split as DP splits them; the answer is rank 0's (it always answers a DP call), for
# methods whose ranks all return the same all-reduced statistics (numbers for metrics.jsonl).
STATS = register_protocol("dp_stats", split=_dp_split, collect=_rank_zero_collect)


def valid_rows(batch: TensorBatch) -> torch.Tensor:
    """1.0 for real rows, 0.0 for the trailing padding rows a DP chunk may carry."""
    n = len(batch)
    return (torch.arange(n) < batch.real_rows).float()


def assemble(rollout: TensorBatch, scores: TensorBatch, ref: TensorBatch | None = None,
             values: TensorBatch | None = None) -> TensorBatch:
    """The rollout's columns with "reward", "ref_logprobs", "values" and "loss_mask" (and
    the scores' REPORTED columns they have)."""
    if not isinstance(scores, TensorBatch):  # (a RANK_ZERO scorer's list, a dict)
        raise TypeError(f"the scores are a {type(scores).__name__}, not a TensorBatch: a "
                        f"scorer returns TensorBatch({{'reward': ...}}), one number a row "
                        f"(as RewardFn.score and RewardModel.score do)")
    if "reward" not in scores:
        raise KeyError(f"the scores batch needs a 'reward' column (RewardFn.score or "
                       f"RewardModel.score return one); it has {scores.keys()}")
    parts = {"reward": scores.tensor("reward").float()}
    parts.update({k: scores.tensor(k).float() for k in REPORTED if k in scores})
    if ref is not None:
        parts["ref_logprobs"] = ref.tensor("logprobs")
    if values is not None:
        parts["values"] = values.tensor("values")
    batch = rollout.union(TensorBatch(parts))
    mask = sampled_mask(batch) * valid_rows(batch)[:, None]
    return batch.union(TensorBatch({"loss_mask": mask}))


def drop_stale(batch: TensorBatch, version: int, max_staleness: int | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's lag, how many versions `version` is ahead of its oldest token; the rows more
    than `max_staleness` behind get loss_mask 0 (in place: the batch's own column). The actor
    and the critic both drop them, so neither trains on what the other leaves out. Returns
    (lag, real, dropped): real marks the rows with tokens to train on."""
    mask = batch.tensor("loss_mask")
    versions = batch.tensor("versions").masked_fill(mask == 0, version)
    lag = (version - versions.min(1).values).clamp(min=0)
    real = mask.sum(1) > 0
    dropped = real & (lag > max_staleness) if max_staleness is not None \
        else torch.zeros_like(real)
    mask.mul_((~dropped).float()[:, None])
    return lag, real, dropped


def global_sums(values: list[float], group: Any) -> list[float]:
    """Elementwise sums over the data-parallel ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.tolist()


def global_max(value: float, group: Any) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0])


def count_globally(mini: TensorBatch, group: Any) -> TensorBatch:
    """Mark a mini-batch with its token and sequence counts over every rank, so that each
    micro-batch's loss can be weighted to make the step's loss the mean over the whole
    mini-batch, whatever the layout (ranks and micro-batches may hold unequal counts)."""
    mask = mini.tensor("loss_mask")
    tokens, seqs = global_sums([float(mask.sum()), float((mask.sum(1) > 0).sum())], group)
    mini.meta.update(tokens=tokens, seqs=seqs, rows=len(mini), dp=dist.get_world_size(group))
    return mini


def trained_steps(minis: Any, step: Any) -> tuple[list[dict[str, float]], int]:
    """`step(mini)` for each mini-batch (counted globally) with a token to train on, and
    how many had none (every row dropped as too stale): a step there would still move the
    weights, by AdamW's momentum and weight decay."""
    runs, skipped = [], 0
    for mini in minis:
        if mini.meta["tokens"]:
            runs.append(step(mini))
        else:
            skipped += 1
    return runs, skipped


def share(micro: TensorBatch, per: str) -> float:
    """The factor that turns a micro-batch's local mean (per "tokens" or "seqs") into its
    part of the global mean: the backend weights micro-batches by rows and averages ranks."""
    mask = micro.tensor("loss_mask")
    local = float(mask.sum()) if per == "tokens" else float((mask.sum(1) > 0).sum())
    return micro.meta["dp"] * micro.meta["rows"] * local / (max(micro.meta[per], 1.0)
                                                             * len(micro))


def _kl(batch: TensorBatch, cfg: RLConfig) -> torch.Tensor:
    if "ref_logprobs" not in batch:
        raise KeyError("kl_in_reward needs the reference's log-probs: pass the reference "
                       "node's result to update(..., ref=...)")
    return kl_penalty(batch.tensor("logprobs"), batch.tensor("ref_logprobs"), cfg.kl_kind,
                      clamp=TRAINER_KL_CLAMP)


def token_rewards(batch: TensorBatch, cfg: RLConfig) -> torch.Tensor:
    """The score on each row's last sampled token, minus kl_coef * KL per sampled token when
    the KL is in the reward. Taken on the sampled mask, not the loss mask: a sample dropped
    as too stale keeps its reward (it still counts in its GRPO group's baseline, as it does
    without the KL in the reward)."""
    mask = sampled_mask(batch)
    last = (mask * torch.arange(1, mask.shape[1] + 1)).argmax(1)  # 0 for a row without any
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(batch)), last] = batch.tensor("reward") * (mask.sum(1) > 0)
    if cfg.kl_in_reward and cfg.kl_coef:
        rewards = rewards - cfg.kl_coef * _kl(batch, cfg) * mask
    return rewards


def mini_batches(train: TensorBatch, cfg: RLConfig, group: Any = None) -> list[TensorBatch]:
    """The batch in `cfg.mini_batches` parts, one optimizer step each, near-equal over the
    group's ranks together: each rank's real rows cut near-equally, the parts that take a
    row more rotated by its rank, and every part padded to one length with rows that train
    on nothing (the ranks' micro-batch counts agree). Cut alike on every rank, the first
    parts took every rank's extra row and the last every DP padding row: 48 rows on 8 ranks
    in 4 steps of 16, 16, 8 and 8. Fewer parts when a rank holds fewer rows (a short last
    batch of dynamic sampling): a part without rows would step the optimizer on nothing."""
    if len(train) < cfg.mini_batches:
        log.warning("asyncrl: RLConfig.mini_batches=%d, but this rank holds %d rows of the "
                    "batch: %d optimizer steps this time", cfg.mini_batches, len(train),
                    max(len(train), 1))
    n = max(1, min(cfg.mini_batches, len(train)))  # (the same on every rank: equal rows)
    if n == 1:
        return [train]
    base, extra = divmod(train.real_rows, n)
    shift = dist.get_rank(group) if dist.is_initialized() else 0
    width = -(-len(train) // n)
    parts, start = [], 0
    for i in range(n):
        size = base + ((i - shift) % n < extra)
        parts.append(_padded(train.slice(start, start + size), width, train))
        start += size
    return parts


def _padded(part: TensorBatch, width: int, like: TensorBatch) -> TensorBatch:
    """`part` of `width` rows: copies of its last row (of `like`'s first, if it has none),
    their loss_mask zeroed and marked as padding."""
    missing = width - len(part)
    if not missing:
        return part
    src = part if len(part) else like.slice(0, 1)
    out = src.take([*range(len(part)), *[len(src) - 1] * missing])
    mask = out.tensor("loss_mask").clone()
    mask[len(part):] = 0
    return TensorBatch({k: mask if k == "loss_mask" else v for k, v in out.items()},
                       {**part.meta, PAD_KEY: missing})


def prompt_fingerprints(batch: TensorBatch) -> torch.Tensor:
    """Per row, a hash of its prompt's tokens (padding left out): equal prompts, equal
    hashes, whatever their rows' widths."""
    ids, mask = batch.tensor("prompt_ids"), batch.tensor("prompt_mask").bool()
    return torch.tensor([hash(tuple(row[keep].tolist())) for row, keep in zip(ids, mask,
                                                                               strict=True)],
                        dtype=torch.int64)


def sampling_seeds(batch: TensorBatch) -> torch.Tensor:
    """Per row, [its sampling seed as an int64 (modulo 2**64, as the sampler takes it), 1];
    [0, 0] for every row of a batch without a "seed" column."""
    if "seed" not in batch:
        return torch.zeros(len(batch), 2, dtype=torch.int64)
    seeds = [(int(s) + 2**63) % 2**64 - 2**63 for s in batch["seed"]]
    return torch.stack([torch.tensor(seeds, dtype=torch.int64),
                        torch.ones(len(batch), dtype=torch.int64)], 1)


def check_groups(prompts: torch.Tensor, group_size: int, seeds: torch.Tensor | None = None
                 ) -> None:
    """Each GRPO group (`group_size` consecutive samples) answers one prompt (`prompts`:
    their fingerprints): else its baseline would mix prompts, silently. With `seeds` (the
    samples' sampling seeds), each sample of a group has its own."""
    _check_one_prompt(prompts, group_size)
    if seeds is not None:
        _check_distinct_seeds(seeds, group_size)


def _check_distinct_seeds(seeds: torch.Tensor, group_size: int) -> None:
    """Equal seeds draw equal numbers: the samples are identical, their rewards equal and
    their advantages all 0, so the group trains nothing (a source of repeat=1 whose batch
    was copied with batch.repeat(k), seeds and all)."""
    group = shared_seed_group(seeds, group_size)
    if group is not None:
        first = group * group_size
        raise ValueError(f"GRPO: samples {first}..{first + group_size - 1} of the batch "
                         f"(group {group}): samples of one group share a sampling "
                         f"seed: they are identical (advantages all 0, nothing learned); use "
                         f"PromptSource(repeat=group_size), not batch.repeat(k), which "
                         f"copies the seeds too")


def shared_seed_group(seeds: torch.Tensor, group_size: int) -> int | None:
    """The first group (`group_size` consecutive samples, of `sampling_seeds`' seeds) two of
    whose samples share a seed; None when none does."""
    ordered = seeds.view(-1, group_size).sort(1).values
    shared = (ordered[:, 1:] == ordered[:, :-1]).any(1).nonzero()
    return int(shared[0]) if len(shared) else None


def _check_one_prompt(prompts: torch.Tensor, group_size: int) -> None:
    groups = prompts.view(-1, group_size)
    mixed = (groups != groups[:, :1]).any(1).nonzero()
    if len(mixed):
        first = int(mixed[0]) * group_size
        raise ValueError(f"GRPO: samples {first}..{first + group_size - 1} of the batch "
                         f"(group {int(mixed[0])}) answer different prompts: a group is "
                         f"group_size={group_size} consecutive samples of one prompt; sample "
                         f"that many per prompt (PromptSource(..., repeat=group_size))")


def check_repeat(batch: TensorBatch, cfg: RLConfig) -> None:
    """A GRPO group is all of one prompt's samples: with PromptSource(repeat=16) and
    group_size=8 each prompt had two baselines of half its samples each (check_groups passes
    them: each half is one prompt's). The same meta on every rank: raised on all alike."""
    # (1: one sample per prompt, repeated later with batch.repeat(k): check_groups sees
    # those rows, and refuses copies that share a seed)
    repeat = batch.meta.get(SAMPLES_PER_PROMPT)
    if repeat is not None and repeat > 1 and repeat != cfg.group_size:
        raise ValueError(
            f"GRPO: group_size={cfg.group_size}, but the PromptSource repeats each prompt "
            f"{repeat} times (repeat={repeat}): a group is all of one prompt's samples; give "
            f"both (RLConfig group_size and PromptSource repeat) the same value")


def _grpo(batch: TensorBatch, cfg: RLConfig, group: Any) -> torch.Tensor:
    """Each row's group-relative advantage: the groups may straddle ranks, so every rank
    gathers all the (few) sequence rewards and keeps its own rows' advantages."""
    check_repeat(batch, cfg)  # before the collectives
    mask, valid = batch.tensor("loss_mask"), valid_rows(batch)
    seq = token_rewards(batch, cfg).sum(1) if cfg.kl_in_reward else batch.tensor("reward")
    world = dist.get_world_size(group)
    rewards = [torch.zeros_like(seq) for _ in range(world)]
    flags = [torch.zeros_like(valid) for _ in range(world)]
    dist.all_gather(rewards, seq.float().contiguous(), group=group)
    dist.all_gather(flags, valid.contiguous(), group=group)
    # each row: its prompt's fingerprint, its sampling seed, 1 if it has one
    keys = torch.cat([prompt_fingerprints(batch)[:, None], sampling_seeds(batch)], 1)
    prompts = [torch.zeros(len(seq), 3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(prompts, keys, group=group)
    everything = torch.cat([r[f.bool()] for r, f in zip(rewards, flags, strict=True)])
    # every rank holds the same rewards now: each raises alike (a NaN's group got advantages
    # 0 silently: its std > 0 was false)
    bad = (~everything.isfinite()).nonzero().flatten()
    if len(bad):
        kl = " (its reward minus the KL: kl_in_reward)" if cfg.kl_in_reward else ""
        raise ValueError(f"GRPO: sample {int(bad[0])} of the batch has the reward "
                         f"{float(everything[bad[0]])}{kl}, {len(bad)} sample(s) in all are "
                         f"not finite; a reward must be a finite number: fix the scorer")
    if everything.numel() % cfg.group_size:
        raise ValueError(f"GRPO: the batch has {everything.numel()} samples, not a multiple of "
                         f"group_size={cfg.group_size}; sample group_size responses per prompt "
                         f"(PromptSource(..., repeat=group_size))")
    real = torch.cat([p[f.bool()] for p, f in zip(prompts, flags, strict=True)])
    seeded = bool(real[:, 2].all())  # (every row or none: the columns of one prompt batch)
    check_groups(real[:, 0], cfg.group_size, real[:, 1] if seeded else None)
    adv = grpo_advantages(everything, cfg.group_size, std_normalize=cfg.std_normalize)
    me = dist.get_rank(group)
    start = int(sum(int(f.sum()) for f in flags[:me]))
    mine = torch.zeros_like(seq, dtype=torch.float32)
    count = int(valid.sum())
    mine[:count] = adv[start:start + count]  # padding rows are trailing
    return mine[:, None] * mask


def whiten_across(x: torch.Tensor, mask: torch.Tensor, group: Any, eps: float = 1e-8
                  ) -> torch.Tensor:
    """(x - mean) / std over the masked positions of every data-parallel rank (the variance
    unbiased, as verl's masked_whiten)."""
    total, count = global_sums([float((x * mask).sum()), float(mask.sum())], group)
    mean = total / max(count, 1.0)
    (sq,) = global_sums([float(((x - mean).pow(2) * mask).sum())], group)
    return (x - mean) * (sq / max(count - 1, 1.0) + eps) ** -0.5 * mask


CRITIC_RL = "critic_rl"  # the meta key of the critic's values: its RLConfig.returns_fields()


def check_critic_agrees(values: TensorBatch | None, cfg: RLConfig,
                        rollout: TensorBatch | None = None) -> None:
    """The critic's values came from a Critic whose returns are computed as this actor's
    advantages are (each group takes its own `rl=`), on the rows it trains on (its
    max_staleness, where the `rollout` has policy versions to drop rows by): else a clear
    error, before training."""
    theirs = values.meta.get(CRITIC_RL) if values is not None else None
    if theirs is None:  # not from a Critic (a user's own values): nothing to compare
        return
    ours = cfg.returns_fields()
    if rollout is not None and "versions" not in rollout:  # no row is dropped by staleness
        ours.pop("max_staleness")
    differ = [f"{k}: actor {ours[k]!r}, critic {theirs.get(k)!r}" for k in ours
              if theirs.get(k) != ours[k]]
    if differ:
        raise ValueError(f"the actor's advantages and the critic's returns would be computed "
                         f"differently ({'; '.join(differ)}): pass the same rl= to the Actor "
                         f"and the Critic groups")


def advantages(batch: TensorBatch, cfg: RLConfig, group: Any
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages [B, T] and, for PPO, the critic's returns (GAE before whitening)."""
    if cfg.algo == "grpo":
        return _grpo(batch, cfg, group), None
    if "values" not in batch:
        raise KeyError("PPO needs the critic's values: pass the critic node's result to "
                       "update(..., values=...)")
    check_finite_rewards(batch, group)
    mask = batch.tensor("loss_mask")
    adv, returns = gae(token_rewards(batch, cfg), batch.tensor("values"), mask, cfg.gamma,
                       cfg.lam)
    return whiten_across(adv, mask, group), returns


def check_finite_rewards(batch: TensorBatch, group: Any) -> None:
    """A non-finite reward refused on every rank alike (counted over them: one rank raising
    alone would leave the others in the next collective). One NaN made every advantage NaN
    after whitening, and every step was skipped as grad_nonfinite."""
    reward = batch.tensor("reward")
    bad = ~reward.isfinite() & valid_rows(batch).bool()
    (count,) = global_sums([float(bad.sum())], group)
    if not count:
        return
    # the first bad row of the lowest rank that has one: (rank, row) as one float to max
    rank, rows = dist.get_rank(group), 2 ** 32  # (exact in a float64 below 2**21 ranks)
    first = -(rank * rows + int(bad.nonzero()[0])) if bad.any() else -math.inf
    at, row = divmod(-int(global_max(first, group)), rows)
    here = f" (its reward {float(reward[row])})" if at == rank else ""
    raise ValueError(f"PPO: {int(count)} reward(s) of the batch are not finite numbers: the "
                     f"first is row {row} of data-parallel rank {at}'s rows{here}; a reward "
                     f"must be a finite number: fix the scorer")
