"""DAPO's dynamic sampling on real groups: a 2-rank Actor generates, a RewardFn scores, the
groups whose rewards differ are kept across prompt batches and trained on as one batch."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import assert_gone, group_pids, run

import asyncrl
from asyncrl import TensorBatch
from asyncrl.rl import Actor, DynamicSamplingError, PromptSource, RewardFn, dynamic_sampling
from asyncrl.rl.dynamic import informative_groups

GROUP = 4


def parity(prompt, response, kind):
    """'easy' prompts always score 1, 'hard' ones 0 (their groups all alike); 'mixed' ones
    score the parity of the first response token (their groups usually differ)."""
    if kind != "mixed":
        return float(kind == "easy")
    return float(response[0] % 2) if response else 0.0


# in order (no shuffle): the first batch of 4 prompts has one 'mixed' prompt, so three
# groups that differ need another batch at least; the prompts are 1-5 tokens long
KINDS = ["easy", "mixed", "hard", "easy", "hard", "mixed", "mixed", "easy", "hard", "mixed",
         "mixed", "hard", "easy", "mixed", "hard", "mixed"]
RECORDS = [{"prompt": [1] + [10 + i] * (i % 5), "kind": k} for i, k in enumerate(KINDS)]


def test_informative_groups_are_those_whose_values_differ():
    values = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.25])
    assert informative_groups(values, 4).tolist() == [1, 3]
    with pytest.raises(ValueError, match="15 samples is not a multiple of group_size=4"):
        informative_groups(values[:15], 4)


def test_dynamic_sampling_trains_on_groups_whose_rewards_differ():
    def source(**kw):
        return PromptSource(RECORDS, batch_size=4, repeat=GROUP, shuffle=False, epochs=None,
                            **kw)

    async def main():
        async with asyncrl.Controller() as ctl:
            actor = await ctl.spawn(Actor, {"seed": 0}, rl={"group_size": GROUP},
                                    train={"lr": 1e-3}, sampling={"max_new_tokens": 3},
                                    nprocs=2, name="actor")
            rewards = await ctl.spawn(RewardFn, parity, nprocs=1, name="reward")
            pids = group_pids(actor) + group_pids(rewards)
            prompts = source(max_prompt_length=6)
            out = await dynamic_sampling(next(iter(prompts)), more=prompts.next_batch,
                                         generate=actor.generate, score=rewards.score,
                                         groups=3, group_size=GROUP)
            before = ctl.payload_bytes
            stats = await actor.update(out["rollout"], out["score"])
            moved = ctl.payload_bytes - before
            rollout, scores = await out["rollout"], await out["score"]
            position = prompts.state_dict()

            errors = []
            for kw, groups, rounds in (({"max_prompt_length": 6}, 4, 2), ({}, 3, None)):
                again = source(**kw)
                try:
                    await dynamic_sampling(next(iter(again)), more=again.next_batch,
                                           generate=actor.generate, score=rewards.score,
                                           groups=groups, group_size=GROUP, max_rounds=rounds)
                except (DynamicSamplingError, ValueError) as e:
                    errors.append(e)
            return out, stats, moved, rollout, scores, position, errors, pids
    out, stats, moved, rollout, scores, position, errors, pids = run(main(), timeout=240)
    assert_gone(pids)
    rewards = scores["reward"].reshape(-1, GROUP)
    assert rewards.shape == (3, GROUP)
    assert (rewards.max(1).values > rewards.min(1).values).all()  # every kept group differs
    assert rollout["kind"] == ["mixed"] * 3 * GROUP
    # each kept row's score is its own response's: rows and scores picked alike
    for i in range(len(rollout)):
        response = rollout["response_ids"][i][rollout["response_mask"][i].bool()].tolist()
        assert scores["reward"][i] == parity(None, response, "mixed")
    assert rollout["prompt_ids"].shape[1] == 6  # every batch padded to max_prompt_length
    assert out["dapo/rounds"] >= 2 and out["dapo/kept_groups"] == 3
    # the batches drawn, 4 prompts each, moved the source's shared position on as far
    assert position["index"] == (4 * out["dapo/rounds"] - 1) % len(RECORDS) + 1
    seen = 4 * out["dapo/rounds"]
    assert 0 < out["dapo/uniform_groups"] <= (seen - 3) / seen
    assert stats["actor/version"] == 1 and torch.isfinite(torch.tensor(stats["actor/pg_loss"]))
    assert moved == 0  # the kept rows went from the actor's ranks to the actor's ranks
    assert "after 2 prompt batches" in str(errors[0]) and "raise max_rounds" in str(errors[0])
    assert isinstance(errors[1], ValueError) and "max_prompt_length" in str(errors[1])


def test_dynamic_sampling_without_a_limit_says_it_goes_on(caplog):
    """No max_rounds (the default) and a reward that scores every sample alike: the node
    drew batch after batch with nothing said, the step looking hung."""
    from asyncrl.hybrid.sampler import PROMPT_WIDTH

    def batch():
        return TensorBatch({"prompt": [[1]] * 4}, {PROMPT_WIDTH: 1})

    drawn = []

    def more():
        drawn.append(1)
        return batch() if len(drawn) < 24 else None  # (runs out: the test ends)

    async def alike(rollout):
        return {"reward": torch.zeros(4)}

    with caplog.at_level("WARNING", logger="asyncrl"), \
            pytest.raises(DynamicSamplingError, match="no group whose rewards differ in 48"):
        asyncio.run(dynamic_sampling(batch(), more=more, generate=lambda b: b, score=alike,
                                     groups=2, group_size=2))
    said = [r.getMessage() for r in caplog.records if "dynamic sampling has drawn" in
            r.getMessage()]
    assert len(said) == 2 and "drawn 10 prompt batches and kept 0 of the 2 groups needed " \
                              "(20 of 20 groups scored alike)" in said[0]


def test_dynamic_sampling_refuses_a_score_that_is_not_finite():
    """A NaN score made its group's max and min NaN (NaN > NaN is False): the group was
    dropped as scored alike, unsaid, and the run ended as if its prompts ran out."""
    from asyncrl.hybrid.sampler import PROMPT_WIDTH

    async def nan(rollout):
        return {"reward": torch.tensor([1.0, float("nan"), 0, 1, 0, 0, 0, 0])}

    with pytest.raises(ValueError, match=r"1 reward\(s\) of prompt batch 1 .* first sample 1"
                                         r"'s \(nan\).*fix the scorer"):
        asyncio.run(dynamic_sampling(
            TensorBatch({"prompt": [[1]] * 4 + [[2]] * 4}, {PROMPT_WIDTH: 1}),
            more=lambda: None, generate=lambda b: b, score=nan, groups=1, group_size=4))


def test_dynamic_sampling_refuses_groups_that_mix_prompts():
    """group_size=4 over prompts repeated twice: a block held two prompts and was kept when
    either's samples differed (a uniform group's advantages, all 0, trained on)."""
    from asyncrl.hybrid.sampler import PROMPT_WIDTH

    mixed = TensorBatch({"prompt": [[1], [1], [2], [2]]}, {PROMPT_WIDTH: 1})

    async def never(rollout):
        raise AssertionError("nothing is generated or scored")

    with pytest.raises(ValueError, match=r"rows 0..3 are to be one prompt's group_size=4 "
                                         r"samples, but hold different prompts; give the "
                                         r"PromptSource repeat=4"):
        asyncio.run(dynamic_sampling(mixed, more=lambda: None, generate=lambda b: b,
                                     score=never, groups=1, group_size=4))


def test_dynamic_sampling_needs_the_sources_whole_groups_of_two_or_more():
    """group_size=2 over a PromptSource(repeat=4): a prompt whose pairs each scored alike
    was dropped although its four samples differed, and another kept as half a group (the
    actor's GRPO then failed, naming repeat=, which was right). group_size=1 never keeps a
    group: it drew every round, then blamed the data."""
    from asyncrl.rl import PromptSource

    source = PromptSource([{"prompt": [1, 2]}, {"prompt": [3]}], batch_size=2, repeat=4,
                          max_prompt_length=4)

    async def never(rollout):
        raise AssertionError("nothing is generated or scored")

    with pytest.raises(ValueError, match=r"group_size=2, but the PromptSource repeats each "
                                         r"prompt 4 times \(repeat=4\)"):
        asyncio.run(dynamic_sampling(source.next_batch(), more=lambda: None,
                                     generate=lambda b: b, score=never, groups=1,
                                     group_size=2))
    # a source of one sample per prompt, repeated after and given a seed per copy: its
    # meta says 1, and the rows are whole groups (as _check_groups sees): generated
    copied = PromptSource([{"prompt": [1, 2]}, {"prompt": [3]}], batch_size=2,
                          max_prompt_length=4).next_batch().repeat(4)
    once = TensorBatch({"prompt": copied["prompt"], "seed": list(range(8))}, copied.meta)

    class Generated(Exception):
        pass

    def generate(batch):
        raise Generated

    with pytest.raises(Generated):
        asyncio.run(dynamic_sampling(once, more=lambda: None, generate=generate, score=never,
                                     groups=1, group_size=4))
    with pytest.raises(ValueError, match="group_size >= 2"):
        asyncio.run(dynamic_sampling(source.next_batch(), more=lambda: None,
                                     generate=lambda b: b, score=never, groups=1,
                                     group_size=1))


def test_dynamic_sampling_refuses_a_group_of_one_seed():
    """PromptSource(repeat=1) then batch.repeat(4): each group's four copies shared one
    sampling seed, so its samples came out identical, scored alike, and every round was
    thrown away until max_rounds blamed the prompts."""
    source = PromptSource([{"prompt": [1, 2]}, {"prompt": [3]}], batch_size=2,
                          shuffle=False, max_prompt_length=4)
    copied = source.next_batch().repeat(4)

    def generate(batch):
        raise AssertionError("nothing is generated")

    def score(rollout):
        raise AssertionError("nothing is scored")

    with pytest.raises(ValueError, match=r"rows 0..3 are one group, but samples of one group "
                                         r"share a sampling seed: they will be identical; "
                                         r"use PromptSource\(repeat=group_size\)"):
        asyncio.run(dynamic_sampling(copied, more=source.next_batch, generate=generate,
                                     score=score, groups=1, group_size=4))
    # the source's own groups: a seed per sample, each group's four distinct
    grouped = PromptSource([{"prompt": [1, 2]}, {"prompt": [3]}], batch_size=2, repeat=4,
                           max_prompt_length=4).next_batch()
    assert len(set(grouped["seed"][:4])) == 4 and len(set(grouped["seed"])) == 8

    class Generated(Exception):
        pass

    def reached(batch):
        raise Generated

    with pytest.raises(Generated):
        asyncio.run(dynamic_sampling(grouped, more=lambda: None, generate=reached,
                                     score=score, groups=1, group_size=4))


def test_dynamic_sampling_filters_on_the_functions_own_score_by_default():
    """With an overlong penalty the reward is score + penalty: a group all wrong (score 0)
    whose answers differ in length passed for one whose rewards differ, and trained on
    advantages from length alone (verl's DAPO filters on "acc")."""
    from asyncrl.futures.future import DistFuture
    from asyncrl.hybrid.sampler import PROMPT_WIDTH

    prompts = TensorBatch({"prompt": [[1], [1], [2], [2]]}, {PROMPT_WIDTH: 1})
    # prompt 1: both wrong, one long (penalised); prompt 2: one right
    scores = TensorBatch({"reward": torch.tensor([0.0, -0.6, 1.0, 0.0]),
                          "score": torch.tensor([0.0, 0.0, 1.0, 0.0]),
                          "overlong_penalty": torch.tensor([0.0, -0.6, 0.0, 0.0])})

    def done(value):  # a group call's future, answered
        return DistFuture.held(value, "g.m")

    async def kept(**kw):
        out = await dynamic_sampling(prompts, more=lambda: None, generate=done,
                                     score=lambda rollout: done(scores), groups=2,
                                     group_size=2, **kw)
        return out["dapo/kept_groups"]
    assert asyncio.run(kept()) == 1
    assert asyncio.run(kept(metric="reward")) == 2
    with pytest.raises(KeyError, match="no 'acc' column"):
        asyncio.run(kept(metric="acc"))


def test_dynamic_sampling_needs_one_prompt_width_before_it_generates():
    """Prompts without PROMPT_WIDTH (a PromptSource without max_prompt_length=) were refused
    only when a step first needed a second round: after a generate, maybe hours in."""
    calls = []

    def generate(batch):
        calls.append(batch)
        raise AssertionError("refused before generating")

    prompts = TensorBatch({"prompt": [[1], [1]]})
    with pytest.raises(ValueError, match="give the PromptSource max_prompt_length="):
        asyncio.run(dynamic_sampling(prompts, more=lambda: None, generate=generate,
                                     score=lambda r: r, groups=1, group_size=2))
    assert calls == []
    # one round only (max_rounds=1) never joins batches: no width needed
    with pytest.raises(AssertionError, match="refused before generating"):
        asyncio.run(dynamic_sampling(prompts, more=lambda: None, generate=generate,
                                     score=lambda r: r, groups=1, group_size=2, max_rounds=1))
    assert len(calls) == 1


def test_prompts_running_out_with_no_group_kept_is_prompts_exhausted():
    """The last step of a finite run (epochs=1) whose prompts all scored alike: an error a
    DataFlow takes for the end of its input (test_flow_steps), not a failure."""
    from asyncrl.errors import InputsExhausted
    from asyncrl.futures.future import DistFuture
    from asyncrl.hybrid.sampler import PROMPT_WIDTH
    from asyncrl.rl.dynamic import PromptsExhausted

    def done(value):
        return DistFuture.held(value, "g.m")

    def alike(rollout):
        return done(TensorBatch({"reward": torch.ones(2)}))

    batches = [TensorBatch({"prompt": [[2], [2]]}, {PROMPT_WIDTH: 1})]
    with pytest.raises(PromptsExhausted, match="no group whose rewards differ in 2 groups "
                                               "before the prompts ran out") as info:
        asyncio.run(dynamic_sampling(TensorBatch({"prompt": [[1], [1]]}, {PROMPT_WIDTH: 1}),
                                     more=lambda: batches.pop() if batches else None,
                                     generate=done, score=alike, groups=1, group_size=2))
    assert isinstance(info.value, DynamicSamplingError)
    assert isinstance(info.value, InputsExhausted)


@pytest.mark.parametrize("differ", [False, True])
def test_prompts_running_out_at_max_rounds_ends_the_step(differ):
    """max_rounds=2 and the source's last batch in round 2: the limit was checked before
    more() said the prompts were done, so a finite run's last step failed, "raise max_rounds",
    instead of training on the groups kept (or ending the run: PromptsExhausted)."""
    from asyncrl.futures.future import DistFuture
    from asyncrl.hybrid.sampler import PROMPT_WIDTH
    from asyncrl.rl.dynamic import PromptsExhausted

    def done(value):
        return DistFuture.held(value, "g.m")

    rewards = [torch.ones(4), torch.tensor([1.0, 0.0, 1.0, 1.0] if differ else [1.0] * 4)]

    def score(rollout):
        return done(TensorBatch({"reward": rewards.pop(0)}))

    batches = [TensorBatch({"prompt": [[3], [3], [4], [4]]}, {PROMPT_WIDTH: 1})]
    run_ = dynamic_sampling(TensorBatch({"prompt": [[1], [1], [2], [2]]}, {PROMPT_WIDTH: 1}),
                            more=lambda: batches.pop() if batches else None, generate=done,
                            score=score, groups=2, group_size=2, max_rounds=2)
    if not differ:
        with pytest.raises(PromptsExhausted, match="no group whose rewards differ in 4"):
            asyncio.run(run_)
        return
    out = asyncio.run(run_)
    assert out["dapo/kept_groups"] == 1 and out["dapo/rounds"] == 2


def test_the_batch_drawn_past_max_rounds_goes_with_the_error():
    """To tell prompts that ran out from more needed, a batch is drawn past max_rounds: a
    caller that catches the error and goes on has it (else its prompts were never seen)."""
    from asyncrl.futures.future import DistFuture
    from asyncrl.hybrid.sampler import PROMPT_WIDTH

    def done(value):
        return DistFuture.held(value, "g.m")

    extra = TensorBatch({"prompt": [[5], [5]]}, {PROMPT_WIDTH: 1})
    with pytest.raises(DynamicSamplingError, match="raise max_rounds") as info:
        asyncio.run(dynamic_sampling(
            TensorBatch({"prompt": [[1], [1]]}, {PROMPT_WIDTH: 1}), more=lambda: extra,
            generate=done, score=lambda r: done(TensorBatch({"reward": torch.ones(2)})),
            groups=1, group_size=2, max_rounds=1))
    assert info.value.drawn is extra
