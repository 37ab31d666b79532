"""What the roles take in one process: prompt batches (a rollout given back, token ids as
arrays, no rows at all) through generate_with, and settings refused where a group is
declared rather than in every rank's __init__."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from asyncrl import TensorBatch
from asyncrl.hybrid import roles
from asyncrl.hybrid.models import ModelConfig, build_model, sampled_at, sequence_logprobs
from asyncrl.hybrid.roles import Policy, _prompts, generate_with
from asyncrl.hybrid.sampler import PROMPT_WIDTH, Sampler, SamplingConfig
from asyncrl.hybrid.turns import MultiTurn, Turns
from asyncrl.rl.batch import ASSEMBLED

PROMPTS = [[1, 5, 6], [1, 7], [1, 9, 10, 11, 12], [1, 3]]
STOPS = tuple(range(20, 128, 3))  # a third of the vocabulary ends a turn: turns are short


def observe(prompt, response, turn):
    """One observation, after the first turn."""
    return [100, 101] if turn == 0 else None


def engine(temperature: float) -> Sampler:
    cfg = SamplingConfig(max_new_tokens=12, stop_token_ids=STOPS, temperature=temperature)
    return Sampler(build_model(ModelConfig(seed=3)).eval(), cfg)


def prompt_batch() -> TensorBatch:
    return TensorBatch({"prompt": PROMPTS, "seed": [11, 12, 13, 14], "answer": list("abcd")},
                       {PROMPT_WIDTH: 8})


def test_a_rollout_given_back_as_prompts_keeps_none_of_its_old_generation():
    """Regenerating a multi-turn rollout's rows kept its policy_mask, turns and scores, and
    its meta's temperature over the new one (log-probs then taken at the wrong one)."""
    sampler = engine(0.7)
    rollout = generate_with(sampler, Turns(MultiTurn(env=observe, max_turns=2)),
                            prompt_batch(), sampler.config)
    assert "policy_mask" in rollout and sampled_at(rollout) == 0.7
    rollout = rollout.union(TensorBatch({"reward": torch.zeros(4)}))
    again = generate_with(sampler, None, rollout.take([0, 2]),
                          replace(sampler.config, temperature=1.3))
    assert again.keys() == ["prompt_ids", "prompt_mask", "response_ids", "response_mask",
                            "logprobs", "versions", "prompt", "seed", "answer"]
    assert sampled_at(again) == 1.3 and again.meta[PROMPT_WIDTH] == 8
    assert again["answer"] == ["a", "c"] and again.tensor("prompt_ids").shape[1] == 8
    mask = again.tensor("response_mask")
    want = sequence_logprobs(sampler.model, again.tensor("prompt_ids"),
                             again.tensor("prompt_mask"), again.tensor("response_ids"), mask,
                             temperature=sampled_at(again))
    torch.testing.assert_close(again.tensor("logprobs") * mask, want * mask,
                               atol=1e-4, rtol=1e-4)
    assert ASSEMBLED <= roles.NOT_CARRIED  # (asyncrl.rl's list, repeated in hybrid: layers)


def test_prompts_of_numpy_or_torch_token_ids_are_taken_as_ints():
    batch = TensorBatch({"prompt": [np.array([1, 5]), torch.tensor([1, 7]),
                                    [np.int64(1), torch.tensor(9)], (1, 3)],
                         "seed": [0, 1, 2, 3]})
    prompts, seeds = _prompts(batch)
    assert prompts == [[1, 5], [1, 7], [1, 9], [1, 3]] and seeds == [0, 1, 2, 3]
    assert all(type(t) is int for p in prompts for t in p)
    sampler = engine(1.0)
    as_lists = TensorBatch({"prompt": prompts, "seed": [0, 1, 2, 3]})
    torch.testing.assert_close(*(generate_with(sampler, None, b, sampler.config)["response_ids"]
                                 for b in (batch, as_lists)))
    for bad in (np.array([1.0, 5.0]), torch.tensor([True, False]), [1, True], [1.5],
                np.array([[1, 5]]), "1 5", [1, "5"]):
        with pytest.raises(TypeError, match="not a list of token ids"):
            _prompts(TensorBatch({"prompt": [bad], "seed": [0]}))


@pytest.mark.parametrize("multi_turn", [None, {"env": observe},
                                        {"env": observe, "processes": 1}])
def test_no_prompts_give_a_generation_of_no_rows_with_the_columns_of_one(multi_turn):
    """A DP call splits a batch smaller than its ranks into empty chunks: generate failed
    on them ("every prompt needs at least one token")."""
    sampler = engine(1.0)
    turns = Turns(MultiTurn(**multi_turn)) if multi_turn else None
    try:
        one = generate_with(sampler, turns, prompt_batch().slice(0, 1), sampler.config)
        none = generate_with(sampler, turns, prompt_batch().slice(0, 0), sampler.config)
    finally:
        if turns is not None:
            turns.close()
    assert len(none) == 0 and none.keys() == one.keys() and none.meta == one.meta
    for k, v in one.items():
        if isinstance(v, torch.Tensor):
            assert none[k].dtype == v.dtype and none[k].shape[1:] == v.shape[1:], k
    assert len(TensorBatch.concat([none, one])) == 1  # as a DP call collects them


@pytest.mark.parametrize("bad", ["3", 1.5, True])
def test_a_model_seed_that_is_not_a_whole_number_is_refused_where_declared(bad):
    """It failed every rank's build after the groups had started (manual_seed)."""
    with pytest.raises(ValueError, match="ModelConfig.seed must be a whole number"):
        Policy.check_settings(model={"seed": bad})
    assert type(ModelConfig(seed=np.int64(3)).seed) is int  # (model.json is json)


def test_model_overrides_that_are_not_a_dict_are_refused_where_declared():
    with pytest.raises(TypeError, match="ModelConfig.overrides is a dict"):
        Policy.check_settings(model={"overrides": [("vocab_size", 3)]})


def test_a_policy_that_only_trains_refuses_multi_turn_before_building_its_trainer(
        monkeypatch):
    args = {"model": {}, "hybrid": False, "multi_turn": {"env": observe},
            "sampling": {"stop_token_ids": [2]}}
    with pytest.raises(ValueError, match="multi_turn= is for a Policy that generates"):
        Policy.check_settings(**args)

    def built(*_: object) -> None:
        raise AssertionError("the trainer was built first")
    monkeypatch.setattr(roles, "make_backend", built)
    with pytest.raises(ValueError, match="multi_turn= is for a Policy that generates"):
        Policy.__new__(Policy).__init__(**args)
