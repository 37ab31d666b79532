"""Multi-turn rollouts (asyncrl.hybrid.turns): the token ids an observation becomes (within
the model's vocabulary, whatever made them; arrays and tuples in this process as through
the pool), a turn's end marker, and an environment whose process a signal kills."""

from __future__ import annotations

import logging
import os
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import assert_gone, word_tokenizer
from test_multi_turn import OBSERVED, PROMPTS, SEEDS, STOPS, echo, engine, prompt_batch, turns
from test_multi_turn_env import fake_vllm_engine
from tokenizers import AddedToken

from asyncrl.hybrid.engine import HybridEngine
from asyncrl.hybrid.sampler import SamplingConfig
from asyncrl.hybrid.turns import MultiTurn, Turns, chat_turns


def past_the_vocabulary(prompt, response):
    return [128]  # the tiny models' vocabulary is 0..127


def test_the_vllm_engine_says_its_vocabulary_and_an_observation_past_it_is_refused():
    """vLLM's engine said no vocabulary: an id past it reached the next turn's call, which
    blamed "prompt 0", or, the observation filling the row's budget, the response (and the
    trainer's embedding)."""
    cfg = SamplingConfig(max_new_tokens=24, stop_token_ids=STOPS)
    vllm = fake_vllm_engine(cfg)
    refused = (r"environment 'past_the_vocabulary' returned token ids outside the model's "
               r"vocabulary of 128 \(\[128\]\) for row 0, turn 0; return ids in \[0, 128\)")
    with pytest.raises(ValueError, match=refused):
        turns(past_the_vocabulary).generate(vllm, prompt_batch(), PROMPTS, SEEDS, cfg)
    # a one-token turn (every token stops one), then the observation fills the budget
    filled = SamplingConfig(max_new_tokens=2, stop_token_ids=tuple(range(128)))
    with pytest.raises(ValueError, match=refused):
        turns(past_the_vocabulary).generate(fake_vllm_engine(filled), prompt_batch(), PROMPTS,
                                            SEEDS, filled)
    assert vllm.vocab_size == 128
    assert HybridEngine.vocab_size.fget(SimpleNamespace(engine=vllm)) == 128  # (its vLLM's)


@pytest.mark.parametrize("shape", ["text", "chat"])
def test_text_and_chat_observations_tokenized_past_the_vocabulary_are_refused(tmp_path, shape):
    """The tokenizer's ids were never checked: one it has and the model lacks (an added
    special token) failed deep in the decode loop, torch's IndexError naming nothing."""
    from transformers import AutoTokenizer

    folder = word_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})  # id 128
    tok.save_pretrained(folder)

    def tool(prompt, response):
        said = "w1 <|tool|>"
        return said if shape == "text" else {"role": "tool", "content": said}

    _, sampler = engine()
    t = Turns(MultiTurn(env=tool, tokenizer=str(folder)))
    what = "text" if shape == "text" else "chat messages"
    with pytest.raises(ValueError, match=rf"environment 'tool' returned {what} whose token ids "
                                         rf"\(multi_turn's tokenizer's\) are outside the model's "
                                         rf"vocabulary of 128 \(\[128\]\) for row 0, turn 0; "
                                         rf"give multi_turn the model's own tokenizer"):
        t.generate(sampler, prompt_batch(), PROMPTS, SEEDS, sampler.config)


def test_a_turn_stopped_at_another_stop_token_loses_the_templates_end_of_turn(tmp_path):
    """Llama 3.1 stops a tool call at <|eom_id|>, and its template closes the assistant's
    turn with <|eot_id|>: the transcript had both. Stopped at one of the sampling's stop
    tokens, the turn holds the template's marker that is another of them."""
    t = Turns(MultiTurn(env=echo, tokenizer=str(word_tokenizer(tmp_path / "tok"))))
    tok = t.tok
    # added flagged special, as Llama 3.1's tokenizer has it (not in its special tokens map)
    tok.add_tokens([AddedToken("<|eom|>", special=True)])
    eom, eot = tok.convert_tokens_to_ids("<|eom|>"), tok.convert_tokens_to_ids("</s>")
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    reply, stops = [{"role": "tool", "content": "4 2"}], (eot, eom)
    opened = " <s> tool 4 2 </s> <s> assistant "
    t._stops = stops  # (as a generation sets them): the environment's observation
    assert t._ids(reply, 0, 0, ids("w7") + [eom], [0]) == ids(opened)
    for said in (ids("w7") + [eom], ids("w7") + [eot]):  # a tool call, an answer: alike
        assert chat_turns(tok, reply, said, "row 0, turn 0", stops) == opened
    # cut by the budget (no stop token ended it), or no stops said: the marker is written
    assert chat_turns(tok, reply, ids("w7"), "row 0, turn 0", stops) == " </s>" + opened
    assert chat_turns(tok, reply, ids("w7") + [eom], "row 0, turn 0") == " </s>" + opened
    # stopped at a plain (not special) stop token, a tool's closing tag as Qwen's
    # </tool_call>: the template's end-of-turn marker stays, the turn closed
    call = ids("w9")[0]
    assert chat_turns(tok, reply, ids("w7") + [call], "row 0, turn 0", (eot, call)) == \
        " </s>" + opened


def as_array(prompt, response, turn):
    return np.array([OBSERVED[turn], len(response)]) if turn < 2 else None


def as_tensor(prompt, response, turn):
    return torch.tensor([OBSERVED[turn], len(response)]) if turn < 2 else None


def as_list(prompt, response, turn):
    return [OBSERVED[turn], len(response)] if turn < 2 else None


def test_an_in_process_environment_may_return_arrays_tensors_and_tuples(tmp_path):
    """In this process a 1-D numpy array or torch tensor of ids, or a tuple of chat
    messages (which the pool's frames make a list), was refused as if not token ids."""
    _, sampler = engine()
    want = turns(as_list, max_turns=3).generate(sampler, prompt_batch(), PROMPTS, SEEDS,
                                                sampler.config)
    assert int(want["turns"].max()) == 3
    for env in (as_array, as_tensor):
        got = turns(env, max_turns=3).generate(sampler, prompt_batch(), PROMPTS, SEEDS,
                                               sampler.config)
        for key in ("response_ids", "response_mask", "policy_mask", "turns"):
            assert torch.equal(got[key], want[key]), (env.__name__, key)
    t = turns()
    assert t._ids((5, np.int64(6)), 0, 0, [], [0]) == [5, 6]
    for bad in (np.array([[5, 6]]), np.array([5.0, 6.0]), torch.tensor([True])):
        with pytest.raises(TypeError, match=rf"returned .* \(a {type(bad).__name__}\) for row "
                                            rf"0, turn 0: it returns an observation as token "
                                            rf"ids.*1-D integer array"):
            t._ids(bad, 0, 0, [], [0])
    chat = Turns(MultiTurn(env=echo, tokenizer=str(word_tokenizer(tmp_path / "tok"))))
    said = chat.tok("w7 </s>", add_special_tokens=False)["input_ids"]
    messages = [{"role": "tool", "content": "4"}, {"role": "user", "content": "2"}]
    assert chat._ids(tuple(messages), 0, 0, said, [0]) == chat._ids(messages, 0, 0, said, [0])


def killed_on_row_1(prompt, response, turn):
    """Its process killed by a signal (a segfault, the OOM killer) on row 1 (prompt [1, 7])."""
    if prompt[-1] == 7:
        os.kill(os.getpid(), signal.SIGKILL)
    return [OBSERVED[turn]] if turn < 2 else None


def test_an_environment_process_killed_with_no_timeout_marks_its_row(caplog):
    """With no timeout_s the row read as the environment's "done", trained as a finished
    trajectory: env_timeouts was kept for a timeout, and nothing said it crashed."""
    _, sampler = engine()
    t = turns(killed_on_row_1, max_turns=3, processes=1)
    try:
        first = t.pool.pids()
        with caplog.at_level(logging.WARNING, logger="asyncrl"):
            out = t.generate(sampler, prompt_batch(), PROMPTS[:3], SEEDS[:3], sampler.config)
        pids = first + t.pool.pids()
    finally:
        t.close()
    assert_gone(pids)
    assert out["env_timeouts"].tolist() == [0, 1, 0]
    assert int(out["turns"][1]) == 1 and out["policy_mask"][1].equal(out["response_mask"][1])
    assert int(out["turns"].max()) > 1  # the others went on
    assert "environment 'killed_on_row_1' crashed (its process killed by a signal" in \
        caplog.text and "on 1 of 3 rows" in caplog.text and "ran past" not in caplog.text
