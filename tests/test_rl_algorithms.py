"""The RL algorithm functions against values computed by hand."""

from __future__ import annotations

import math
import re

import pytest
import torch

from asyncrl.rl import gae, grpo_advantages, kl_penalty, pass_at_k, ppo_policy_loss, whiten


def test_grpo_advantages_of_a_group_of_equal_rewards_are_exactly_zero():
    """A float32 group mean of equal rewards could be one rounding off them: over a std of
    0 (+ eps), every sample of a group that should teach nothing got -0.47 (9.9 x 8)."""
    for value in (0.1, 0.7, 3.7, 9.9, -0.9):
        for group in (3, 5, 8, 16):
            for std in (True, False):
                adv = grpo_advantages(torch.full((group,), value), group, std_normalize=std)
                assert torch.equal(adv, torch.zeros(group)), (value, group, std, adv)


def test_grpo_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    adv = grpo_advantages(r, group_size=3)
    std1 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased: n - 1 = 2
    std2 = math.sqrt(((1 / 3) ** 2 + 2 * (1 / 6) ** 2) / 2)  # group [0, .5, .5], mean 1/3
    want = [(2 / 3) / (std1 + 1e-6), (-1 / 3) / (std1 + 1e-6), (-1 / 3) / (std1 + 1e-6),
            (-1 / 3) / (std2 + 1e-6), (1 / 6) / (std2 + 1e-6), (1 / 6) / (std2 + 1e-6)]
    assert torch.allclose(adv, torch.tensor(want), atol=1e-6)
    plain = grpo_advantages(r, 3, std_normalize=False)
    assert torch.allclose(plain, torch.tensor([2 / 3, -1 / 3, -1 / 3, -1 / 3, 1 / 6, 1 / 6]),
                          atol=1e-6)
    assert torch.equal(grpo_advantages(r, 1), torch.zeros(6))
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        grpo_advantages(r, 4)


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]])  # the last position is masked out
    values = torch.tensor([[0.5, 0.4, 0.3, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    g, lam = 0.9, 0.8
    d2 = 1.0 + g * 0 - 0.3
    d1 = 0.0 + g * 0.3 - 0.4
    d0 = 0.0 + g * 0.4 - 0.5
    a2 = d2
    a1 = d1 + g * lam * a2
    a0 = d0 + g * lam * a1
    adv, ret = gae(rewards, values, mask, g, lam)
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[a0 + 0.5, a1 + 0.4, a2 + 0.3, 0.0]]), atol=1e-6)
    with pytest.raises(ValueError, match="same \\[B, T\\] shape"):
        gae(rewards, values[:, :3], mask, g, lam)


def test_ppo_policy_loss_by_hand():
    logp = torch.log(torch.tensor([[1.5, 0.9, 1.0], [1.0, 0.5, 2.0]]))
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # ratios 1.5, 0.9, 1.0 | 1.0, 0.5 (masked: 2.0)
    # A=+1: max(-1.5, -1.2) = -1.2 (clipped larger), max(-0.9,-0.9)=-0.9, -1.0
    # A=-1: max(1.0, 1.0) = 1.0, max(0.5, 0.8) = 0.8 (clipped larger)
    per = [[-1.2, -0.9, -1.0], [1.0, 0.8]]
    loss, clipfrac = ppo_policy_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx((sum(per[0]) + sum(per[1])) / 5, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 5)
    seq, _ = ppo_policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean")
    assert seq.item() == pytest.approx((sum(per[0]) / 3 + sum(per[1]) / 2) / 2, abs=1e-6)
    # a row with no token in the mask (padding, a dropped sample) counts in neither mean
    padded = [torch.cat([t, t[:1]]) for t in (logp, old, adv)]
    empty = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    assert ppo_policy_loss(*padded, empty)[0].item() == pytest.approx(loss.item())
    assert ppo_policy_loss(*padded, empty, agg="seq-mean-token-mean")[0].item() == \
        pytest.approx(seq.item())
    # verl's other modes: each row's sum, or its sum over the response width (Dr. GRPO)
    sums, _ = ppo_policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum")
    assert sums.item() == pytest.approx((sum(per[0]) + sum(per[1])) / 2, abs=1e-6)
    norm, _ = ppo_policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum-norm")
    assert norm.item() == pytest.approx((sum(per[0]) / 3 + sum(per[1]) / 3) / 2, abs=1e-6)
    for agg, value in (("seq-mean-token-sum", sums), ("seq-mean-token-sum-norm", norm)):
        assert ppo_policy_loss(*padded, empty, agg=agg)[0].item() == pytest.approx(value.item())
    with pytest.raises(ValueError, match="agg is one of token-mean, seq-mean-token-mean, "
                                         "seq-mean-token-sum, seq-mean-token-sum-norm, got 'sum'"):
        ppo_policy_loss(logp, old, adv, mask, agg="sum")


def test_a_huge_ratio_with_a_zero_advantage_is_no_nan():
    """exp(100) is inf in fp32, and inf * 0 is NaN: the log-ratio is clamped (verl's 20)."""
    logp, old = torch.tensor([[50.0, -1.0]]), torch.tensor([[-50.0, -1.0]])
    loss, _ = ppo_policy_loss(logp, old, torch.tensor([[0.0, 1.0]]), torch.ones(1, 2))
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(-0.5)


def test_importance_weights_stay_finite_far_off_policy():
    """A rollout 94 nats less likely than the trainer's policy: exp overflows without the
    clamp, and a zero advantage times inf is NaN (the decoupled objective has no cap)."""
    from asyncrl.rl.actor import importance_weights
    from asyncrl.rl.config import RLConfig

    prox, rollout, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-95.0, -2.0]]), \
        torch.ones(1, 2)
    weight = importance_weights(prox, rollout, mask, RLConfig(group_size=2,
                                                               correction="decoupled"))
    assert torch.isfinite(weight).all() and weight[0, 0] == pytest.approx(math.exp(20))
    assert (weight * torch.tensor([[0.0, 1.0]])).isfinite().all()
    tis = importance_weights(prox, rollout, mask, RLConfig(group_size=2, correction="tis"))
    assert tis.tolist() == [[2.0, 1.0]]
    # with a cap (AReaL's behav_imp_weight_cap) that token leaves the loss instead
    capped = importance_weights(prox, rollout, mask, RLConfig(
        group_size=2, correction="decoupled", decoupled_cap=5.0))
    assert capped.tolist() == [[0.0, 1.0]]
    with pytest.raises(ValueError, match="decoupled_cap must be > 1"):
        RLConfig(group_size=2, correction="decoupled", decoupled_cap=0.5)
    with pytest.raises(ValueError, match="decoupled_cap is for correction='decoupled'"):
        RLConfig(group_size=2, correction="tis", decoupled_cap=5.0)


def test_rl_config_refuses_settings_that_would_train_wrong_silently():
    from asyncrl.rl.config import RLConfig

    for bad, said in [({"max_staleness": -1}, "max_staleness must be >= 0"),
                      ({"clip": 1.5}, "clip must be in (0, 1)"),
                      ({"gamma": -1.0}, "gamma must be in [0, 1]"),
                      ({"lam": 1.5}, "lam must be in [0, 1]"),
                      ({"value_clip": -0.2}, "value_clip must be > 0"),
                      ({"kl_coef": -0.1}, "kl_coef must be >= 0"),
                      # a NaN coefficient made every loss NaN (each step skipped); "no" was
                      # true; 1.5 epochs failed inside each rank
                      ({"kl_coef": float("nan")}, "kl_coef must be a finite number"),
                      ({"entropy_coef": float("inf")}, "entropy_coef must be a finite"),
                      ({"dual_clip": float("nan")}, "dual_clip must be a finite number (or "
                                                    "None)"),
                      ({"kl_in_reward": "no"}, "kl_in_reward must be True or False"),
                      ({"epochs": 1.5}, "epochs must be a whole number")]:
        with pytest.raises(ValueError, match=re.escape(said)):
            RLConfig(group_size=2, **bad)
    assert RLConfig(group_size=2, max_staleness=0, gamma=0.0, lam=1.0).max_staleness == 0


def test_rl_config_refuses_a_negative_entropy_bonus_and_a_tis_cap_it_would_not_use():
    """An entropy_coef < 0 was taken (a bonus that drives the policy to collapse), so was a
    tis_cap < 1 (every token's weight shrunk, on-policy ones too) and a tis_cap beside
    another correction (ignored), where decoupled_cap was refused in the same case."""
    from asyncrl.rl.config import RLConfig

    for bad, said in [({"entropy_coef": -0.01}, "entropy_coef must be >= 0, got -0.01; a "
                                                 "negative entropy bonus"),
                      ({"correction": "tis", "tis_cap": 0.5}, "tis_cap must be >= 1"),
                      ({"correction": "tis", "tis_cap": 0.0}, "tis_cap must be >= 1"),
                      ({"tis_cap": 3.0}, "tis_cap is for correction='tis' (got 'none'"),
                      ({"correction": "decoupled", "tis_cap": 3.0},
                       "tis_cap is for correction='tis' (got 'decoupled'")]:
        with pytest.raises(ValueError, match=re.escape(said)):
            RLConfig(group_size=2, **bad)
    assert RLConfig(group_size=2, correction="tis", tis_cap=1.0).tis_cap == 1.0
    assert RLConfig(group_size=2, correction="decoupled", entropy_coef=0.0).tis_cap == 2.0


def test_grpo_refuses_the_kl_in_the_reward_divided_by_the_groups_std():
    """Four samples scoring 1.0, their KL sums 0.010..0.013 folded in at kl_coef 1e-3: over
    the group's tiny std the KL noise alone made advantages of +-0.65."""
    from asyncrl.rl.config import RLConfig

    seq = 1.0 - 1e-3 * torch.tensor([0.010, 0.011, 0.012, 0.013])
    assert grpo_advantages(seq, 4).abs().max() > 0.6  # what the combination trained on
    assert grpo_advantages(seq, 4, std_normalize=False).abs().max() < 1e-5
    with pytest.raises(ValueError) as info:
        RLConfig(algo="grpo", group_size=4, kl_coef=1e-3, kl_in_reward=True)
    for fix in ("kl_in_reward=False", "std_normalize=False"):
        assert fix in str(info.value)
    RLConfig(algo="grpo", group_size=4, kl_coef=1e-3, kl_in_reward=True, std_normalize=False)
    RLConfig(algo="grpo", group_size=4, kl_coef=1e-3)  # the KL as a loss term: fine
    RLConfig(algo="ppo", kl_coef=1e-3, kl_in_reward=True)  # (std_normalize is GRPO's)
    RLConfig(algo="grpo", group_size=4, kl_in_reward=True)  # kl_coef 0: no KL folded in
    with pytest.raises(ValueError, match="k1 with kl_in_reward=True and std_normalize=False"):
        RLConfig(algo="grpo", group_size=4, kl_coef=1e-3, kl_kind="k1")  # its advice: taken,
    RLConfig(algo="grpo", group_size=4, kl_coef=1e-3, kl_kind="k1", kl_in_reward=True,
             std_normalize=False)  # accepted


def test_the_public_functions_refuse_settings_out_of_range():
    """RLConfig checks these, the public functions did not: eps=0 gave an equal-reward group
    NaN advantages, gamma 1.5 returns that grow without bound, a clip < 0 or a dual_clip <= 1
    a loss that pushes the wrong way."""
    equal = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2, eps=0.0)
    assert torch.equal(equal[:2], torch.zeros(2))
    assert torch.allclose(equal[2:], torch.tensor([-0.5, 0.5]) / math.sqrt(0.5))
    with pytest.raises(ValueError, match=r"eps must be >= 0 .* got -1e-06"):
        grpo_advantages(torch.ones(4), 2, eps=-1e-6)
    r, m = torch.ones(1, 3), torch.ones(1, 3)
    for gamma, lam in [(1.5, 0.9), (-0.1, 0.9), (float("nan"), 0.9)]:
        with pytest.raises(ValueError, match=r"gae: gamma must be in \[0, 1\]"):
            gae(r, r, m, gamma, lam)
    with pytest.raises(ValueError, match=r"gae: lam must be in \[0, 1\] \(a discount"):
        gae(r, r, m, 0.9, 2.0)
    logp = torch.zeros(1, 3)
    for clips in [{"clip": -0.2}, {"clip": 0.0}, {"clip": 1.2}, {"clip_high": -0.1}]:
        with pytest.raises(ValueError, match=r"clip must be in \(0, 1\)"):
            ppo_policy_loss(logp, logp, r, m, **clips)
    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match=rf"dual_clip must be > 1 .* got {c}"):
            ppo_policy_loss(logp, logp, r, m, dual_clip=c)
    assert ppo_policy_loss(logp, logp, r, m, clip=0.1, clip_high=0.3, dual_clip=1.5)[0] == -1


def test_entropy_without_its_coefficient_is_a_metric_outside_autograd():
    """With entropy_coef 0 the entropy (still reported) was taken in autograd all the same:
    ~2 [B, T, vocab] fp32 tensors more at peak for nothing; the loss and gradients the
    same either way."""
    from asyncrl.comm.batch import TensorBatch
    from asyncrl.hybrid.models import ModelConfig, build_model, sequence_logprobs
    from asyncrl.rl.actor import entropy_mode, policy_loss
    from asyncrl.rl.config import RLConfig

    model = build_model(ModelConfig(seed=0))
    ids, resp = torch.tensor([[1, 5], [1, 6]]), torch.tensor([[9, 10], [11, 2]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    batch = TensorBatch({"prompt_ids": ids, "response_ids": resp, "loss_mask": mask,
                         "logprobs": torch.zeros(2, 2), "ref_logprobs": torch.zeros(2, 2),
                         "advantages": torch.tensor([[1.0, 1.0], [-1.0, -1.0]])},
                        {"tokens": 3.0, "seqs": 2.0, "rows": 2, "dp": 1})
    results = {}
    for coef in (0.0, 0.1):
        cfg = RLConfig(group_size=2, kl_coef=0.1, entropy_coef=coef)
        for mode in (True, entropy_mode(cfg)):  # the reference: the entropy in autograd
            model.zero_grad()
            logp, ent = sequence_logprobs(model, ids, torch.ones_like(ids), resp,
                                          mask.long(), entropy=mode)
            assert ent.requires_grad == (mode is True)
            loss, stats = policy_loss(cfg)({"logprobs": logp, "entropy": ent}, batch)
            loss.backward()
            results[coef, mode is True] = (loss.item(), stats["entropy"],
                                           [p.grad.clone() for p in model.parameters()])
    assert entropy_mode(RLConfig(group_size=2, entropy_coef=0.1)) is True
    assert entropy_mode(RLConfig(group_size=2)) == "no_grad"
    (loss_a, ent_a, grads_a), (loss_b, ent_b, grads_b) = results[0.0, True], results[0.0, False]
    assert (loss_b, ent_b) == (loss_a, ent_a) and ent_a > 0
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.equal(a, b)
    assert results[0.1, True][0] != loss_a  # (with a coefficient, the bonus is in the loss)
    with pytest.raises(ValueError, match="entropy is False, True or 'no_grad'"):
        sequence_logprobs(model, ids, torch.ones_like(ids), resp, mask.long(), entropy="yes")
    # the training backends' forward takes the mode the actor gives (it passed True)
    from types import SimpleNamespace

    from asyncrl.hybrid.fsdp import TrainBackend
    backend = SimpleNamespace(head="logprobs", forward_module=model, _on_device=lambda b: b)
    batch = TensorBatch({**batch, "prompt_mask": torch.ones_like(ids),
                         "response_mask": mask.long()}, batch.meta)
    for coef in (0.0, 0.1):
        out = TrainBackend._forward(backend, batch, entropy_mode(RLConfig(group_size=2,
                                                                          entropy_coef=coef)))
        assert out["entropy"].requires_grad == (coef > 0) and out["logprobs"].requires_grad


def test_grpo_groups_must_each_answer_one_prompt():
    """PromptSource(repeat=4) read with group_size=8: each group would mix two prompts."""
    from asyncrl.comm.batch import TensorBatch
    from asyncrl.rl.batch import check_groups, mini_batches, prompt_fingerprints
    from asyncrl.rl.config import RLConfig

    def batch(prompts: list[list[int]], width: int) -> TensorBatch:  # left-padded with 0
        return TensorBatch({
            "prompt_ids": torch.tensor([[0] * (width - len(p)) + p for p in prompts]),
            "prompt_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p)
                                         for p in prompts])})

    a, b = [5, 6, 7], [5, 6, 8]
    prints = prompt_fingerprints(batch([a] * 4 + [b] * 4, 4))
    check_groups(prints, 4)  # repeat == group_size
    with pytest.raises(ValueError, match=re.escape("samples 0..7 of the batch (group 0) answer "
                                                   "different prompts")):
        check_groups(prints, 8)
    # the same prompt padded to another width (another rank's batch) is the same prompt
    assert prompt_fingerprints(batch([a], 6)).tolist() == prints[:1].tolist()
    # more mini-batches than rows (a short last batch): one step per row, none on nothing
    def masked(rows: int) -> TensorBatch:
        return batch([a] * rows, 3).union(TensorBatch({"loss_mask": torch.ones(rows, 2)}))
    assert [m.real_rows for m in mini_batches(masked(3), RLConfig(
        group_size=2, mini_batches=4))] == [1, 1, 1]
    parts = mini_batches(masked(5), RLConfig(group_size=2, mini_batches=2))
    assert [m.real_rows for m in parts] == [3, 2] and [len(m) for m in parts] == [3, 3]
    assert parts[1].tensor("loss_mask")[2].sum() == 0  # the padding row trains on nothing


@pytest.mark.parametrize(("rows", "dp", "n"), [(48, 8, 4), (5, 4, 2), (10, 4, 3), (7, 2, 3)])
def test_mini_batches_are_near_equal_over_the_ranks_together(rows, dp, n):
    """Every rank cut its rows alike: the first mini-batches took every rank's extra row and
    the last every DP padding row (48 rows on 8 ranks in 4 steps: 16, 16, 8, 8; 5 on 4 in 2:
    4 and 1), so some steps weighed each sample 2-4x the others'."""
    from unittest import mock

    from asyncrl.comm.batch import TensorBatch
    from asyncrl.rl.batch import mini_batches, valid_rows
    from asyncrl.rl.config import RLConfig

    full = TensorBatch({"x": torch.arange(rows), "loss_mask": torch.ones(rows, 3)})
    chunks = full.chunk(dp, pad=True)
    per_rank = []
    for rank, chunk in enumerate(chunks):  # the DP padding rows train on nothing (assemble)
        chunk = TensorBatch({"x": chunk["x"], "loss_mask": chunk["loss_mask"] * valid_rows(
            chunk)[:, None]}, chunk.meta)
        with mock.patch("torch.distributed.is_initialized", return_value=True), \
                mock.patch("torch.distributed.get_rank", return_value=rank):
            per_rank.append(mini_batches(chunk, RLConfig(group_size=2, mini_batches=n)))
    for i in range(n):  # the ranks' i-th parts: one length (their micro-batch counts agree)
        assert len({len(parts[i]) for parts in per_rank}) == 1
    trained = [sum(int((p[i].tensor("loss_mask").sum(1) > 0).sum()) for p in per_rank)
               for i in range(n)]
    assert max(trained) - min(trained) <= 1 and sum(trained) == rows, trained
    taken = sorted(int(x) for parts in per_rank for p in parts
                   for x, m in zip(p["x"], p.tensor("loss_mask").sum(1), strict=True) if m > 0)
    assert taken == list(range(rows))  # every row trained once


def test_grpo_refuses_a_group_size_other_than_the_sources_repeat():
    """PromptSource(repeat=16) read with group_size=8: every group answered one prompt (so
    check_groups passed), and each prompt had two baselines of half its samples each."""
    from asyncrl.comm.batch import TensorBatch
    from asyncrl.rl import PromptSource
    from asyncrl.rl.batch import SAMPLES_PER_PROMPT, advantages, check_repeat
    from asyncrl.rl.config import RLConfig

    prompts = PromptSource([{"prompt": [5, 6]}, {"prompt": [7]}], batch_size=2,
                           repeat=16).next_batch()
    # as a DP rank's rollout has it: its chunk of the prompts beside generation's columns
    # (with_prompts' union), rows of it (dynamic sampling's kept groups), concatenated
    chunk = prompts.chunk(3, pad=True)[2]
    rollout = TensorBatch({"reward": torch.zeros(len(chunk))}).union(chunk.select(["prompt"]))
    rollout = TensorBatch.concat([rollout.take([0, 1]), rollout.slice(2, 4)])
    assert rollout.meta[SAMPLES_PER_PROMPT] == 16
    with pytest.raises(ValueError, match=re.escape(
            "GRPO: group_size=8, but the PromptSource repeats each prompt 16 times "
            "(repeat=16): a group is all of one prompt's samples; give both")):
        advantages(rollout, RLConfig(group_size=8), None)  # before any collective
    check_repeat(rollout, RLConfig(group_size=16))
    check_repeat(TensorBatch({"x": [1]}, {SAMPLES_PER_PROMPT: 1}), RLConfig(group_size=8))


def test_grpo_refuses_a_group_whose_samples_share_a_seed():
    """PromptSource(repeat=1), its batch copied with batch.repeat(4): the copies kept one
    seed, sampled the same response, and every advantage was 0 (nothing trained, no word)."""
    from asyncrl.comm.batch import TensorBatch
    from asyncrl.rl import PromptSource
    from asyncrl.rl.batch import check_groups, sampling_seeds

    def seeds_of(prompts: TensorBatch) -> torch.Tensor:
        keys = sampling_seeds(prompts)
        assert keys[:, 1].tolist() == [1] * len(prompts)  # every row has its seed
        return keys[:, 0]

    records = [{"prompt": [5, 6]}, {"prompt": [7]}]
    prints = torch.tensor([1] * 4 + [2] * 4)  # each group one prompt: only the seeds differ
    copied = PromptSource(records, batch_size=2, shuffle=False).next_batch().repeat(4)
    with pytest.raises(ValueError, match=re.escape(
            "samples 0..3 of the batch (group 0): samples of one group share a sampling "
            "seed: they are identical")):
        check_groups(prints, 4, seeds_of(copied))
    grouped = PromptSource(records, batch_size=2, repeat=4, shuffle=False).next_batch()
    check_groups(prints, 4, seeds_of(grouped))  # a seed per sample
    check_groups(prints, 4)  # no seeds (a rollout without the column): prompts only
    # seeds past int64 are taken modulo 2**64, as the sampler takes them
    wide = sampling_seeds(TensorBatch({"seed": [2**64 + 3, 3, 2**63]}))
    assert wide[:, 0].tolist() == [3, 3, -2**63]
    assert sampling_seeds(TensorBatch({"x": [1, 2]})).tolist() == [[0, 0], [0, 0]]


def test_clip_higher_and_dual_clip_by_hand():
    logp = torch.log(torch.tensor([[1.25, 5.0, 0.5]]))
    old, mask = torch.zeros(1, 3), torch.ones(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    # clip 0.2, clip_high 0.3: ratio 1.25 stays (not 1.2), 0.5 -> 0.8; A=-1, ratio 5:
    # max(5, 1.3) = 5 without dual clip, min(5, 3) = 3 with c=3
    loss, _ = ppo_policy_loss(logp, old, adv, mask, clip_high=0.3)
    assert loss.item() == pytest.approx((-1.25 + 5.0 - 0.5) / 3)
    loss, _ = ppo_policy_loss(logp, old, adv, mask, clip_high=0.3, dual_clip=3.0)
    assert loss.item() == pytest.approx((-1.25 + 3.0 - 0.5) / 3)
    symmetric, _ = ppo_policy_loss(logp, old, adv, mask)
    assert symmetric.item() == pytest.approx((-1.2 + 5.0 - 0.5) / 3)
    # on by default, as verl's clip_ratio_c=3.0 (a stale token's ratio of 5 pushed 5x)
    from asyncrl.rl.config import RLConfig

    cfg = RLConfig(algo="grpo", group_size=2)
    by_default, _ = ppo_policy_loss(logp, old, adv, mask, cfg.clip, cfg.agg, cfg.clip_high,
                                    cfg.dual_clip)
    assert by_default.item() == pytest.approx((-1.2 + 3.0 - 0.5) / 3)


def test_kl_penalty_by_hand():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    assert torch.allclose(kl_penalty(logp, ref, "k2"), torch.tensor([[0.125, 0.5]]))
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert torch.allclose(kl_penalty(logp, ref), torch.tensor([k3]), atol=1e-6)
    with pytest.raises(ValueError, match="kind is"):
        kl_penalty(logp, ref, "k4")
    # unclamped, as issue 6 names it (it was clamped to [-10, 10]: 10 here)
    assert kl_penalty(torch.tensor([[-3.0]]), torch.tensor([[0.0]])).item() == \
        pytest.approx(math.exp(3) - 4)
    far = kl_penalty(torch.tensor([[-31.0, -1.0]]), torch.tensor([[-1.0, -31.0]]), clamp=10)
    assert far.tolist() == [[10.0, 10.0]]  # e^30 - 31 and 29, clamped as verl does
    assert kl_penalty(torch.tensor([[-3.0]]), torch.tensor([[0.0]]), clamp=30).item() == \
        pytest.approx(math.exp(3) - 4)  # within the bound: as it is
    with pytest.raises(ValueError, match="clamp is a bound > 0"):
        kl_penalty(logp, ref, clamp=0)
    # a token ~89 nats below the reference: e^89 is inf in fp32, and its gradient through
    # the clamp was NaN, which made the whole step's gradient NaN (the step skipped)
    logp = torch.tensor([[-0.1, -95.0, -0.2]], requires_grad=True)
    kl = kl_penalty(logp, torch.tensor([[-0.2, -0.5, -0.1]]), clamp=10.0)
    kl.sum().backward()
    assert kl[0, 1].item() == 10.0 and torch.isfinite(logp.grad).all(), logp.grad
    assert logp.grad[0, 1].item() == 0.0


def test_whiten_uses_masked_positions_only_and_the_unbiased_variance(monkeypatch):
    """As verl's masked_whiten (masked_var with Bessel's correction): the biased variance
    gave advantages 13 % larger at 4 tokens."""
    import asyncrl.rl.batch as rl_batch
    from asyncrl.rl.batch import whiten_across

    x = torch.tensor([[1.0, 3.0, 100.0]])
    m = torch.tensor([[1, 1, 0]])
    half = 2 ** -0.5  # mean 2, variance (1 + 1) / (2 - 1)
    assert torch.allclose(whiten(x, m), torch.tensor([[-half, half, 0.0]]), atol=1e-4)
    four, ones = torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.ones(1, 4)
    # mean 2.5, variance (2.25 + 0.25 + 0.25 + 2.25) / (4 - 1) = 5 / 3 (the biased one: 5 / 4)
    assert whiten(four, ones)[0, 0].item() == pytest.approx((1 - 2.5) / math.sqrt(5 / 3),
                                                            abs=1e-5)
    assert torch.allclose(whiten(four, ones), (four - 2.5) / math.sqrt(5 / 3), atol=1e-5)
    # the trainer's, over every data-parallel rank (here one: its sums are its own)
    monkeypatch.setattr(rl_batch, "global_sums", lambda values, group: values)
    assert torch.allclose(whiten_across(four, ones, None), whiten(four, ones), atol=1e-6)


def test_pass_at_k_by_hand():
    # three prompts of 4 samples: 1, 0 and 3 correct
    correct = torch.tensor([0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1])
    assert pass_at_k(correct, n=4, k=1) == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)  # the mean
    # k=2: 1 - C(3,2)/C(4,2) = 1/2; 0; 1 - C(1,2)/C(4,2) = 1
    assert pass_at_k(correct, n=4, k=2) == pytest.approx((0.5 + 0 + 1) / 3)
    assert pass_at_k(correct, n=4, k=4) == pytest.approx(2 / 3)  # prompts with one right
    for bad in ({"n": 5, "k": 1}, {"n": 4, "k": 5}, {"n": 4, "k": 0}):
        with pytest.raises(ValueError, match="pass_at_k: 12 samples in groups of"):
            pass_at_k(correct, **bad)
    # raw rewards (-1 when wrong) counted as correct wherever they were not 0
    with pytest.raises(ValueError, match=r"bools or 0/1\), got values \[-1.0, 1.0\]"):
        pass_at_k(correct.float() * 2 - 1, n=4, k=1)
    assert pass_at_k(correct.bool(), n=4, k=4) == pytest.approx(2 / 3)


def test_an_actor_refuses_values_from_a_critic_that_computes_returns_differently():
    from asyncrl import TensorBatch
    from asyncrl.rl.batch import CRITIC_RL, check_critic_agrees
    from asyncrl.rl.config import RLConfig

    actor = RLConfig(algo="ppo", gamma=1.0, lam=0.95)
    values = torch.zeros(2, 3)

    def critic_values(**rl) -> TensorBatch:  # what Critic.values returns
        return TensorBatch({"values": values}, {CRITIC_RL: RLConfig(**rl).returns_fields()})

    check_critic_agrees(critic_values(algo="ppo", gamma=1.0, lam=0.95, clip=0.3), actor)
    check_critic_agrees(TensorBatch({"values": values}), actor)  # not a Critic's: not checked
    check_critic_agrees(None, actor)
    with pytest.raises(ValueError, match=r"gamma: actor 1.0, critic 0.99; lam: actor 0.95, "
                                         r"critic 0.9\).*same rl= to the Actor and the Critic"):
        check_critic_agrees(critic_values(algo="ppo", gamma=0.99, lam=0.9), actor)
    with pytest.raises(ValueError, match="kl_in_reward: actor False, critic True"):
        check_critic_agrees(critic_values(algo="ppo", kl_in_reward=True, kl_coef=0.1),
                            RLConfig(algo="ppo", kl_coef=0.1))
    # the rows trained on: a critic with another staleness bound fits rows the actor drops
    with pytest.raises(ValueError, match="max_staleness: actor 1, critic 3"):
        check_critic_agrees(critic_values(algo="ppo", max_staleness=3),
                            RLConfig(algo="ppo", max_staleness=1),
                            TensorBatch({"versions": torch.zeros(2, 3)}))
    # rows without policy versions: none is dropped by staleness, either bound agrees
    check_critic_agrees(critic_values(algo="ppo", max_staleness=3),
                        RLConfig(algo="ppo", max_staleness=1), TensorBatch({"x": values}))
    # the KL as a loss term leaves the returns alone: a critic without it agrees (it was
    # refused); in the reward, its coefficient counts
    check_critic_agrees(critic_values(algo="ppo"), RLConfig(algo="ppo", kl_coef=0.01))
    with pytest.raises(ValueError, match="kl_coef: actor 0.01, critic 0.02"):
        check_critic_agrees(critic_values(algo="ppo", kl_in_reward=True, kl_coef=0.02),
                            RLConfig(algo="ppo", kl_in_reward=True, kl_coef=0.01))


@pytest.fixture
def one_rank():
    """A process group of this process alone (the collectives of advantages() run)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_non_finite_reward_is_refused_naming_its_row(one_rank, algo):
    """A reward from elsewhere than RewardFn or RewardModel (a user's scorer): GRPO gave a NaN's
    group advantages 0 silently (std > 0 is false for NaN); PPO whitened every advantage to
    NaN, and every step was skipped as grad_nonfinite."""
    from asyncrl.comm.batch import PAD_KEY, TensorBatch
    from asyncrl.rl.batch import advantages
    from asyncrl.rl.config import RLConfig

    def batch(rewards):
        n = len(rewards)
        return TensorBatch({
            "prompt_ids": torch.tensor([[5, 6]] * n), "prompt_mask": torch.ones(n, 2),
            "response_ids": torch.ones(n, 3, dtype=torch.long),
            "response_mask": torch.ones(n, 3), "loss_mask": torch.ones(n, 3),
            "values": torch.zeros(n, 3), "reward": torch.tensor(rewards)})

    cfg = RLConfig(algo=algo, group_size=2)
    adv, _ = advantages(batch([1.0, 0.0, 0.5, 0.5]), cfg, None)
    assert adv.isfinite().all()
    which = "sample 2 of the batch has the reward nan" if algo == "grpo" else \
        "the first is row 2 of data-parallel rank 0's rows (its reward nan)"
    with pytest.raises(ValueError, match=re.escape(which)):
        advantages(batch([1.0, 0.0, math.nan, 0.5]), cfg, None)
    with pytest.raises(ValueError, match="a reward must be a finite number"):
        advantages(batch([1.0, 0.0, 0.5, math.inf]), cfg, None)
    padded = batch([1.0, 0.0, 0.5, 0.5, 0.5])  # a DP padding row: its real row's reward
    padded.meta[PAD_KEY] = 1
    assert advantages(padded, cfg, None)[0].isfinite().all()


@pytest.mark.parametrize("rows,width", [(4, 4), (8, 5)])
def test_ppo_policy_loss_spreads_a_row_advantage_over_its_tokens(rows, width):
    """grpo_advantages gives [B], ppo_policy_loss took it per token: broadcast along the
    tokens, each column got one row's advantage where B == T (a wrong gradient, no error),
    and a bare size mismatch elsewhere."""
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0] * (rows // 4)), 4)
    logp0, mask = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)), \
        torch.ones(rows, width)
    grads = []
    for a in (adv, adv[:, None].expand(rows, width)):
        logp = logp0.clone().requires_grad_()
        ppo_policy_loss(logp, logp.detach(), a, mask)[0].backward()
        grads.append(logp.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0][0].lt(0).all()  # row 0: pushed up
    logp = logp0
    for bad, said in [({"advantages": torch.ones(width + 1)}, f"advantages has the shape "
                       f"({width + 1},) and logp ({rows}, {width}); give each per token"),
                      ({"mask": torch.ones(rows)}, f"mask has the shape ({rows},)"),
                      ({"old_logp": logp[:, :1]}, f"old_logp has the shape ({rows}, 1)")]:
        args = {"old_logp": logp, "advantages": adv, "mask": mask, **bad}
        with pytest.raises(ValueError, match=re.escape(said)):
            ppo_policy_loss(logp, **args)
    # the other per-token functions: a [B] tensor beside [B, T] is refused alike
    with pytest.raises(ValueError, match=re.escape(f"kl_penalty: ref_logp has the shape "
                                                   f"({rows},) and logp ({rows}, {width})")):
        kl_penalty(logp, logp[:, 0])
    with pytest.raises(ValueError, match=re.escape(f"whiten: mask has the shape ({rows}, "
                                                   f"{width}) and values ({rows},)")):
        whiten(adv, mask)


@pytest.mark.parametrize("std_normalize", [True, False])
def test_grpo_advantages_refuses_a_non_finite_reward(std_normalize):
    """A NaN reward gave its group advantages 0 silently with std_normalize (std > 0 is
    false for NaN), NaN and inf without; the trainer refused them, the function did not."""
    for value, said in [(math.nan, "sample 2 has the reward nan, 1 sample(s)"),
                        (math.inf, "sample 2 has the reward inf, 1 sample(s)"),
                        (-math.inf, "sample 2 has the reward -inf, 1 sample(s)")]:
        for group in (4, 1):
            with pytest.raises(ValueError, match=re.escape(
                    f"grpo_advantages: {said} in all are not finite; a reward must be a "
                    f"finite number: fix the scorer")):
                grpo_advantages(torch.tensor([1.0, 0.0, value, 0.5]), group,
                                std_normalize=std_normalize)
