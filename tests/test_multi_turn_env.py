"""Multi-turn rollouts (asyncrl.hybrid.turns): what the environment is given and what its
observations may be, and vLLM's turns within max_model_len (a desk review's findings)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import word_tokenizer
from test_multi_turn import OBSERVED, PROMPTS, SEEDS, STOPS, echo, engine, prompt_batch, turns

from asyncrl.hybrid.sampler import SamplingConfig
from asyncrl.hybrid.turns import CHARS_PER_TOKEN, MultiTurn, Turns, chat_turns

# Qwen2.5's template, reduced: it writes the roles it knows (a tool's output as a user turn)
# and leaves out any other, with no error
QWEN25_LIKE = ("{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
               "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
               "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
               "{{ m['content'] }}\n</tool_response><|im_end|>\n{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def fake_vllm_engine(cfg, **options):
    import fake_vllm

    from asyncrl.hybrid.vllm_engine import VLLMEngine

    return VLLMEngine("tiny-llama", cfg, llm_cls=fake_vllm.LLM,
                      sampling_params_cls=fake_vllm.SamplingParams, **options)


def test_a_chat_message_the_template_leaves_out_is_refused(tmp_path):
    """A Qwen-style template writes only the roles it knows: a tool's output as role
    "function", or with no role, became an observation of the assistant opener alone."""
    t = Turns(MultiTurn(env=echo, tokenizer=str(word_tokenizer(tmp_path / "tok"))))
    tok = t.tok
    tok.chat_template = QWEN25_LIKE
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    said = tok("w7", add_special_tokens=False)["input_ids"] + [
        tok.convert_tokens_to_ids("<|im_end|>")]
    assert chat_turns(tok, [{"role": "tool", "content": "4 2"}], said, "row 0, turn 0") == \
        "\n<|im_start|>user\n<tool_response>\n4 2\n</tool_response><|im_end|>\n" \
        "<|im_start|>assistant\n"
    with pytest.raises(ValueError, match=r"row 1, turn 0: the chat template leaves out the "
                                         r"environment's message with role 'function' .*use a "
                                         r"role the template writes \(a tool's output: 'tool'\)"):
        chat_turns(tok, [{"role": "function", "content": "4 2"}], said, "row 1, turn 0")
    # a template that writes a content escaped (tojson, as Mistral's) writes it all the same
    tok.chat_template = QWEN25_LIKE.replace("{{ m['content'] }}\n</tool",
                                            "{{ m['content'] | tojson }}\n</tool")
    escaped = chat_turns(tok, [{"role": "tool", "content": 'say "4"\n2'}], said, "row 1, turn 0")
    assert '<tool_response>\n"say \\"4\\"\\n2"\n</tool_response>' in escaped
    with pytest.raises(ValueError, match=r"row 2, turn 1: the environment's chat message "
                                         r"\{'result': '4 2'\} needs a str 'role' and a "
                                         r"'content' \(a tool's output: \{'role': 'tool'"):
        t._ids({"result": "4 2"}, 2, 1, said, [0, 0, 0])  # as the env's answer goes


def test_vllm_turns_keep_each_row_within_max_model_len():
    """vLLM's call per turn bounded a row by max_new_tokens alone: a turn ending near
    max_model_len, then its observation, took the next prompt to the limit, and the adapter
    refused the whole batch. A row's budget is now what the limit leaves after its prompt
    (as a single-turn generation's), its last observation cut there; a hybrid engine says its
    vLLM's limit."""
    def six(prompt, response):
        return list(range(100, 106))

    cfg = SamplingConfig(max_new_tokens=20, stop_token_ids=STOPS)
    capped = fake_vllm_engine(cfg, max_model_len=12)
    assert capped.max_model_len == 12
    from asyncrl.hybrid.engine import HybridEngine
    assert HybridEngine.max_model_len.fget(SimpleNamespace(engine=capped)) == 12  # (its vLLM's)
    out = turns(six, max_turns=4).generate(capped, prompt_batch(), PROMPTS, SEEDS, cfg)
    lengths = out["response_mask"].sum(1).tolist()
    assert all(len(p) + k <= 12 for p, k in zip(PROMPTS, lengths, strict=True))
    env = (out["response_mask"] * (1 - out["policy_mask"])).sum(1).tolist()
    assert any(k % 6 for k in env), "some row's last observation should be cut"
    for i, k in enumerate(env):  # whole observations, then the cut one
        said = out["response_ids"][i][(out["response_mask"][i] *
                                       (1 - out["policy_mask"][i])).bool()].tolist()
        assert said == (list(range(100, 106)) * 4)[:k]


class Counting:
    """A tokenizer that records the longest text it is given to tokenize."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, **kw):
        self.longest = max(self.longest, len(text))
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_huge_observation_is_cut_before_it_is_tokenized(tmp_path):
    """A tool's 50 MB output was tokenized whole (seconds a row, in the decode loop), then
    cut to max_observation_tokens; a wrong return's repr was built whole for its error."""
    t = Turns(MultiTurn(env=echo, tokenizer=str(word_tokenizer(tmp_path / "tok")),
                        max_observation_tokens=8))
    ids = lambda text: t.tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    t.tok = counting = Counting(t.tok)
    huge, counted = "w1 w2 " * (50_000_000 // 6), [0]
    assert t._ids(huge, 0, 0, ids("w7 </s>"), counted) == ids("w1 w2 " * 4)
    assert counted == [1] and counting.longest <= 8 * CHARS_PER_TOKEN
    message = {"role": "tool", "content": huge}  # a chat message's content too
    assert t._ids(message, 0, 0, ids("w7 </s>"), counted) == ids(
        "<s> tool w1 w2 w1 </s> <s> assistant")  # 8 tokens, the markers whole
    assert counted == [2] and counting.longest <= 8 * CHARS_PER_TOKEN + 64  # (+ markers)
    with pytest.raises(TypeError, match=r"returned \['x', 'x', 'x', 'x', 'x', 'x', \.\.\.\] "
                                        r"for row 0, turn 0"):
        t._ids(["x"] * 10_000_000, 0, 0, [], counted)


@pytest.mark.parametrize("kind", ["builtin", "vllm"])
def test_the_environment_may_take_the_stop_token_that_ended_the_turn(kind):
    """With a tokenizer the environment reads the turn as text, special tokens left out:
    Llama 3.1's <|eom_id|> (a tool call) and <|eot_id|> (an answer) read alike. `stop` says
    which ended it, under the built-in engine's turns in its loop and vLLM's call a turn."""
    seen = []

    def told(prompt, response, turn, stop):
        seen.append((response[-1], stop))
        return [OBSERVED[turn]] if turn < 2 else None

    cfg = SamplingConfig(max_new_tokens=24, stop_token_ids=STOPS)
    e = engine()[1] if kind == "builtin" else fake_vllm_engine(cfg)
    out = turns(told, max_turns=3).generate(e, prompt_batch(), PROMPTS, SEEDS, cfg)
    assert len(seen) >= 4 and int(out["turns"].max()) == 3
    assert all(stop == last and stop in STOPS for last, stop in seen)


def test_a_prompt_column_named_as_a_turn_value_is_refused():
    """The turn's value silently replaced a records' column of the same name."""
    _, sampler = engine()

    def reads_all(prompt, response, **meta):
        return None

    def answer_only(prompt, response, answer):
        return None

    for env, column in ((echo, "turn"), (echo, "transcript"), (reads_all, "stop")):
        with pytest.raises(ValueError, match=rf"the prompt records have the column\(s\) "
                                             rf"\['{column}'\], and environment "
                                             rf"'{env.__name__}' takes .*rename the column"):
            turns(env).generate(sampler, prompt_batch(**{column: list("abcd")}), PROMPTS,
                                SEEDS, sampler.config)
    # an environment that takes no turn value of that name reads the records as before
    out = turns(answer_only).generate(sampler, prompt_batch(turn=list("abcd"),
                                                            answer=list("abcd")),
                                      PROMPTS, SEEDS, sampler.config)
    assert out["turns"].tolist() == [1] * 4
