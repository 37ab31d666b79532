"""A reward function on its own group, fed straight from a generating group's results; on
text with a tokenizer, from prompts a PromptSource tokenized."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import WORDS, assert_gone, group_pids, kill_left, run, wait_until, word_tokenizer

import asyncrl
from asyncrl import TensorBatch
from asyncrl.actors.procs import kill_pids
from asyncrl.controller.launcher import pid_alive
from asyncrl.hybrid.fn_pool import FunctionPool
from asyncrl.rl import PromptSource, RewardFn
from asyncrl.rl.reward import row_inputs, score_rows


def count_answer(prompt, response, answer):
    """1 if the response contains the answer token, else the share of tokens equal to it."""
    return 1.0 if answer in response[:1] else response.count(answer) / max(1, len(response))


def broken(prompt, response, answer):
    return "high"


def rollout_like(n: int) -> TensorBatch:
    ids = torch.tensor([[5, 6, 0], [7, 5, 5], [6, 6, 6], [5, 0, 0]])[:n]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])[:n]
    return TensorBatch({"response_ids": ids, "response_mask": mask,
                        "prompt": [f"q{i}" for i in range(n)], "answer": [5] * n})


def test_score_rows_by_hand():
    assert score_rows(count_answer, rollout_like(4)).tolist() == pytest.approx(
        [1.0, 2 / 3, 0.0, 1.0])
    with pytest.raises(ValueError, match="returned 'high' for row 0; it must return a finite"):
        score_rows(broken, rollout_like(1))

    def picky(prompt, response, answer):  # a reward function's own failure says its row
        if prompt == "q2":
            raise KeyError("no answer key")
        return 1.0
    with pytest.raises(KeyError, match="no answer key") as info:
        score_rows(picky, rollout_like(4))
    assert info.value.__notes__ == ["in reward function 'picky' on row 2 of this rank's rows "
                                    "(prompt 'q2')"]
    # past a float's range: its row named (it was math.isfinite's bare OverflowError)
    with pytest.raises(ValueError, match="returned an int of 1329 bits for row 0; it must"):
        score_rows(lambda p, r: 10 ** 400, rollout_like(1))


def test_numpy_and_torch_scalars_score_in_process_as_in_a_pool(caplog):
    """As a pool's child sends them: a reward computed with numpy scores by default too. A
    column named as the function's own response parameter (a reference answer) is not
    passed again as a keyword (it failed: got multiple values), and said so."""
    def as_numpy(prompt, response, **meta):
        return np.float32(len(response)) if len(response) > 1 else torch.tensor(0.5)

    batch = rollout_like(4)
    batch = batch.union(TensorBatch({"response": ["ref"] * 4}))
    assert score_rows(as_numpy, batch).tolist() == [2.0, 3.0, 3.0, 0.5]
    assert "is not given the column(s) ['response']" in caplog.text
    # positional-only, the function's own names clash with no keyword: the column is passed
    def positional(prompt, response, /, **meta):
        return float(meta["response"] == "ref")

    assert score_rows(positional, batch).tolist() == [1.0] * 4
    # a match as a bool is 1 or 0 (`return answer == truth`: it was refused)
    assert score_rows(lambda p, r: len(r) == 3, rollout_like(4)).tolist() == [0, 1, 1, 0]
    with pytest.raises(ValueError, match=r"returned array\(\[1., 2.\]\) for row 0"):
        score_rows(lambda p, r: np.array([1.0, 2.0]), rollout_like(1))  # not a scalar


def test_overlong_responses_lose_reward_linearly_through_the_buffer():
    """DAPO's soft overlong punishment: past max_length - buffer = 1 token, each token costs
    penalty_factor / buffer = 0.25; the scores keep fn's score and the penalty apart, and the
    actor's batch carries the penalty to its metrics."""
    from asyncrl.rl.batch import assemble

    reward = RewardFn(count_answer, overlong={"max_length": 3, "buffer": 2,
                                              "penalty_factor": 0.5})
    batch = rollout_like(4)  # responses of 2, 3, 3 and 1 tokens
    out = reward.score(batch)
    assert out["overlong_penalty"].tolist() == [-0.25, -0.5, -0.5, 0.0]
    assert out["score"].tolist() == pytest.approx([1.0, 2 / 3, 0.0, 1.0])
    assert out["reward"].tolist() == pytest.approx([0.75, 2 / 3 - 0.5, -0.5, 1.0])
    assert RewardFn(count_answer).score(batch).keys() == ["reward"]
    rollout = batch.union(TensorBatch({"prompt_ids": torch.ones(4, 1, dtype=torch.long),
                                       "prompt_mask": torch.ones(4, 1, dtype=torch.long)}))
    assert torch.equal(assemble(rollout, out)["overlong_penalty"], out["overlong_penalty"])
    with pytest.raises(TypeError, match=r"keys \['buffer', 'max_length', 'penalty_factor'\]"):
        RewardFn(count_answer, overlong={"len": 4})
    with pytest.raises(ValueError, match="1 <= buffer <= max_length"):
        RewardFn(count_answer, overlong={"max_length": 2, "buffer": 3})
    for key, bad in (("penalty_factor", "nan"), ("penalty_factor", "inf"), ("max_length", "inf")):
        with pytest.raises(ValueError, match=f"{key} must be a finite number, got {bad}"):
            RewardFn(count_answer, overlong={"max_length": 8, "buffer": 4, key: float(bad)})


def test_an_overlong_penalty_past_max_length_stays_at_the_penalty_factor():
    """max_length=100 with 256-token responses (an evaluation generating more than training's
    max_new_tokens): a full response lost 8.8 x penalty_factor, past the -penalty_factor the
    buffer promises; now it loses penalty_factor, and the batch is scored."""
    from asyncrl.rl.reward import Overlong

    reward = RewardFn(count_answer, overlong={"max_length": 100, "buffer": 20})
    wide = TensorBatch({"response_ids": torch.full((2, 256), 5),
                        "response_mask": (torch.arange(256) < torch.tensor([[90], [256]])).long(),
                        "prompt": ["q0", "q1"], "answer": [5, 5]})
    assert reward.score(wide)["overlong_penalty"].tolist() == [-0.5, -1.0]
    fits = RewardFn(count_answer, overlong={"max_length": 256, "buffer": 20}).score(wide)
    assert fits["overlong_penalty"].tolist() == [0.0, -1.0]
    penalty = Overlong(max_length=100, buffer=20, penalty_factor=2.0).penalty(
        torch.tensor([80, 90, 100, 300]), 300)
    assert penalty.tolist() == [0.0, -1.0, -2.0, -2.0]


def test_a_reward_models_nan_score_is_refused_naming_the_rows():
    """A RewardFn's NaN was refused, a reward model's went on: whitened, one NaN score made
    every advantage of a PPO batch NaN."""
    from asyncrl.rl import RewardModel

    rm = RewardModel.__new__(RewardModel)
    rm.__init__({"seed": 5})
    batch = TensorBatch({"prompt_ids": torch.tensor([[0, 5, 6], [9, 13, 14]]),
                         "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
                         "response_ids": torch.tensor([[7, 11], [15, 0]]),
                         "response_mask": torch.tensor([[1, 1], [1, 0]])})
    assert rm.score(batch)["reward"].isfinite().all()
    with torch.no_grad():
        rm.model.value_head.bias.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"RewardModel scored \[nan, nan\] for row\(s\) "
                                         r"\[0, 1\] of this rank's 2 rows; a reward must be a "
                                         r"finite number"):
        rm.score(batch)


def verifier(prompt, response, answer):
    """Scores the response length (a numpy float); hangs on answer 9 (a verifier stuck on
    one answer), on 8 in a sandbox process it started (its pid written where the test says),
    and fails on 7."""
    if answer in (8, 88):  # 88: in a session of its own (as sandboxes start theirs)
        sandbox = subprocess.Popen(["sleep", "3600"], start_new_session=answer == 88)
        Path(os.environ["ASYNCRL_TEST_SANDBOX"]).write_text(str(sandbox.pid))
        sandbox.wait()
    if answer == 9:
        threading.Event().wait()  # forever
    if answer == 66:  # a tool run on the row, reading its stdin: it must find it empty
        tool = subprocess.run([sys.executable, "-c", "import sys; print(sys.stdin.read())"],
                              capture_output=True, timeout=60)
        return np.float64(len(tool.stdout.strip()))
    if answer == 7:
        raise ArithmeticError("cannot parse the answer")
    if answer == 11:  # a crash in native code (a segfault, the OOM killer)
        os.kill(os.getpid(), signal.SIGSEGV)
    print("this print goes to the log, not into the frames")
    return np.float64(len(response))


@pytest.mark.parametrize("timeout_s", [30.0, None])
def test_a_row_whose_scorer_a_signal_killed_is_reported_as_crashed(timeout_s, caplog):
    """The pool scored such a row as timed out and marked it crashed; the scores said
    timed_out alone (`reward/crashed` now tells a segfaulting verifier from a slow one), and
    the log that it "ran past None s" (with no timeout_s)."""
    reward = RewardFn(verifier, processes=1, timeout_s=timeout_s, timeout_score=-1.0)
    try:
        with caplog.at_level("WARNING", logger="asyncrl"):
            scores = reward.score(answers(1, 11, 2))
    finally:
        pids = reward.scorer_pids()
        reward.on_close()
    assert_gone(pids)
    assert scores["reward"].tolist() == [1.0, -1.0, 3.0]
    assert scores["timed_out"].tolist() == scores["crashed"].tolist() == [0.0, 1.0, 0.0]
    assert "reward function 'verifier' crashed (its process killed by a signal" in \
        caplog.text and "ran past" not in caplog.text


def logged_length(prompt, response, answer):
    """The response length, each call noted in the file the test names (a paid judge)."""
    with open(os.environ["ASYNCRL_TEST_CALLS"], "a") as f:
        f.write(f"{answer}\n")
    return float(len(response))


def answers(*values: int) -> TensorBatch:
    n = len(values)
    return TensorBatch({"response_ids": torch.ones(n, 3, dtype=torch.long),
                        "response_mask": torch.tensor([[1] * (i % 3 + 1) + [0] * (2 - i % 3)
                                                       for i in range(n)]),
                        "prompt": [[1]] * n, "answer": list(values)})


def test_a_scorer_pool_times_out_a_hung_row_and_replaces_its_process(tmp_path, monkeypatch):
    sandbox = tmp_path / "sandbox.pid"
    monkeypatch.setenv("ASYNCRL_TEST_SANDBOX", str(sandbox))
    pool = FunctionPool(verifier, processes=2, timeout_s=1.0)
    spare = pool.spare_pid
    seen = pool.pids() + [spare]
    pool._spare.started -= 1_000  # a spare made long ago (a pool 17 min into a run): taken
    # in, it is not "late starting" (its start timeout counted from its creation)
    try:
        values, late = pool.call(row_inputs(verifier, answers(1, 9, 2, 3, 4)))
        assert late == [False, True, False, False, False]
        assert values == [1.0, None, 3.0, 1.0, 2.0]  # each row's own answer, in order
        replaced = [p for p in seen if p not in pool.pids() and p != spare]
        assert len(replaced) == 1 and not pid_alive(replaced[0])  # the hung one: killed
        # its place taken by the spare started ahead (imports done), and a new spare made
        assert spare in pool.pids() and pool.spare_pid not in seen
        seen += pool.pids() + [pool.spare_pid]
        # a sandbox the function started goes with its process, even from a session of
        # its own (the group's kill missed it)
        for answer in (8, 88):  # (each writes its own pid: 88 never reads 8's)
            sandbox.unlink(missing_ok=True)
            assert pool.call(row_inputs(verifier, answers(answer)))[1] == [True]
            assert_gone([int(sandbox.read_text())])
        seen += pool.pids()
        with pytest.raises(ValueError, match=r"(?s)failed on row 1:.*ArithmeticError: cannot "
                                             r"parse the answer"):
            pool.call(row_inputs(verifier, answers(1, 7, 2, 3)))
        seen += pool.pids()
        # the next call starts clean: no answer of the failed call comes back in it
        assert pool.call(row_inputs(verifier, answers(1, 2, 3))) == ([1.0, 2.0, 3.0],
                                                                       [False] * 3)
        # what the function starts reads nothing from the job pipe (it waited there for a
        # frame that never came while its row ran: the row timed out)
        assert pool.call(row_inputs(verifier, answers(66))) == ([0.0], [False])
        untimed = FunctionPool(verifier, processes=1, timeout_s=None)
        try:
            seen += untimed.pids()
            assert untimed.spare_pid is None  # nothing is ever replaced on a timeout there
            assert untimed.call(row_inputs(verifier, answers(5, 6))) == ([1.0, 2.0],
                                                                          [False] * 2)
        finally:
            untimed.close()
    finally:
        kill_left(sandbox, f"ASYNCRL_TEST_SANDBOX={sandbox}")  # (a sleep 3600 left by a failure)
        seen += pool.pids() + [pool.spare_pid]
        pool.close()
    assert_gone(seen)


def test_a_scorer_process_killed_while_idle_costs_no_row():
    """Killed between calls (out of memory): the next call replaces it and scores every
    row (it failed whole on a broken pipe)."""
    import signal

    pool = FunctionPool(verifier, processes=2, timeout_s=None)
    seen = pool.pids()
    try:
        jobs = row_inputs(verifier, answers(1, 2, 3))
        assert pool.call(jobs) == ([1.0, 2.0, 3.0], [False] * 3)
        for c in pool.children:  # both: the first one given a row is dead whichever it is
            os.kill(c.pid, signal.SIGKILL)
            c.wait()
        assert pool.call(jobs) == ([1.0, 2.0, 3.0], [False] * 3)
        assert not set(pool.pids()) & set(seen)
        seen += pool.pids()
    finally:
        seen += pool.pids()
        pool.close()
    assert_gone(seen)


def crashes_beside_a_helper(prompt, response, answer):
    """Crashes on answer 2, after forking a helper (a multiprocessing pool's worker: it holds
    the job pipes open, and never ends on its own), its pid written where the test says."""
    if answer == 2:
        helper = mp.get_context("fork").Process(target=threading.Event().wait, daemon=True)
        helper.start()
        Path(os.environ["ASYNCRL_TEST_SANDBOX"]).write_text(str(helper.pid))
        os.kill(os.getpid(), signal.SIGSEGV)
    return float(answer)


@pytest.mark.timeout(90)  # (for ever before, with no timeout_s: the helper never ends)
@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_a_scorer_crashing_beside_a_helper_it_forked_is_seen_at_once(tmp_path, monkeypatch,
                                                                     timeout_s):
    """Its crash is seen in its process's exit: its pipe's EOF, which the helper withheld,
    was waited for (as long as the helper lived). Its row counts as timed out (a crash by
    a signal), the others keep their scores, and the helper goes with it."""
    helper = tmp_path / "helper.pid"
    monkeypatch.setenv("ASYNCRL_TEST_SANDBOX", str(helper))
    pool = FunctionPool(crashes_beside_a_helper, processes=1, timeout_s=timeout_s)
    seen = pool.pids()
    try:
        assert pool.call(row_inputs(crashes_beside_a_helper, answers(1, 2, 3))) == \
            ([1.0, None, 3.0], [False, True, False])
        assert pool.crashed == [False, True, False]
        seen.append(int(helper.read_text()))
        assert_gone(seen)  # the helper too, before the pool is closed
    finally:
        kill_left(helper, f"ASYNCRL_TEST_SANDBOX={helper}")  # (it never ends on its own)
        seen += pool.pids() + ([pool.spare_pid] if pool.spare_pid is not None else [])
        pool.close()
    assert_gone(seen)


def exits(prompt, response, answer):
    """Ends as a script does on answer 2 (sys.exit), 3 and 4 (other BaseExceptions)."""
    if answer == 2:
        sys.exit(3)
    if answer == 3:
        raise KeyboardInterrupt
    if answer == 4:
        raise GeneratorExit
    return float(answer)


def test_a_reward_function_calling_sys_exit_fails_its_row_and_ends_no_process():
    """In a pool it ended its process (an "exited with 3", the log empty, a process spent);
    in the rank's own, the rank's call (naming no row). Both name the row alike (the pool's
    said "row 1" alone)."""
    row = r"row 1 of this rank's rows \(prompt '\[1\]'\)"
    for answer, raised in ((2, r"SystemExit\(3\)"), (3, r"KeyboardInterrupt\(\)"),
                           (4, r"GeneratorExit\(\)")):
        with pytest.raises(RuntimeError, match=rf"reward function 'exits' raised {raised} on "
                                                rf"{row}; a reward function returns a number"):
            score_rows(exits, answers(1, answer))
    reward = RewardFn(exits, processes=1)
    seen = reward.scorer_pids()
    try:
        for answer, raised in ((2, "SystemExit: 3"), (3, "KeyboardInterrupt"),
                               (4, "GeneratorExit")):
            with pytest.raises(ValueError, match=rf"(?s)'exits' failed on {row}:.*{raised}"):
                reward.score(answers(1, answer))
        assert reward.scorer_pids() == seen  # it served on
        assert reward.score(answers(1, 5))["reward"].tolist() == [1.0, 5.0]
    finally:
        reward.on_close()
    assert_gone(seen)


def test_a_row_msgpack_cannot_carry_fails_naming_it_and_keeps_the_process():
    """An int past 64 bits, a lone surrogate: msgpack's bare OverflowError or
    UnicodeEncodeError came out, and the process never sent the row was replaced."""
    pool = FunctionPool(verifier, processes=1, timeout_s=None)
    seen = pool.pids()
    try:
        for bad in (([1], [1, 2], {"answer": 2 ** 70}), ("\ud800", [1, 2], {"answer": 1})):
            with pytest.raises(TypeError, match="reward function 'verifier': row 1: the "
                                                "prompt, response or meta cannot go to its "
                                                "process: "):
                pool.call([([1], [1], {"answer": 1}), bad])
        assert pool.pids() == seen
        assert pool.call([([1], [1, 2], {"answer": 1})]) == ([2.0], [False])
    finally:
        pool.close()
    assert_gone(seen)


def sums_answer(prompt, response, answer):
    return float(sum(answer))


def test_a_records_numeric_array_reaches_a_pools_process_as_a_list():
    """A record's numeric array stays an array in this process (tokens.plain); the pool's
    frames refused it, failing every call ("a ndarray cannot be sent")."""
    arrays = TensorBatch({"answer": [np.array([1, 2]), np.array([3])]})
    batch = rollout_like(2).select(["prompt", "response_ids", "response_mask"]).union(arrays)
    pool = FunctionPool(sums_answer, processes=1, timeout_s=None)
    try:
        assert pool.call(row_inputs(sums_answer, batch))[0] == \
            score_rows(sums_answer, batch).tolist() == [3.0, 3.0]
    finally:
        pool.close()


@pytest.mark.timeout(120)  # (a call on a closed pool waited for ever)
def test_a_closed_scorer_pool_refuses_calls_and_fails_the_one_it_cut_short():
    """close() from another thread (a rank closing under a score): the call under way fails
    saying so, rather than blaming a row with its killed process's exit; later calls and
    replacements are refused (one started a process nobody stopped)."""
    from asyncrl.errors import ClosedError

    pool = FunctionPool(verifier, processes=1, timeout_s=None)
    seen, failed = pool.pids(), []

    def score():
        try:
            pool.call(row_inputs(verifier, answers(1, 9)))  # row 1 hangs
        except Exception as e:  # noqa: BLE001 - the test reads it
            failed.append(e)
    caller = threading.Thread(target=score, daemon=True)
    caller.start()
    try:
        wait_until(lambda: pool.children[0].row == 1, 60, "row 1 to be sent")
    finally:
        pool.close()
    caller.join(30)
    assert not caller.is_alive() and len(failed) == 1
    assert isinstance(failed[0], ClosedError) and isinstance(failed[0], RuntimeError), \
        repr(failed[0])  # (RuntimeError: as before, ClosedError: as the groups say it)
    assert str(failed[0]) == ("reward function 'verifier': the pool was closed (its group "
                              "closing) while a call ran; 1 of its 2 rows were not done")
    assert_gone(seen)
    assert pool.children == [] and pool.spare_pid is None
    with pytest.raises(ClosedError, match=r"'verifier': call\(\) on a closed pool"):
        pool.call(row_inputs(verifier, answers(1)))
    with pytest.raises(ClosedError, match="the pool was closed; no process starts"):
        pool._fresh()
    pool.close()  # again: nothing to do


def test_a_reward_group_scores_hung_rows_with_the_timeout_score_and_leaves_no_process():
    async def main():
        async with asyncrl.Controller() as ctl:
            reward = await ctl.spawn(RewardFn, verifier, processes=2, timeout_s=1.0,
                                     timeout_score=-1.0, nprocs=1, name="reward")
            scorers = (await reward.scorer_pids())[0]
            scores = await reward.score(answers(1, 9, 2))
            pids = group_pids(reward) + scorers + (await reward.scorer_pids())[0]
            await ctl.close_group(reward)
            return scores, pids
    scores, pids = run(main(), timeout=120)
    assert_gone(pids)  # the rank, its scoring processes and their replacements
    assert scores["reward"].tolist() == [1.0, -1.0, 3.0]
    assert scores["timed_out"].tolist() == [0.0, 1.0, 0.0]
    assert scores["crashed"].tolist() == [0.0, 0.0, 0.0]  # (hung, not killed by a signal)
    for bad in ({"timeout_s": 0}, {"timeout_s": float("nan")}, {"processes": None},
                {"timeout_score": True}):
        with pytest.raises(ValueError, match="processes must be an int >= 0, timeout_s"):
            RewardFn(verifier, **bad)


class Producer(asyncrl.Worker):
    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def rollout(self, index: TensorBatch) -> TensorBatch:
        return rollout_like(4).slice(int(index["i"][0]), int(index["i"][-1]) + 1)


def test_reward_group_scores_rows_pulled_from_another_group():
    async def main():
        async with asyncrl.Controller() as ctl:
            producer = await ctl.spawn(Producer, nprocs=2)
            reward = await ctl.spawn(RewardFn, count_answer, nprocs=1, name="reward")
            pids = group_pids(producer) + group_pids(reward)
            scores = await reward.score(producer.rollout(TensorBatch({"i": torch.arange(4)})))
            assert ctl.payload_bytes == 0
            return scores, pids
    scores, pids = run(main())
    assert_gone(pids)
    assert scores["reward"].tolist() == pytest.approx([1.0, 2 / 3, 0.0, 1.0])


def says_the_answer(prompt, response, answer):
    """Text in (no raw_prompt parameter: a column it does not name is not passed): 1 when the
    response is the answer, 0.5 more when the prompt is w1 (special tokens left out)."""
    return float(response == answer) + (0.5 if prompt == "w1" else 0.0)


def test_a_reward_function_reads_text_with_a_tokenizer(tmp_path):
    from asyncrl.hybrid.user_fn import load_tokenizer

    tok = load_tokenizer(str(word_tokenizer(tmp_path / "tok")))
    w = WORDS.index
    batch = TensorBatch({"response_ids": torch.tensor([[w("w5"), w("</s>"), 0], [w("w6"),
                                                                                 w("w5"), 0]]),
                         "response_mask": torch.tensor([[1, 1, 0], [1, 1, 0]]),
                         "prompt": [[w("<s>"), w("w1")], [w("w2")]],
                         "raw_prompt": ["w1", "w9"], "answer": ["w5", "w5"]})
    # special tokens left out of both; the prompt decoded from its ids
    assert score_rows(says_the_answer, batch, tok).tolist() == [1.5, 0.0]
    seen = []
    score_rows(lambda prompt, response, **meta: seen.append((prompt, response, meta)) or 0.0,
               batch, tok)
    assert seen[0] == ("w1", "w5", {"raw_prompt": "w1", "answer": "w5"})  # **meta: every one
    with pytest.raises(TypeError, match=r"takes \['solution'\], which the batch has no "
                                        r"column for; its columns: \['raw_prompt', 'answer'\]"):
        score_rows(lambda prompt, response, solution: 0.0, batch, tok)
    with pytest.raises(TypeError, match=r"RewardFn\(tokenizer=\) is a local tokenizer "
                                        "directory"):
        RewardFn(says_the_answer, tokenizer=tok)


def test_a_reward_parameter_no_column_fills_is_warned_of(caplog):
    """A misspelt parameter with a default would score every row with the default: said."""
    def misspelt(prompt, response, answr=None):
        return float(answr is not None)

    assert score_rows(misspelt, rollout_like(2)).tolist() == [0.0, 0.0]
    assert "reward function 'misspelt' gets no column for ['answr'] (they keep their " \
           "defaults) while the columns ['answer'] go unused" in caplog.text
    # the first two parameters are the prompt and the response, whatever their names
    assert score_rows(lambda raw_prompt, text, answer: float(answer), rollout_like(1)
                      ).tolist() == [5.0]
    # or a *args takes them: the keywords after it are columns (it was given none)
    assert score_rows(lambda *texts, answer: float(answer), rollout_like(1)).tolist() == [5.0]
    assert score_rows(lambda prompt, *rest, answer: float(answer), rollout_like(1)
                      ).tolist() == [5.0]


def test_text_prompts_are_generated_from_and_scored_as_text(tmp_path):
    """A local model with its tokenizer: chat prompts tokenized by the PromptSource, generated
    from by a Policy, scored by a RewardFn that loads the tokenizer on its rank."""
    from transformers import AutoModelForCausalLM

    from asyncrl.hybrid.models import tiny_llama
    from asyncrl.hybrid.roles import Policy

    model_dir = tmp_path / "model"
    AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(model_dir)
    word_tokenizer(model_dir)
    chats = [[{"role": "user", "content": f"w{i} w{i + 1}"}] for i in range(4)]
    source = PromptSource([{"prompt": c, "answer": f"w{i}"} for i, c in enumerate(chats)],
                          batch_size=4, shuffle=False, repeat=2, tokenizer=str(model_dir))
    prompts = next(iter(source))

    async def main():
        async with asyncrl.Controller() as ctl:
            policy, reward = await asyncio.gather(
                ctl.spawn(Policy, {"path": str(model_dir)}, None,
                          {"max_new_tokens": 3, "temperature": 1.0}, nprocs=2, name="policy"),
                ctl.spawn(RewardFn, echo_reward, tokenizer=str(model_dir), name="reward"))
            pids = group_pids(policy) + group_pids(reward)
            rollout = policy.generate(prompts)
            return await rollout, await reward.score(rollout), pids
    rollout, scores, pids = run(main(), timeout=240)
    assert_gone(pids)
    assert rollout["raw_prompt"] == [c for c in chats for _ in range(2)]
    words = WORDS[3:]  # what the reward saw: the rollout's tokens as text, no special tokens
    want = [float(len([t for t, m in zip(ids, mask, strict=True) if m and WORDS[t] in words]))
            for ids, mask in zip(rollout["response_ids"].tolist(),
                                 rollout["response_mask"].tolist(), strict=True)]
    assert scores["reward"].tolist() == want and sum(want) > 0


def echo_reward(prompt, response, answer, raw_prompt):
    """The number of words in the response text, once the prompt's text checks out."""
    assert prompt.startswith(f"user {raw_prompt[0]['content']}"), (prompt, raw_prompt)
    return float(len(response.split()))


@pytest.mark.parametrize("answer", [8, 88])
def test_what_a_scorer_started_goes_when_its_rank_is_killed(tmp_path, answer):
    """A rank SIGKILLed (a group's teardown, the OOM killer) took its scorer processes with
    it, but not what they had started (a sandbox, a tool's server), which left the rank's
    session with them: it ran on after every restart. 88: the sandbox in a session of its
    own (out of the scorer's process group)."""
    sandbox = tmp_path / "sandbox.pid"
    rank = ("import os, signal, sys, threading, time\n"
            "sys.path.insert(0, 'tests')\n"
            "from test_rl_reward import answers, verifier\n"
            "from asyncrl.hybrid.fn_pool import FunctionPool\n"
            "from asyncrl.rl.reward import row_inputs\n"
            "pool = FunctionPool(verifier, processes=1, timeout_s=None)\n"
            "print(pool.pids()[0], flush=True)\n"
            f"threading.Thread(target=pool.call, args=(row_inputs(verifier, answers({answer})),),\n"
            "                 daemon=True).start()\n"
            "while not os.path.exists(os.environ['ASYNCRL_TEST_SANDBOX']):\n"
            "    time.sleep(0.01)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    with open(tmp_path / "stderr", "w") as err:  # (a file: what it started holds no pipe)
        out = subprocess.run([sys.executable, "-c", rank], stdout=subprocess.PIPE, stderr=err,
                             text=True, timeout=120, cwd=Path(__file__).parent.parent,
                             env={**os.environ, "ASYNCRL_TEST_SANDBOX": str(sandbox)})
    started = int(sandbox.read_text())
    try:
        assert out.returncode == -9, (tmp_path / "stderr").read_text()
        assert_gone([int(out.stdout.split()[0]), started])
    except BaseException:
        kill_pids([started])  # (left by the failure: not for the next test)
        raise


def test_a_reward_function_is_not_called_on_a_chunks_padding_rows(tmp_path, monkeypatch):
    """3 rows on 2 reward ranks: rank 1 got its row and a padding copy of it, and the
    function (a paid judge, a tool with side effects) ran on both."""
    calls = tmp_path / "calls"
    monkeypatch.setenv("ASYNCRL_TEST_CALLS", str(calls))

    async def main():
        async with asyncrl.Controller() as ctl:
            reward = await ctl.spawn(RewardFn, logged_length, nprocs=2, name="judge")
            scores = await reward.score(answers(1, 2, 3))
            return scores, group_pids(reward)
    scores, pids = run(main())
    assert_gone(pids)
    assert scores["reward"].tolist() == [1.0, 2.0, 3.0]
    assert sorted(calls.read_text().split()) == ["1", "2", "3"]
