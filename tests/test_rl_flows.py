"""GRPO and PPO flows end to end, as `asyncrl launch` runs the examples (real groups)."""

from __future__ import annotations

import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest
from helpers import ROOT, WORDS, cli, launch_example, word_tokenizer

REQUIRED = ["step", "reward/mean", "actor/kl", "actor/pg_loss", "actor/clipfrac",
            "actor/grad_norm", "actor/entropy", "response_length/mean", "perf/tokens_per_s",
            "time/rollout_s", "time/score_s", "time/reference_s"]



def learned(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}


# 5 prompts x 3 samples = 15 rows: two ranks get 8 and 7 (+1 padding row), and a group
# straddles them, so comparing layouts checks the padding and the cross-rank advantages;
# validation after step 1
SMALL = ("prompts=5", "group_size=3", "val_every=2")


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """GRPO with the actor on two FSDP ranks, 3 steps: the run the others must equal."""
    return launch_example("grpo_tiny.py", tmp_path_factory.mktemp("grpo") / "two", 3, *SMALL,
                  "actor_procs=2")


def test_grpo_flow_on_two_ranks_equals_one_rank_and_lr0_stays_put(tmp_path, two):
    small = SMALL
    one = launch_example("grpo_tiny.py", tmp_path / "one", 3, *small, "actor_procs=1")
    for key in REQUIRED:
        assert key in one[0], f"metrics.jsonl lacks {key!r}: {sorted(one[0])}"
    for a, b in zip(one, two, strict=True):
        assert learned(a) == pytest.approx(learned(b), rel=1e-4, abs=1e-5)
    assert one[0]["actor/kl"] == 0 and one[-1]["actor/version"] == 3
    moved = [i for i, r in enumerate(one) if r["actor/grad_norm"] > 0]  # a group that differed
    assert moved and moved[0] < 2 and one[moved[0] + 1]["actor/kl"] > 0  # moved the policy
    frozen = launch_example("grpo_tiny.py", tmp_path / "lr0", 3, *small, "lr=0")
    assert all(r["actor/kl"] == 0 for r in frozen)
    assert frozen[moved[0]]["actor/grad_norm"] > 0  # gradients, but no step
    # validation: greedy answers to the ten digits after step 1, those of the initial model
    # when nothing is learned
    assert [i for i, r in enumerate(one) if "val/reward" in r] == [1]
    assert frozen[1]["val/reward"] == pytest.approx(initial_greedy_reward())
    assert frozen[0]["reward/mean"] == one[0]["reward/mean"]  # the same samples at step 0
    # resumes: the ZeRO test below (its resumed run must equal `two`), the PPO test (FSDP
    # actor and critic), test_checkpoint.py and test_recovery.py (this demo, a rank killed)


def test_zero2_actor_equals_fsdp_and_resumes_from_deepspeed_checkpoints(tmp_path, two):
    zero = ("actor_procs=2", "backend=zero2")
    launch_example("grpo_tiny.py", tmp_path / "zero", 1, *SMALL, *zero)
    resumed = launch_example("grpo_tiny.py", tmp_path / "zero", 3, *SMALL, *zero, "--resume")
    assert (tmp_path / "zero/checkpoints/step_000000/actor/train/state").is_dir()
    for a, b in zip(two, resumed, strict=True):
        assert learned(a) == pytest.approx(learned(b), rel=1e-4, abs=1e-6)


def test_ppo_flow_trains_actor_and_critic_side_by_side_and_resumes_exactly(tmp_path):
    rows = launch_example("ppo_tiny.py", tmp_path / "ppo", 3, "prompts=16",
                          "--checkpoint-every", "1")
    for key in [*REQUIRED, "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm",
                "time/values_s", "time/train_actor_s", "time/train_critic_s"]:
        assert key in rows[0], f"metrics.jsonl lacks {key!r}: {sorted(rows[0])}"
    assert rows[0]["critic/values_mean"] == 0  # the value head starts at zero...
    assert rows[2]["critic/values_mean"] != 0  # ...and the critic learns
    assert rows[1]["actor/kl"] != 0  # k1 here: an estimate that may be negative
    # stopped after step 1's checkpoint (step 2's row written, its checkpoint not): resumed,
    # step 2 runs again and must come out the same
    shutil.copytree(tmp_path / "ppo", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_000002")
    resumed = launch_example("ppo_tiny.py", tmp_path / "resumed", 3, "prompts=16", "--resume")
    for a, b in zip(rows, resumed, strict=True):
        assert learned(a) == pytest.approx(learned(b), rel=1e-4, abs=1e-6)


def test_dapo_keeps_groups_whose_rewards_differ_and_resumes_where_its_prompts_were(tmp_path):
    """examples/dapo_tiny.py: each step trains on 16 groups whose rewards differ, drawing
    more prompt batches when the first has too few; its steps come from the flow (no
    --steps). Stopped after step 2's checkpoint and resumed, it draws the same prompts
    (the source's shared position is saved) and comes out the same."""
    run = tmp_path / "dapo"
    out = cli("launch", "examples/dapo_tiny.py", "--run-dir", str(run), "steps=6",
              "--checkpoint-every", "3", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    assert all(r["dapo/kept_groups"] == 16 for r in rows)
    # one batch is enough exactly when none of its 16 groups scored alike
    assert all((r["dapo/rounds"] == 1) == (r["dapo/uniform_groups"] == 0) for r in rows)
    assert rows[0]["dapo/rounds"] > 1  # an untrained policy: most groups all wrong
    # the filter leaves out all-wrong groups: the trained batch scores above the sampled
    assert all(r["reward/mean"] >= r["dapo/sampled_mean"] for r in rows[:3])
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000005")
    out = cli("launch", "examples/dapo_tiny.py", "--run-dir", str(resumed), "--resume",
              timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    again = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows, again, strict=True):
        assert learned(a) == pytest.approx(learned(b), rel=1e-4, abs=1e-6)
    short = cli("launch", "examples/dapo_tiny.py", "--run-dir", str(tmp_path / "short"),
                "steps=2", "max_rounds=1", timeout=300)
    assert short.returncode != 0
    assert "kept" in short.stderr and "after 1 prompt batches" in short.stderr, short.stderr


def test_the_tool_example_runs_turns_and_rewards_only_looked_up_answers(tmp_path):
    """examples/tool_tiny.py, 3 steps: some samples call the tool and get a second turn
    with the observation's two tokens; a reward needs the call, so it never exceeds the
    share of samples with a second turn."""
    rows = launch_example("tool_tiny.py", tmp_path / "tool", 3)
    for r in rows:
        assert 1.0 < r["multi_turn/turns"] < 2.0 and r["multi_turn/env_tokens"] > 0
        assert r["multi_turn/env_truncated"] == 0.0  # the tool's two tokens fit its limit
        assert r["reward/mean"] <= r["multi_turn/turns"] - 1.0 + 1e-9
        assert r["response_length/mean"] <= 5.0


def initial_greedy_reward() -> float:
    """The example's validation score of its untrained policy, computed here."""
    from asyncrl.hybrid.models import ModelConfig, build_model
    from asyncrl.hybrid.sampler import Sampler, SamplingConfig

    next_digit = example_task()
    tok = next_digit.Vocab()
    model = build_model(ModelConfig(**next_digit.model(tok, None, seed=0)))
    data = next_digit.records(tok, copies=1)
    out = Sampler(model, SamplingConfig(temperature=0, max_new_tokens=2, stop_token_ids=(
        tok.eos,))).generate([r["prompt"] for r in data], seeds=[0] * len(data))
    answers = [tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) for ids, mask in
               zip(out["response_ids"].tolist(), out["response_mask"].tolist(), strict=True)]
    return sum(next_digit.score(a, r["answer"]) for a, r in zip(answers, data, strict=True)) / 10


def example_task():
    sys.path.insert(0, str(Path(ROOT) / "examples"))
    try:
        import next_digit
    finally:
        sys.path.pop(0)
    return next_digit


def test_the_example_task_rewards_only_policies_that_read_the_prompt():
    next_digit = example_task()
    tok = next_digit.Vocab()
    data = next_digit.records(tok, copies=3)
    assert {tok.decode(r["prompt"]) for r in data} == {f"{d}>" for d in "0123456789"}
    # a policy that ignores the prompt gives one response distribution to every prompt; its
    # expected reward is a mixture of these constant responses' rewards, so their max bounds it
    outputs = ["", ">", *next_digit.Vocab.chars, *(a + b for a in "0123456789" for b in "0>")]
    best = max(sum(next_digit.score(o, r["answer"]) for r in data) / len(data) for o in outputs)
    assert best <= 0.15
    perfect = [next_digit.score(str((int(tok.decode(r["prompt"])[0]) + 1) % 10), r["answer"])
               for r in data]
    assert sum(perfect) == len(data)
    assert tok.decode(tok.encode("7>")[1:] + [tok.eos, 5]) == "7>"  # stops at eos


def math_task(folder: Path) -> dict:
    """A tiny Llama with a word tokenizer (a chat template) and question files, as a user's
    model directory and data: the settings grpo_math.py needs. Training questions in verl's
    preprocessed Parquet (chats, reward_model.ground_truth), validation in GSM8K's JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    from asyncrl.hybrid.models import tiny_llama

    AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(folder / "model")
    word_tokenizer(folder / "model")
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "openai/gsm8k", "ability": "math",
         "prompt": [{"role": "user", "content": f"w{i} w{i + 1}"}],
         "reward_model": {"style": "rule", "ground_truth": str(i % 10)},
         "extra_info": {"split": "train", "index": i}} for i in range(8)]),
        folder / "train.parquet")
    (folder / "val.jsonl").write_text("".join(  # validation in 2 batches (8 + 2)
        json.dumps({"question": f"w{i} w{i + 1}", "answer": str(i % 10)}) + "\n"
        for i in range(10)))
    return {"model_path": folder / "model", "data": folder / "train.parquet",
            "val_data": folder / "val.jsonl"}


def test_the_math_recipe_trains_a_local_model_on_text_and_exports_it(tmp_path):
    """examples/grpo_math.py as a user runs it on a GPU, with CPU-sized parts: chats
    through the tokenizer's template, rewards on text with the overlong penalty (scored in
    child processes that import examples/gsm8k.py), micro-batches by token budget, validation
    sampled twice per question (pass@k), then export."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task = math_task(tmp_path)
    rows = launch_example("grpo_math.py", tmp_path / "run", 2,
                          *(f"{k}={v}" for k, v in task.items()), "prompts=4",
                          "group_size=2", "max_new_tokens=6", "val_every=2",
                          "max_prompt_length=64", "instruction=####",
                          "max_tokens_per_micro_batch=128", "overlong_buffer=3",
                          "reward_timeout_s=60", "val_samples=2")
    # the reward: the strict score in [0, 1] plus the overlong penalty in [-1, 0]: past 3 of
    # the 6 new tokens, and random responses often run to the limit
    assert all(r["reward/timed_out"] == 0 for r in rows)  # scored in child processes
    assert all(-1 <= r["reward/overlong_penalty"] <= 0 for r in rows)
    assert any(r["reward/overlong_penalty"] < 0 for r in rows)
    assert all(0 <= r["reward/mean"] - r["reward/overlong_penalty"] <= 1 for r in rows)
    assert rows[1]["actor/version"] == 2
    assert [i for i, r in enumerate(rows) if "val/reward" in r] == [1]
    assert 0 <= rows[1]["val/pass@1"] <= rows[1]["val/pass@2"] <= 1  # 2 samples a question
    out = cli("export", str(tmp_path / "run"), str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    # (a random tiny model never writes "#### n": rewards are all 0, so nothing is learned)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    source = AutoModelForCausalLM.from_pretrained(task["model_path"], local_files_only=True)
    assert {k: v.shape for k, v in exported.state_dict().items()} == \
        {k: v.shape for k, v in source.state_dict().items()}
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == \
        AutoTokenizer.from_pretrained(task["model_path"]).chat_template


def test_the_math_recipes_reward_and_stops(tmp_path, monkeypatch):
    """Its reward reads the last "#### <number>" of the text; generation stops where the
    model's generation_config says."""
    from asyncrl.controller.declare import OVERRIDES_ENV

    task = math_task(tmp_path)
    monkeypatch.setenv(OVERRIDES_ENV, json.dumps({k: str(v) for k, v in task.items()}))
    monkeypatch.syspath_prepend(str(Path(ROOT) / "examples"))  # (as `asyncrl launch` does)
    recipe = runpy.run_path(str(Path(ROOT) / "examples" / "grpo_math.py"))
    reward = recipe["reward"]
    # from a module of its own: the reward ranks import it, not the recipe, whose top level
    # loads a tokenizer and reads the datasets
    assert reward.__module__ == "gsm8k"
    assert reward(None, "3 + 4 = 7 #### 7", "7") == 1.0
    assert reward(None, "#### 5 then #### 1,234", "1234") == 1.0  # the last, commas ignored
    assert reward(None, "the answer is 7", "7") == 0.0  # no mark: no reward
    assert reward(None, "#### 8", "7") == 0.0 and reward(None, "#### 7.", "7") == 0.0  # strict
    # GSM8K's worked solutions and verl's parquet records give the same ground truth
    as_chat = recipe["as_chat"]
    gsm8k = as_chat({"question": "q?", "answer": "2 + 3 = <<2+3=5>>5 apples\n#### 1,205"})
    verl = as_chat({"prompt": [{"role": "user", "content": "q?"}], "data_source": "gsm8k",
                    "reward_model": {"ground_truth": "1205", "style": "rule"}})
    assert gsm8k["answer"] == verl["answer"] == "1205"
    assert gsm8k["prompt"] == [{"role": "user", "content": "q? " + recipe["cfg"]["instruction"]}]
    with pytest.raises(SystemExit, match=r"a record has the keys \['problem', 'solution'\]"):
        as_chat({"problem": "q?", "solution": "5"})
    assert recipe["stops"] == [WORDS.index("</s>")]  # tiny_llama's eos_token_id
    missing = cli("launch", "examples/grpo_math.py")
    assert missing.returncode == 1 and "needs model_path=DIR" in missing.stderr
