"""Multi-turn rollouts (asyncrl.hybrid.turns): the environment's observations in the
response and out of every loss, in process and on real groups."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers import CHAT_TEMPLATE, assert_gone, group_pids, poll_until, run, word_tokenizer

import asyncrl
from asyncrl import TensorBatch
from asyncrl.comm.batch import PAD_KEY
from asyncrl.controller.launcher import pid_alive
from asyncrl.hybrid.engine import HybridEngine
from asyncrl.hybrid.fsdp import sequence_mean_nll
from asyncrl.hybrid.models import ModelConfig, build_model, sequence_logprobs
from asyncrl.hybrid.sampler import Sampler, SamplingConfig
from asyncrl.hybrid.turns import MultiTurn, Turns, chat_turns, multi_turn_config
from asyncrl.rl.actor import policy_loss
from asyncrl.rl.algorithms import gae
from asyncrl.rl.batch import assemble, drop_stale, token_rewards
from asyncrl.rl.config import RLConfig

PROMPTS = [[1, 5, 6], [1, 7], [1, 9, 10, 11, 12], [1, 3]]
SEEDS = [11, 12, 13, 14]
STOPS = tuple(range(20, 128, 3))  # a third of the vocabulary ends a turn: turns are short
OBSERVED = [100, 101, 102]
CHATML = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")
QWEN3_LIKE = ("{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}"
              "<|im_start|>assistant\n<think>\n\n</think>\n\n{{ m['content'] }}<|im_end|>\n"
              "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def echo(prompt, response, turn, transcript):
    """Observes the turn index and the turn's length; done after the second observation."""
    assert transcript[-len(response):] == response
    return [OBSERVED[turn], len(response)] if turn < 2 else None


def engine(max_new_tokens=24):
    model = build_model(ModelConfig(preset="tiny-llama", seed=3)).eval()
    return model, Sampler(model, SamplingConfig(max_new_tokens=max_new_tokens,
                                                stop_token_ids=STOPS))


def by_turn(engine):
    """The engine without its own turn loop: one generate call per turn, as vLLM runs."""
    return SimpleNamespace(generate=engine.generate)


@pytest.fixture(params=["in_loop", "by_turn"])
def drive(request):
    """Both ways of running turns on the built-in engine: they must give the same rows."""
    return (lambda engine: engine) if request.param == "in_loop" else by_turn


def turns(env=echo, **kw):
    return Turns(MultiTurn(env=env, **kw))


def prompt_batch(**columns):
    return TensorBatch({"prompt": PROMPTS, "seed": SEEDS, **columns})


def test_each_turn_conditions_on_the_observations_which_stay_out_of_the_policy_tokens(drive):
    model, sampler = engine()
    out = turns(max_turns=3).generate(drive(sampler), prompt_batch(), PROMPTS, SEEDS,
                                      sampler.config)
    ids, mask, own = out["response_ids"], out["response_mask"], out["policy_mask"]
    for i in range(len(PROMPTS)):
        n = int(mask[i].sum())
        assert mask[i, :n].all() and not mask[i, n:].any() and n <= 24  # a prefix: the budget
        row, who = ids[i, :n].tolist(), own[i, :n].tolist()
        # rebuild the row turn by turn: each observation follows a turn ending with a stop
        # token, and says which turn it followed and how long it was
        at, turn, spans = 0, 0, []
        while at < n:
            end = who.index(0, at) if 0 in who[at:] else n
            spans.append((at, end))
            assert row[end - 1] in STOPS or end == n
            if end < n:
                assert row[end:end + 2] == [OBSERVED[turn], end - at][:n - end]
                at, turn = end + 2, turn + 1
            else:
                at = n
        assert int(out["turns"][i]) == len(spans) <= 3
        assert (out["versions"][i, :n] == torch.tensor(who) - 1).all()  # the env's: -1
    assert int(out["turns"].max()) == 3, "the test should reach the last turn"
    # the engine's log-probs are those of a training forward pass over the whole response,
    # observations included: each turn saw them; the environment's tokens have none
    forward = sequence_logprobs(model, out["prompt_ids"], out["prompt_mask"], ids, mask)
    sampled = (mask * own).bool()
    assert (forward - out["logprobs"]).abs()[sampled].max() < 1e-5
    assert (out["logprobs"][~sampled] == 0).all()


def test_the_first_turn_is_what_a_single_turn_generation_samples(drive):
    _, sampler = engine()
    single = sampler.generate(PROMPTS, SEEDS)
    one = turns(max_turns=1).generate(drive(sampler), prompt_batch(), PROMPTS, SEEDS,
                                      sampler.config)
    for key in ("prompt_ids", "response_ids", "response_mask", "logprobs", "versions"):
        assert torch.equal(one[key], single[key]), key
    assert one["policy_mask"].equal(single["response_mask"]) and one["turns"].tolist() == [1] * 4
    three = turns(max_turns=3).generate(drive(sampler), prompt_batch(), PROMPTS, SEEDS,
                                        sampler.config)
    for i in range(4):
        first = three["policy_mask"][i].tolist().index(0)
        assert three["response_ids"][i, :first].equal(single["response_ids"][i, :first])


def test_turns_in_the_decode_loop_equal_a_generate_call_per_turn():
    _, sampler = engine()
    loop, calls = (turns(max_turns=4).generate(e, prompt_batch(), PROMPTS, SEEDS,
                                               sampler.config)
                   for e in (sampler, by_turn(sampler)))
    for key in ("response_ids", "response_mask", "policy_mask", "versions", "turns"):
        assert torch.equal(loop[key], calls[key]), key
    assert (loop["logprobs"] - calls["logprobs"]).abs().max() < 1e-5
    assert int(loop["turns"].max()) > 2


def test_the_vllm_adapter_runs_the_same_turns_as_the_built_in_engine():
    import fake_vllm

    from asyncrl.hybrid.vllm_engine import VLLMEngine

    cfg = SamplingConfig(max_new_tokens=20, stop_token_ids=STOPS)
    vllm = VLLMEngine("tiny-llama", cfg, llm_cls=fake_vllm.LLM,
                      sampling_params_cls=fake_vllm.SamplingParams)
    builtin = Sampler(build_model(ModelConfig()), cfg)
    # vLLM runs a call per turn; the built-in engine continues turns in its decode loop
    theirs, mine = (turns(max_turns=3).generate(e, prompt_batch(), PROMPTS, SEEDS, cfg)
                    for e in (vllm, builtin))
    for key in ("response_ids", "response_mask", "policy_mask", "versions", "turns"):
        assert torch.equal(theirs[key], mine[key]), key
    assert (theirs["logprobs"] - mine["logprobs"]).abs().max() < 1e-6
    assert int(mine["turns"].max()) > 1


def test_a_dp_chunks_padding_rows_take_one_turn_and_never_call_the_environment(drive):
    calls = []

    def counting(prompt, response):
        calls.append(prompt)
        return [OBSERVED[0]]

    _, sampler = engine()
    batch = TensorBatch({"prompt": PROMPTS, "seed": SEEDS}, {PAD_KEY: 2})
    out = turns(counting, max_turns=2).generate(drive(sampler), batch, PROMPTS, SEEDS,
                                                sampler.config)
    assert calls == PROMPTS[:2] and out["turns"].tolist()[2:] == [1, 1]
    assert out["policy_mask"][2:].equal(out["response_mask"][2:])


def test_observations_are_cut_to_their_limit_and_the_budget(drive):
    _, sampler = engine(max_new_tokens=12)

    def verbose(prompt, response):
        return list(range(40, 60))

    out = turns(verbose, max_turns=4, max_observation_tokens=5).generate(
        drive(sampler), prompt_batch(), PROMPTS, SEEDS, sampler.config)
    for i in range(4):
        who = out["policy_mask"][i].tolist()
        n = int(out["response_mask"][i].sum())
        gaps = "".join(str(w) for w in who[:n]).split("1")
        assert all(len(g) <= 5 for g in gaps)
        env = [t for t, w in zip(out["response_ids"][i, :n].tolist(), who[:n], strict=True)
               if not w]
        assert env == list(range(40, 45)) * (len(env) // 5) + list(range(40, 40 + len(env) % 5))
    assert int(out["response_mask"].sum(1).max()) == 12
    # each observation (20 tokens, every one over the limit) is counted as cut
    runs = [len([g for g in "".join(str(w) for w in out["policy_mask"][i, :int(
        out["response_mask"][i].sum())].tolist()).split("1") if g]) for i in range(4)]
    assert out["env_truncated"].tolist() == runs and sum(runs) > 0


def test_a_text_environment_reads_and_writes_text_and_gets_the_columns_it_names(tmp_path):
    folder = word_tokenizer(tmp_path / "tok")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    seen = []

    def tool(prompt, response, answer, turn):
        seen.append((prompt, response, answer, turn))
        return "#### 4 2" if turn == 0 else None

    _, sampler = engine()
    t = Turns(MultiTurn(env=tool, max_turns=2, tokenizer=str(folder)))
    out = t.generate(sampler, prompt_batch(answer=["a", "b", "c", "d"]), PROMPTS,
                     SEEDS, sampler.config)
    by_row = {s[2]: s for s in seen}  # asked as each row's turn ends
    assert sorted(by_row) == ["a", "b", "c", "d"] and {s[3] for s in seen} == {0}
    assert by_row["b"][0] == tok.decode(PROMPTS[1], skip_special_tokens=True)
    said = tok("#### 4 2", add_special_tokens=False)["input_ids"]
    for i in range(4):
        who = out["policy_mask"][i].tolist()
        start = who.index(0)
        assert out["response_ids"][i, start:start + 3].tolist() == said
        assert tok.decode(out["response_ids"][i, :start].tolist(),
                          skip_special_tokens=True) == by_row["abcd"[i]][1]


def test_chat_messages_are_written_as_the_template_writes_the_conversation(tmp_path):
    """The prompt, the generated turn and the rendered messages, as token ids, are the chat
    template's rendering of the whole conversation, the next assistant turn opened: whether
    the turn stopped at the end-of-turn token or not."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(word_tokenizer(tmp_path / "tok"))
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    question = [{"role": "user", "content": "w1 w2"}]
    prompt = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    reply = [{"role": "system", "content": "4 2"}]
    for said in (ids("w7 w8 </s>"), ids("w7 w8")):  # stopped at </s>, or cut by the budget
        observed = chat_turns(tok, reply, said, "row 0, turn 0")
        whole = tok.apply_chat_template(
            question + [{"role": "assistant", "content": "w7 w8"}] + reply,
            add_generation_prompt=True, tokenize=False)
        assert ids(prompt) + said + ids(observed) == ids(whole)
    t, counted = Turns(MultiTurn(env=echo, tokenizer=str(tmp_path / "tok"))), [0]
    assert t._ids({"role": "user", "content": "4"}, 0, 0, said, counted) == ids(
        "</s> <s> user 4 </s> <s> assistant")
    assert counted == [0]  # whole
    # ChatML (Qwen's): the turn stopped at <|im_end|>; the newline after it is the template's
    tok.chat_template = CHATML
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    said = ids("w7") + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert chat_turns(tok, [{"role": "tool", "content": "42"}], said, "row 0, turn 0") == \
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    # Qwen3's writes the last assistant turn with an empty think block, an earlier one
    # without: only what follows the assistant's content is read
    tok.chat_template = QWEN3_LIKE
    assert chat_turns(tok, [{"role": "tool", "content": "42"}], said, "row 0, turn 0") == \
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    # a long message is cut to max_observation_tokens in its content, its markers kept
    tok.chat_template = CHAT_TEMPLATE
    t = Turns(MultiTurn(env=echo, tokenizer=str(tmp_path / "tok"), max_observation_tokens=9))
    long = {"role": "user", "content": " ".join(f"w{k}" for k in range(30))}
    cut = t._ids(long, 0, 0, ids("w7 </s>"), counted)
    assert cut == ids("<s> user w0 w1 w2 w3 </s> <s> assistant")  # 9 tokens
    assert counted == [1]  # and counted as cut
    parts = {"role": "tool", "content": [{"type": "text", "text": long["content"]}]}
    with pytest.raises(ValueError, match="a content that is not text .* cannot be cut"):
        t._ids(parts, 0, 0, ids("w7 </s>"), counted)  # (it was cut as its repr, as text)
    bare = AutoTokenizer.from_pretrained(word_tokenizer(tmp_path / "bare", chat=False))
    with pytest.raises(ValueError, match="row 2, turn 1: the environment returned chat "
                                         "messages, but the tokenizer has no chat template"):
        chat_turns(bare, reply, said, "row 2, turn 1")


def bad_value(prompt, response):
    return {"tool": "x"}


def broken(prompt, response, turn):
    if turn == 0 and len(prompt) == 2:
        raise ZeroDivisionError("the tool broke")
    return [5]


def needs_a_column(prompt, response, label):
    return None


def test_environment_errors_name_the_row_turn_and_fix():
    _, sampler = engine()

    def go(env, **kw):
        return turns(env, **kw).generate(sampler, prompt_batch(), PROMPTS, SEEDS,
                                         sampler.config)

    with pytest.raises(TypeError, match=r"'bad_value' returned .*row 0, turn 0.*token ids"):
        go(bad_value)
    with pytest.raises(ValueError, match=r"(?s)'broken' failed on row 1, turn 0:.*the tool broke"):
        go(broken)
    with pytest.raises(TypeError, match=r"environment 'needs_a_column' takes \['label'\]"):
        go(needs_a_column)
    vocab = sampler.vocab_size  # (torch's IndexError, deep in the decode loop)

    def beyond(prompt, response):
        return [1, vocab]
    with pytest.raises(ValueError, match=rf"'beyond' returned token ids outside the model's "
                                         rf"vocabulary of {vocab} \(\[{vocab}\]\) for row 0"):
        go(beyond)

    class WholeBackend:  # a Policy's hybrid engine around the same sampler's settings
        def __init__(self):
            self.model = build_model(ModelConfig(preset="tiny-llama", seed=3))
            self.opt = torch.optim.AdamW(self.model.parameters())

        def offload_masters(self):
            return 0

        def reload_masters(self):
            pass

    hybrid = HybridEngine(WholeBackend(), ModelConfig(preset="tiny-llama"), sampler.config)
    hybrid.to_generate()  # (a Policy's engine: it said no vocabulary before session 26)
    with pytest.raises(ValueError, match=rf"'beyond' returned token ids outside the model's "
                                         rf"vocabulary of {vocab}"):
        turns(beyond).generate(hybrid, prompt_batch(), PROMPTS, SEEDS, sampler.config)
    with pytest.raises(TypeError, match="multi_turn= is a dict with 'env'"):
        multi_turn_config({"max_turns": 2})
    with pytest.raises(TypeError,
                       match=r"multi_turn=: 'turns' .*is not a setting; the settings are"):
        multi_turn_config({"env": echo, "turns": 2})
    for bad in ({"max_turns": 0}, {"max_turns": 2.5}, {"max_observation_tokens": 8.0},
                {"max_turns": True}):  # (8.0 failed at the env's first answer, 2.5 on vLLM)
        with pytest.raises(ValueError, match="max_turns and max_observation_tokens must be "
                                             ">= 1 \\(whole numbers\\), got"):
            multi_turn_config({"env": echo, **bad})
    for bad in ({"timeout_s": float("nan")}, {"timeout_s": 0}, {"processes": True}):
        with pytest.raises(ValueError, match="processes must be an int >= 0 and timeout_s"):
            multi_turn_config({"env": echo, **bad})


def quits(prompt, response, turn):
    if len(prompt) == 2:
        sys.exit("the tool quit")
    return None


def test_an_environment_exiting_or_answering_negative_ids_fails_its_row():
    """In this process a sys.exit() in the env failed the rank's call, naming no row; with
    the vocabulary unknown (vLLM's), negative ids passed to the engine."""
    _, sampler = engine()
    with pytest.raises(ValueError, match=r"(?s)'quits' failed on row 1, turn 0:.*"
                                         r"SystemExit: the tool quit"):
        turns(quits).generate(sampler, prompt_batch(), PROMPTS, SEEDS, sampler.config)

    def negative(prompt, response):
        return [5, -1]
    with pytest.raises(ValueError, match=r"'negative' returned token ids outside the model's "
                                         r"vocabulary \(\[-1\]\) for row 0, turn 0"):
        turns(negative).generate(by_turn(sampler), prompt_batch(), PROMPTS, SEEDS,
                                 sampler.config)


def slow_tool(prompt, response, turn):
    """Hangs on row 1's first call (its prompt ends with 7); fails on a prompt ending with 3."""
    if prompt[-1] == 7 and turn == 0:
        time.sleep(600)
    if prompt[-1] == 3:
        raise LookupError("no such tool")
    return [OBSERVED[turn]]


def test_an_environment_in_processes_ends_a_hung_row_and_keeps_the_others():
    _, sampler = engine()
    t = turns(slow_tool, max_turns=3, processes=2, timeout_s=1.0)
    try:
        first = t.pool.pids()
        out = t.generate(sampler, prompt_batch(), PROMPTS[:3], SEEDS[:3],
                         sampler.config)
        assert out["env_timeouts"].tolist() == [0, 1, 0]
        assert int(out["turns"][1]) == 1 and int((1 - out["policy_mask"][1]).mul(
            out["response_mask"][1]).sum()) == 0  # it ended where its call hung
        for i in (0, 2):
            env = out["response_ids"][i][(out["response_mask"][i] *
                                          (1 - out["policy_mask"][i])).bool()].tolist()
            assert env == OBSERVED[:len(env)] and len(env) == int(out["turns"][i]) - 1 >= 1
        replaced = [p for p in first if p not in t.pool.pids()]
        assert len(replaced) == 1 and not pid_alive(replaced[0])
        with pytest.raises(ValueError, match=r"(?s)environment 'slow_tool' failed on row 3, "
                                             r"turn 0:.*LookupError: no such tool"):
            t.generate(sampler, prompt_batch(), PROMPTS, SEEDS, sampler.config)
        pids = first + t.pool.pids()
    finally:
        t.close()
    assert_gone(pids)


def test_the_losses_and_rewards_leave_the_observations_out():
    own = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    rollout = TensorBatch({"response_mask": mask, "policy_mask": own,
                           "logprobs": torch.zeros(2, 6)})
    batch = assemble(rollout, TensorBatch({"reward": torch.tensor([2.0, 3.0])}))
    assert batch["loss_mask"].equal((mask * own).float())
    # the score goes on each row's last sampled token, not on an observation after it
    rewards = token_rewards(batch, RLConfig(group_size=2))
    assert rewards[0].tolist() == [0, 0, 0, 0, 2, 0] and rewards[1].tolist() == [0, 0, 0, 3, 0, 0]


def test_no_loss_term_reaches_an_observation_and_stale_tags_ignore_them():
    """The policy loss, its KL and entropy terms and the SFT loss give the environment's
    tokens no gradient; their version -1 never makes a row look stale."""
    own = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0]])
    rollout = TensorBatch({"response_mask": torch.ones(2, 6, dtype=torch.long),
                           "policy_mask": own, "logprobs": torch.zeros(2, 6),
                           "versions": torch.where(own.bool(), 5, -1)})
    batch = assemble(rollout, TensorBatch({"reward": torch.tensor([1.0, 0.0])}))
    _, _, dropped = drop_stale(batch, version=5, max_staleness=0)
    assert not dropped.any() and batch["loss_mask"].equal(own.float())
    micro = batch.select(["logprobs", "loss_mask"]).union(TensorBatch({
        "advantages": torch.ones(2, 6), "ref_logprobs": torch.randn(2, 6)}))
    micro.meta.update(tokens=float(own.sum()), seqs=2, rows=2, dp=1)
    logp = torch.randn(2, 6, requires_grad=True)
    entropy = torch.rand(2, 6, requires_grad=True)
    loss, _ = policy_loss(RLConfig(group_size=2, kl_coef=0.5, entropy_coef=0.1))(
        {"logprobs": logp, "entropy": entropy}, micro)
    loss.backward()
    for grad in (logp.grad, entropy.grad):
        assert (grad[~own.bool()] == 0).all() and (grad[own.bool()] != 0).all()
    logp.grad = None
    sequence_mean_nll(logp, rollout).backward()
    assert (logp.grad[~own.bool()] == 0).all() and (logp.grad[own.bool()] != 0).all()


def test_a_reward_function_may_take_a_multi_turn_rows_turns():
    from asyncrl.rl.reward import row_inputs

    def by_turns(prompt, response, turns):
        return float(turns)

    rollout = TensorBatch({"prompt": [[1], [2]], "response_ids": torch.ones(2, 3).long(),
                           "response_mask": torch.ones(2, 3).long(),
                           "turns": torch.tensor([1, 3])})
    assert [m for _, _, m in row_inputs(by_turns, rollout)] == [{"turns": 1}, {"turns": 3}]


def test_gae_skips_the_gaps_a_multi_turn_rollout_leaves():
    """GAE over a row with observations equals GAE over the same row without them."""
    torch.manual_seed(0)
    own = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0, 0]], dtype=torch.float32)
    rewards, values = torch.randn(1, 10) * own, torch.randn(1, 10)
    adv, ret = gae(rewards, values, own, gamma=0.9, lam=0.8)
    keep = own[0].bool()
    dense_adv, dense_ret = gae(rewards[:, keep], values[:, keep], own[:, keep], 0.9, 0.8)
    assert torch.allclose(adv[:, keep], dense_adv) and torch.allclose(ret[:, keep], dense_ret)
    assert (adv[:, ~keep] == 0).all() and (ret[:, ~keep] == 0).all()


def lookup(prompt, response, answer):
    """Answers a turn that ended with a stop token (3, 7, 11, ...) with [9, answer]."""
    return [9, answer] if response[-1] % 4 == 3 else None


def test_an_actor_and_a_rollout_run_the_same_turns_and_the_update_reports_them():
    """Multi-turn on real groups: the environment travels by reference to every rank; a
    2-rank Actor and a 1-rank Rollout with the same weights and seeds give the same rows,
    and the update trains on them, reporting the turns and the environment's tokens."""
    sampling = {"max_new_tokens": 8, "stop_token_ids": list(range(3, 128, 4))}
    multi = {"env": lookup, "max_turns": 3}

    async def main():
        async with asyncrl.Controller() as ctl:
            actor = await ctl.spawn(Actor, {"seed": 4}, rl={"group_size": 4},
                                    sampling=sampling, multi_turn=multi, nprocs=2,
                                    name="actor")
            rollout = await ctl.spawn(Rollout, {"seed": 4}, sampling=sampling,
                                      multi_turn=multi, name="rollout")
            pids = group_pids(actor) + group_pids(rollout)
            prompts = TensorBatch({"prompt": [[1, 2]] * 4 + [[1, 2, 3]] * 4,  # 2 groups
                                   "seed": list(range(8)), "answer": [50] * 4 + [60] * 4})
            mine, theirs = await actor.generate(prompts), await rollout.generate(prompts)
            scores = TensorBatch({"reward": torch.arange(8, dtype=torch.float32)})
            stats = await actor.update(mine, scores)
            with pytest.raises(asyncrl.RemoteError, match="hybrid=False one only trains"):
                await ctl.spawn(Policy, {"seed": 4}, hybrid=False, multi_turn=multi,
                                sampling=sampling, name="trainer")  # (its __init__ refuses it)
        return mine, theirs, stats, pids

    from asyncrl.rl import Actor, Policy, Rollout

    mine, theirs, stats, pids = run(main(), timeout=240)
    assert_gone(pids)
    for key in ("response_ids", "response_mask", "policy_mask", "logprobs", "turns"):
        assert torch.allclose(mine[key].float(), theirs[key].float(), atol=1e-5), key
    env = (mine["response_mask"] * (1 - mine["policy_mask"])).bool()
    assert env.any(), "some turn should have called the environment"
    for i in range(8):
        said = mine["response_ids"][i][env[i]].tolist()
        assert said == ([9, [50, 60][i // 4]] * 4)[:len(said)]
    assert stats["multi_turn/turns"] == pytest.approx(mine["turns"].float().mean().item())
    assert stats["multi_turn/env_tokens"] == pytest.approx(env.sum(1).float().mean().item())
    assert stats["multi_turn/env_truncated"] == 0.0 and mine["env_truncated"].sum() == 0


def test_a_vllm_turn_cut_at_max_model_len_is_not_answered():
    """vLLM ends a request at max_model_len, at any token: the adapter's turn loop took a
    row shorter than its budget for a finished turn, asked the environment, and the next
    turn's prompt, past the limit, failed the whole batch. Later turns' seeds (shifted by
    turn) passed 2**63, past the int64 arrays vLLM keeps them in."""
    import fake_vllm

    from asyncrl.hybrid.vllm_engine import VLLMEngine

    asked = []

    def env(prompt, response, turn, transcript):
        asked.append(turn)
        return [OBSERVED[turn]] if turn < 2 else None

    cfg = SamplingConfig(max_new_tokens=20, stop_token_ids=(127,))  # a stop rarely drawn
    capped = VLLMEngine("tiny-llama", cfg, llm_cls=fake_vllm.LLM, max_model_len=12,
                        sampling_params_cls=fake_vllm.SamplingParams)
    out = turns(env=env, max_turns=3).generate(capped, prompt_batch(), PROMPTS, SEEDS, cfg)
    lengths = out["response_mask"].sum(1)
    assert asked == [] and out["turns"].tolist() == [1] * 4
    assert lengths.tolist() == [12 - len(p) for p in PROMPTS]  # cut at the limit
    # short turns (a third of the vocabulary stops one): three turns, the third's seeds
    # shifted past 2**63
    vllm = VLLMEngine("tiny-llama", cfg, llm_cls=fake_vllm.LLM,
                      sampling_params_cls=fake_vllm.SamplingParams)
    vllm.generate([[1, 2]], [2**64 - 1], cfg)  # a seed of the user's past int64: reduced
    seeds = [2**62 + s for s in SEEDS]
    out = turns(env=env, max_turns=3).generate(vllm, prompt_batch(), PROMPTS, seeds,
                                               replace(cfg, stop_token_ids=STOPS))
    assert int(out["turns"].max()) == 3


def test_multi_turn_without_stop_tokens_is_refused():
    """A turn ends at a stop token: a preset model has none, and its rollouts were single
    turns whose environment was never asked, silently."""
    from asyncrl.rl import Policy

    with pytest.raises(ValueError, match="multi_turn= needs stop tokens"):
        asyncrl.group(Policy, {"preset": "tiny-llama"}, multi_turn={"env": echo})
    _, sampler = engine()
    with pytest.raises(ValueError, match="multi_turn= needs stop tokens"):
        turns(echo).generate(sampler, prompt_batch(), PROMPTS, SEEDS,
                             replace(sampler.config, stop_token_ids=()))


def fails_on_answer_60(prompt, response, answer):
    """As lookup, but raises on the rows whose answer is 60 (rank 1's chunk below)."""
    if answer == 60:
        raise RuntimeError("the tool is down")
    return lookup(prompt, response, answer)


def test_a_generation_failing_on_one_rank_fails_its_peers_and_the_group_goes_on():
    """An environment raising on one rank's rows failed that rank's generate, while its peer
    waited in the prompt width's collective until the collective timeout (the group's next
    calls stuck behind it, and its next collective meeting this one's)."""
    from asyncrl.rl import Rollout

    sampling = {"max_new_tokens": 8, "stop_token_ids": list(range(3, 128, 4))}

    async def main():
        async with asyncrl.Controller(collective_timeout=300.0) as ctl:
            rollout = await ctl.spawn(Rollout, {"seed": 4}, sampling=sampling, nprocs=2,
                                      multi_turn={"env": fails_on_answer_60, "max_turns": 3})
            pids = group_pids(rollout)
            prompts = TensorBatch({"prompt": [[1, 2]] * 4 + [[1, 2, 3]] * 4,
                                   "seed": list(range(8)), "answer": [50] * 4 + [60] * 4})
            with pytest.raises(asyncrl.RemoteError) as e:
                await rollout.generate(prompts)

            def said() -> str:  # either rank's error may come first, the other as a note
                return "\n".join([str(e.value), *getattr(e.value, "__notes__", [])])
            await poll_until(lambda: "the tool is down" in said() and "generate failed on "
                             "another rank of this group" in said(), 30, "both ranks' errors")
            # the group goes on: the same rows without the failing ones
            fine = await rollout.generate(prompts.take(list(range(4)) * 2))
            return pids, fine
    pids, fine = run(main(), timeout=120)
    assert_gone(pids)
    assert len(fine) == 8 and fine["turns"].max() >= 1
