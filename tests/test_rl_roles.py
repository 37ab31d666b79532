"""The RL roles' pieces in one process: value models, reward models, the training batch,
token rewards, the policy and value losses (against hand-computed values), group seeds."""

from __future__ import annotations

import os

import pytest
import torch

import asyncrl
from asyncrl import TensorBatch
from asyncrl.comm.batch import PAD_KEY
from asyncrl.hybrid.models import (
    ModelConfig,
    build_model,
    build_value_model,
    sequence_logprobs,
    sequence_values,
)
from asyncrl.hybrid.sampler import left_pad
from asyncrl.rl import PromptSource, RewardModel
from asyncrl.rl.actor import policy_loss
from asyncrl.rl.batch import assemble, share, token_rewards, valid_rows
from asyncrl.rl.config import RLConfig
from asyncrl.rl.critic import value_loss


def padded_pair() -> TensorBatch:
    """Two rows: prompts of 3 and 1 tokens (left-padded), responses of 2 and 3 tokens."""
    prompt_ids, prompt_mask = left_pad([[5, 6, 7], [9]], pad=0)
    return TensorBatch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                        "response_ids": torch.tensor([[11, 12, 0], [13, 14, 15]]),
                        "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])})


def test_value_model_values_ignore_padding():
    model = build_value_model(ModelConfig(seed=4))
    torch.nn.init.normal_(model.value_head.weight)  # zero at init: make values differ
    b = padded_pair()
    values = sequence_values(model, b["prompt_ids"], b["prompt_mask"], b["response_ids"],
                             b["response_mask"])
    assert values.shape == (2, 3) and values[0, 2] == 0
    alone = [[5, 6, 7, 11, 12], [9, 13, 14, 15]]  # each row by itself: no padding at all
    for row, (ids, n_prompt) in enumerate(zip(alone, (3, 1), strict=True)):
        ids_t = torch.tensor([ids])
        v = model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                  position_ids=torch.arange(len(ids))[None])
        n = len(ids) - n_prompt
        torch.testing.assert_close(values[row, :n], v[0, n_prompt - 1:-1], atol=1e-5, rtol=0)


def test_value_model_starts_at_zero_and_shares_the_lm_backbone():
    lm, vm = build_model(ModelConfig(seed=2)), build_value_model(ModelConfig(seed=2))
    lm_layer = dict(lm.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    torch.testing.assert_close(dict(vm.named_parameters())["model.layers.0.mlp.up_proj.weight"],
                               lm_layer)
    b = padded_pair()
    assert sequence_values(vm, *(b[k] for k in ("prompt_ids", "prompt_mask", "response_ids",
                                                "response_mask"))).abs().max() == 0


def test_reward_model_scores_the_last_real_token():
    rm = RewardModel.__new__(RewardModel)
    rm.__init__({"seed": 5})
    assert rm.model.value_head.weight.abs().sum() > 0  # a preset's head: drawn, not zeros
    b = padded_pair()
    scores = rm.score(b)["reward"]
    for row, ids in enumerate([[5, 6, 7, 11, 12], [9, 13, 14, 15]]):
        ids_t = torch.tensor([ids])
        v = rm.model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                     position_ids=torch.arange(len(ids))[None])
        assert scores[row].item() == pytest.approx(v[0, -1].item(), abs=1e-5)


def test_reward_model_scores_in_micro_batches():
    """A rank's whole chunk went through the model in one forward (2048 rows of 1.5k tokens
    of a 7B model: out of memory), its DP padding rows scored too."""
    from asyncrl.hybrid.roles import scoring_sizes

    rm = RewardModel.__new__(RewardModel)
    rm.__init__({"seed": 5}, micro_batch_size=2)
    seen = []

    class Counted(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, **kw):
            seen.append(len(input_ids))
            return self.inner(input_ids=input_ids, **kw)

    prompt_ids, prompt_mask = left_pad([[5, 6, 7], [9], [4, 4], [8], [3, 2, 1]], pad=0)
    b = TensorBatch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                     "response_ids": torch.tensor([[11, 12, 0]] * 3 + [[13, 14, 15]] * 2),
                     "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1],
                                                    [1, 1, 0], [1, 1, 1]])})
    whole = rm._scores(b)
    rm.model = Counted(rm.model)
    seen.clear()
    torch.testing.assert_close(rm.score(b)["reward"], whole)
    assert seen == [2, 2, 1]
    seen.clear()
    padded = TensorBatch.concat([b, b.slice(4, 5), b.slice(4, 5)])
    padded.meta[PAD_KEY] = 2  # (two copies of the last row: scored as it, not run)
    torch.testing.assert_close(padded_scores := rm.score(padded)["reward"],
                               torch.cat([whole, whole[-1:], whole[-1:]]))
    assert sum(seen) == 5 and len(padded_scores) == 7
    seen.clear()
    rm.sizes = scoring_sizes("RewardModel", 4, 8)  # by a token budget: rows sorted, put back
    torch.testing.assert_close(rm.score(b)["reward"], whole)
    assert sum(seen) == 5 and len(seen) > 1, seen
    with pytest.raises(ValueError, match="RewardModel micro_batch_size must be >= 1"):
        RewardModel.check_settings({"seed": 5}, micro_batch_size=0)


@pytest.mark.parametrize("safe", [True, False])
def test_a_reward_model_checkpoint_keeps_its_head(tmp_path, safe):
    """A transformers *ForSequenceClassification checkpoint (safetensors or .bin) scores as
    transformers does; a causal LM's checkpoint has no head: a reward model refuses it, a
    critic starts from zeros; TRL's value head is read too, a 2-label head is refused."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForSequenceClassification

    from asyncrl.hybrid.models import tiny_llama

    config = tiny_llama()
    config.num_labels = 1
    torch.manual_seed(3)
    hf = LlamaForSequenceClassification(config).eval()
    torch.nn.init.normal_(hf.score.weight)
    hf.save_pretrained(tmp_path / "rm", safe_serialization=safe)
    rm = RewardModel.__new__(RewardModel)
    rm.__init__({"path": str(tmp_path / "rm")})  # path= alone, as the README writes it
    scores = rm.score(padded_pair())["reward"]
    for row, ids in enumerate([[5, 6, 7, 11, 12], [9, 13, 14, 15]]):
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([ids])).logits[0, 0]
        assert scores[row].item() == pytest.approx(want.item(), abs=1e-5)
    # OpenRLHF's --normalize_reward: it scores (r - mean) / std, the two in config.json
    # (read without them, the reward was on another scale against the KL and the clip)
    config.normalize_reward, config.mean, config.std = True, 2.0, 4.0
    hf.config = config
    hf.save_pretrained(tmp_path / "normalized", safe_serialization=safe)
    normalized = RewardModel.__new__(RewardModel)
    normalized.__init__({"path": str(tmp_path / "normalized")})
    torch.testing.assert_close(normalized.score(padded_pair())["reward"], (scores - 2) / 4)
    del config.normalize_reward, config.mean, config.std

    build_model(ModelConfig(seed=3)).save_pretrained(tmp_path / "lm", safe_serialization=safe)
    with pytest.raises(ValueError, match="has no scalar head .*num_labels=1"):
        RewardModel.__new__(RewardModel).__init__({"path": str(tmp_path / "lm")})
    critic = build_value_model(ModelConfig(path=str(tmp_path / "lm")))
    assert critic.value_head.weight.abs().sum() == 0
    if safe:
        state = load_file(tmp_path / "lm" / "model.safetensors")
        trl = torch.randn(1, config.hidden_size)
        save_file({**state, "v_head.summary.weight": trl}, tmp_path / "lm" / "model.safetensors",
                  metadata={"format": "pt"})
        critic = build_value_model(ModelConfig(path=str(tmp_path / "lm")))
        torch.testing.assert_close(critic.value_head.weight.detach(), trl)
        config.num_labels = 2
        LlamaForSequenceClassification(config).save_pretrained(tmp_path / "two")
        with pytest.raises(ValueError, match="head 'score' has shape \\(2, 64\\)"):
            build_value_model(ModelConfig(path=str(tmp_path / "two")))


def test_entropy_is_the_entropy_of_the_next_token_distribution():
    model = build_model(ModelConfig(seed=1))
    b = padded_pair()
    cols = [b[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    logp, ent = sequence_logprobs(model, *cols, entropy=True)
    torch.testing.assert_close(logp, sequence_logprobs(model, *cols))
    ids = torch.tensor([[9, 13, 14, 15]])  # row 1 alone
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1]
    p = logits.float().softmax(-1)
    torch.testing.assert_close(ent[1], -(p * p.log()).sum(-1), atol=1e-5, rtol=0)
    assert ent[0, 2] == 0


def scored(rewards: list[float], pad: int = 0) -> tuple[TensorBatch, TensorBatch]:
    b = padded_pair()
    rollout = b.union(TensorBatch({"logprobs": torch.tensor([[-1.0, -2.0, 0], [-1, -1, -1]])}))
    rollout.meta[PAD_KEY] = pad
    return rollout, TensorBatch({"reward": torch.tensor(rewards)})


def test_padding_rows_are_masked_out_of_the_training_batch():
    rollout, scores = scored([1.0, 0.5], pad=1)
    batch = assemble(rollout, scores)
    assert valid_rows(batch).tolist() == [1.0, 0.0]
    assert batch["loss_mask"].tolist() == [[1, 1, 0], [0, 0, 0]]
    with pytest.raises(KeyError, match="needs a 'reward' column"):
        assemble(rollout, TensorBatch({"score": torch.zeros(2)}))


@pytest.mark.parametrize("scores", [[1.0, 0.5], {"reward": [1.0, 0.5]}])
def test_scores_that_are_not_a_tensor_batch_are_refused(scores):
    """A RANK_ZERO scorer's list, or a dict: an AttributeError from inside assemble."""
    rollout, _ = scored([1.0, 0.5])
    with pytest.raises(TypeError, match=rf"the scores are a {type(scores).__name__}, not a "
                                        r"TensorBatch: a scorer returns TensorBatch\("):
        assemble(rollout, scores)


def test_token_rewards_put_the_score_last_and_subtract_the_kl():
    rollout, scores = scored([1.0, 0.5])
    ref = TensorBatch({"logprobs": torch.tensor([[-1.5, -2.0, 0], [-1.0, -0.5, -1.0]])})
    batch = assemble(rollout, scores, ref)
    plain = token_rewards(batch, RLConfig(algo="ppo"))
    assert plain.tolist() == [[0, 1.0, 0], [0, 0, 0.5]]
    with_kl = token_rewards(batch, RLConfig(algo="ppo", kl_coef=0.1, kl_in_reward=True,
                                            kl_kind="k1"))
    # k1 = logp - ref: row 0: 0.5, 0; row 1: 0, -0.5, 0
    torch.testing.assert_close(with_kl, torch.tensor([[-0.05, 1.0, 0], [0, 0.05, 0.5]]))
    batch.tensor("loss_mask")[0] = 0  # row 0 dropped as too stale: its rewards stay
    torch.testing.assert_close(token_rewards(batch, RLConfig(
        algo="ppo", kl_coef=0.1, kl_in_reward=True, kl_kind="k1")), with_kl)


def test_policy_loss_by_hand():
    cfg = RLConfig(algo="grpo", group_size=2, clip=0.2, kl_coef=0.5, kl_kind="k2",
                   entropy_coef=0.1)
    micro = TensorBatch({"logprobs": torch.tensor([[0.0, 0.0]]),
                         "advantages": torch.tensor([[1.0, -2.0]]),
                         "ref_logprobs": torch.tensor([[0.0, 0.5]]),
                         "loss_mask": torch.tensor([[1.0, 1.0]])})
    micro.meta.update(tokens=2, seqs=1, rows=1, dp=1)  # this micro-batch is all there is
    logp = torch.tensor([[0.5, 0.0]])  # ratio e^0.5 = 1.65 on token 0 (clipped to 1.2), 1
    out = {"logprobs": logp, "entropy": torch.tensor([[2.0, 4.0]])}
    loss, stats = policy_loss(cfg)(out, micro)
    pg = (-1.0 * 1.2 + 2.0 * 1.0) / 2  # token 0 clipped (A > 0, ratio > 1.2), token 1 as is
    kl = (0.5 ** 2 / 2 + 0.5 ** 2 / 2) / 2  # k2 of 0.5 and -0.5
    assert stats["pg_loss"] == pytest.approx(pg) and stats["clipfrac"] == pytest.approx(0.5)
    assert stats["kl"] == pytest.approx(kl) and stats["entropy"] == pytest.approx(3.0)
    assert loss.item() == pytest.approx(pg + 0.5 * kl - 0.1 * 3.0)


def test_seq_mean_policy_loss_leaves_empty_rows_out():
    """seq-mean-token-mean over a micro-batch with a padding (or dropped) row: the same loss
    as the real row alone."""
    cfg = RLConfig(algo="grpo", group_size=2, agg="seq-mean-token-mean")
    micro = TensorBatch({"logprobs": torch.zeros(2, 2), "advantages": torch.ones(2, 2),
                         "loss_mask": torch.tensor([[1.0, 1.0], [0.0, 0.0]])})
    micro.meta.update(tokens=2, seqs=1, rows=2, dp=1)
    loss, _ = policy_loss(cfg)({"logprobs": torch.zeros(2, 2),
                                "entropy": torch.zeros(2, 2)}, micro)
    assert loss.item() == pytest.approx(-1.0)


def test_seq_mean_aggregates_the_kl_and_entropy_terms_too():
    """verl's loss_agg_mode applies to the KL and entropy terms as to the policy term: with
    seq-mean-token-mean a short row weighs as much as a long one."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    micro = TensorBatch({"logprobs": torch.zeros(2, 3), "advantages": torch.zeros(2, 3),
                         "ref_logprobs": torch.tensor([[-1.0, -1.0, -1.0], [-4.0, 0.0, 0.0]]),
                         "loss_mask": mask})
    micro.meta.update(tokens=4, seqs=2, rows=2, dp=1)
    out = {"logprobs": torch.zeros(2, 3), "entropy": torch.tensor([[1.0, 1.0, 1.0],
                                                                   [5.0, 9.0, 9.0]])}
    stats = {}
    for agg in ("token-mean", "seq-mean-token-mean"):
        cfg = RLConfig(algo="grpo", group_size=2, kl_coef=1.0, kl_kind="k2", agg=agg)
        stats[agg] = policy_loss(cfg)(out, micro)[1]
    # k2 = (logp - ref)^2 / 2: 0.5 on row 0's tokens, 8 on row 1's one
    assert stats["token-mean"]["kl"] == pytest.approx((0.5 * 3 + 8) / 4)
    assert stats["seq-mean-token-mean"]["kl"] == pytest.approx((0.5 + 8) / 2)
    assert stats["token-mean"]["entropy"] == pytest.approx((3 + 5) / 4)
    assert stats["seq-mean-token-mean"]["entropy"] == pytest.approx((1 + 5) / 2)


def test_value_loss_by_hand():
    micro = TensorBatch({"values": torch.tensor([[0.0, 1.0]]),
                         "returns": torch.tensor([[1.0, 1.0]]),
                         "loss_mask": torch.tensor([[1.0, 1.0]])})
    micro.meta.update(tokens=2, seqs=1, rows=1, dp=1)
    v = torch.tensor([[0.5, 2.0]])  # token 0 moves 0.5 (clipped to 0.2), token 1 moves 1.0
    loss, stats = value_loss(RLConfig(algo="ppo", value_clip=0.2))({"values": v}, micro)
    # token 0: max((0.5-1)^2, (0.2-1)^2) = 0.64; token 1: max((2-1)^2, (1.2-1)^2) = 1
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.0) / 2)
    assert stats["vf_clipfrac"] == pytest.approx(0.5)


def test_micro_batch_shares_make_local_means_global():
    # two ranks: this one holds 3 of the mini-batch's 8 tokens in a micro-batch of 2 of its
    # 4 rows; backend weight 2/4, rank average 1/2 -> (3/8) of the global mean is this part
    micro = TensorBatch({"loss_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]])})
    micro.meta.update(tokens=8, seqs=5, rows=4, dp=2)
    assert share(micro, "tokens") * (2 / 4) / 2 == pytest.approx(3 / 8)
    assert share(micro, "seqs") * (2 / 4) / 2 == pytest.approx(2 / 5)


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="GRPO needs group_size >= 2"):
        RLConfig(algo="grpo")
    with pytest.raises(ValueError, match="algo is 'grpo' or 'ppo'"):
        RLConfig(algo="dpo")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        RLConfig(algo="ppo", dual_clip=0.5)
    with pytest.raises(ValueError, match="kl_kind='k1' as a loss term .* use kl_kind='k2'"):
        RLConfig(algo="ppo", kl_coef=0.1, kl_kind="k1")
    RLConfig(algo="ppo", kl_coef=0.1, kl_kind="k1", kl_in_reward=True)  # in the reward: fine


def test_the_sft_loss_leaves_padding_rows_out():
    """A DP chunk padded with a repeat of its last row: the loss is the real rows' alone."""
    from asyncrl.hybrid.fsdp import sequence_mean_nll

    logp = torch.tensor([[-1.0, -3.0], [-2.0, 0.0], [-2.0, 0.0]])
    batch = TensorBatch({"response_mask": torch.tensor([[1, 1], [1, 0], [1, 0]])},
                        {PAD_KEY: 1})
    assert sequence_mean_nll(logp, batch).item() == pytest.approx((2.0 + 2.0) / 2)


def test_group_sampling_repeats_prompts_with_a_seed_per_sample():
    records = [{"prompt": [1, i], "answer": i} for i in range(6)]
    src = PromptSource(records, batch_size=2, seed=3, repeat=3, epochs=2)
    batches = list(src)
    assert len(batches) == 6 and all(len(b) == 6 for b in batches)
    first = batches[0]
    assert first["answer"][:3] == [first["answer"][0]] * 3  # a group's rows are contiguous
    seeds = [s for b in batches for s in b["seed"]]
    assert len(set(seeds)) == len(seeds)  # every sample of the run samples differently
    again = PromptSource(records, batch_size=2, seed=3, repeat=3, epochs=2)
    it = iter(again)
    next(it)
    state = again.state_dict()
    resumed = PromptSource(records, batch_size=2, seed=3, repeat=3, epochs=2)
    resumed.load_state_dict(state)
    assert [b["seed"] for b in resumed] == [b["seed"] for b in batches[1:]]
    with pytest.raises(ValueError, match="'seed' key"):
        PromptSource([{"prompt": [1], "seed": 1}], batch_size=1)


def test_a_roles_settings_are_checked_where_its_group_is_declared():
    """Mistakes in model=, train=, rl=, sampling= or multi_turn= failed every rank's __init__
    after 8-11 s of starting groups (a RemoteError from rank 0); now asyncrl.group raises."""
    from asyncrl.hybrid.roles import Policy, Rollout
    from asyncrl.rl.actor import Actor
    from asyncrl.rl.critic import Critic

    model = {"preset": "tiny-llama"}
    with pytest.raises(ValueError, match=r"RLConfig.lam must be in \[0, 1\]"):
        asyncrl.group(Actor, model, rl={"algo": "ppo", "lam": 1.5})
    with pytest.raises(TypeError, match=r"Actor train=: 'micro_batchsize' \(did you mean "
                                        r"'micro_batch_size'\?\)"):
        asyncrl.group(Actor, model, rl={"algo": "ppo"}, train={"micro_batchsize": 2})
    with pytest.raises(ValueError, match="TrainConfig.lr must be >= 0"):
        asyncrl.group(Critic, model, train={"lr": -1.0})
    with pytest.raises(ValueError, match="GRPO needs no critic"):
        asyncrl.group(Critic, model, rl={"algo": "grpo", "group_size": 4})
    with pytest.raises(TypeError, match=r"Rollout model=: 'presets' \(did you mean 'preset'"):
        asyncrl.group(Rollout, {"presets": "tiny-llama"})
    with pytest.raises(TypeError, match=r"multi_turn=: 'turns'"):
        asyncrl.group(Policy, model, multi_turn={"env": len, "turns": 2})
    with pytest.raises(TypeError, match="missing a required argument: 'model'"):
        asyncrl.group(Policy)
    # backend=, engine= and engine_options= too, and Reference's and RewardModel's settings
    # (these had been read only by each rank's __init__)
    from asyncrl.rl import Reference, RewardModel

    with pytest.raises(ValueError, match=r"backend is one of \('fsdp2', 'zero2', 'zero3'\), "
                                         r"got 'zero4'"):
        asyncrl.group(Actor, model, rl={"algo": "ppo"}, backend="zero4")
    with pytest.raises(ValueError, match="backend is one of"):
        asyncrl.group(Critic, model, rl={"algo": "ppo"}, backend="fsdp")
    with pytest.raises(ValueError, match=r"engine is one of \('builtin', 'vllm'\), got 'vLLM'"):
        asyncrl.group(Policy, model, engine="vLLM")
    with pytest.raises(ValueError, match=r"engine_options \['gpu_memory_utilization'\] are "
                                         r"for engine='vllm'"):
        asyncrl.group(Rollout, model, engine_options={"gpu_memory_utilization": 0.5})
    asyncrl.group(Policy, model, hybrid=False, engine="unused")  # (a train-only Policy)
    # vLLM's settings this adapter refuses, without vLLM (they failed in each rank's vLLM)
    with pytest.raises(ValueError, match="engine='vllm' loads a local checkpoint"):
        asyncrl.group(Actor, model, rl={"algo": "ppo"}, engine="vllm")
    checkpoint = {"path": os.path.dirname(__file__)}  # (a directory: not read here)
    with pytest.raises(ValueError, match="top_p=0.9 < 1 is not supported"):
        asyncrl.group(Rollout, checkpoint, engine="vllm", sampling={"top_p": 0.9})
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported"):
        asyncrl.group(Policy, checkpoint, engine="vllm", engine_options={"kv_cache_dtype": "fp8"})
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\): only 1"):
        asyncrl.group(Rollout, checkpoint, engine="vllm",
                      engine_options={"tensor_parallel_size": 2})
    asyncrl.group(Rollout, checkpoint, engine="vllm", engine_options={"max_model_len": 64})
    with pytest.raises(ValueError, match=r"a Rollout group with engine='vllm' and a LoRA "
                                         r"model is not supported yet"):  # (each rank's)
        Rollout.check_settings(model={**checkpoint, "lora": {"rank": 4}}, engine="vllm")
    with pytest.raises(TypeError, match=r"Reference model=: 'presets'"):
        asyncrl.group(Reference, {"presets": "tiny-llama"})
    with pytest.raises(ValueError, match="^Reference micro_batch_size must be >= 1, got 0"):
        asyncrl.group(Reference, model, micro_batch_size=0)  # (not TrainConfig's: not given)
    with pytest.raises(TypeError, match=r"RewardModel model=: 'seeds'"):
        asyncrl.group(RewardModel, {**model, "seeds": 1})
    asyncrl.group(Actor, model, rl={"algo": "ppo"}, train={"lr": 1e-3})  # fine ones pass
    asyncrl.group(Reference, model, micro_batch_size=None)
    # ZeRO shards over data-parallel ranks only: a tp axis was ignored (each tp rank repeated
    # the others' work)
    from types import SimpleNamespace

    from asyncrl.hybrid.fsdp import TrainConfig
    from asyncrl.hybrid.models import ModelConfig
    from asyncrl.hybrid.roles import make_backend

    rank = SimpleNamespace(mesh={"dp": 1, "tp": 2}, world_size=2)
    with pytest.raises(ValueError, match=r"backend='zero3' \(DeepSpeed ZeRO\) shards over "
                                         r"data-parallel ranks only; .* has \{'tp': 2\}"):
        make_backend(rank, "zero3", ModelConfig(preset="tiny-llama"), TrainConfig())

    class Mine(Policy):  # an __init__ of its own: its arguments are its own
        def __init__(self, depth):
            super().__init__({"preset": "tiny-llama"})

    asyncrl.group(Mine, 3)


def test_the_readmes_settings_at_a_glance_are_the_settings_and_their_defaults():
    """The README's list of each settings dict (keys and defaults) is what the code takes:
    a default changed (dual_clip 3.0, say) or a key added shows here."""
    import re
    from dataclasses import MISSING, fields
    from pathlib import Path

    from asyncrl.hybrid.fsdp import TrainConfig
    from asyncrl.hybrid.models import ModelConfig
    from asyncrl.hybrid.sampler import SamplingConfig
    from asyncrl.hybrid.turns import MultiTurn
    from asyncrl.rl.config import RLConfig

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    glance = readme[readme.index("**Settings at a glance**"):]
    glance = " ".join(glance[:glance.index("- Beside them")].split())
    for cls in (ModelConfig, TrainConfig, SamplingConfig, RLConfig, MultiTurn):
        entry = re.search(rf"\(`{cls.__name__}`[^)]*\): (.*?)(?= - `|$)", glance)
        assert entry, cls.__name__
        listed = re.findall(r"`(\w+)(?:=([^`]*))?`", entry.group(1))
        want = [(f.name, repr(f.default) if f.default is not MISSING else
                 repr(f.default_factory()) if f.default_factory is not MISSING else "")
                for f in fields(cls) if f.init]
        assert listed == want, (cls.__name__, listed, want)


def test_a_critic_from_a_tied_checkpoint_untied_by_an_override_builds(tmp_path):
    """The override that unties a tied checkpoint's head (LoRA's modules_to_save) failed a
    critic's build with an AttributeError: its backbone has no head to untie."""
    from transformers import AutoModelForCausalLM

    from asyncrl.hybrid.models import tiny_llama

    config = tiny_llama()
    config.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    critic = build_value_model(ModelConfig(path=str(tmp_path / "ckpt"),
                                           overrides={"tie_word_embeddings": False}))
    assert critic.model.get_output_embeddings() is None
    assert critic.value_head.weight.abs().max() == 0


def test_a_tokenizer_with_code_of_its_own_is_refused_at_once(tmp_path, monkeypatch):
    """transformers asked "Do you wish to run the custom code? [y/N]" on a terminal (a rank
    waited on it) before failing; asyncrl runs no tokenizer's code and says what to give."""
    import json

    from helpers import word_tokenizer

    from asyncrl.hybrid.user_fn import load_tokenizer

    folder = word_tokenizer(tmp_path / "tok")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings |= {"tokenizer_class": "MyTokenizer",
                 "auto_map": {"AutoTokenizer": ["tokenization_mine.MyTokenizer", None]}}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))

    def asked(*args):
        raise AssertionError("asked on the terminal")
    monkeypatch.setattr("builtins.input", asked)
    with pytest.raises(ValueError, match=r"auto_map in its tokenizer_config.json .*asyncrl "
                                         r"does not run a tokenizer's code: give a folder with "
                                         r"a plain tokenizer.json"):
        load_tokenizer(str(folder))
