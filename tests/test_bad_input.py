"""The bad-input catalogue (issue 9): each mistake a user can make gets an error that names
what is wrong and how to fix it, and loses nothing. Each entry and its test(s):

| #  | bad input                  | raised as       | test
|----|----------------------------|-----------------|-----------------------------------------------
| 1  | flow file: syntax error,   | `launch` exits  | test_broken_flow_file_names_file_line_and_fix
|    | import error               | 1, no traceback |
| 2  | unknown names: an input,   | FlowError       | test_graph_errors_name_the_node_and_the_fix
|    | follows=, inputs=, a node  |                 |   (rows "unknown ..." and more);
|    | for run_node               |                 | test_run_node_unknown_node_or_missing_inputs
| 3  | cycles between nodes       | FlowError       | test_cycles_are_refused_with_the_cycle
| 4  | missing inputs             | FlowError       | test_graph_errors_name_the_node_and_the_fix
|    |                            |                 |   (rows "missing ..."); test_run_node_...
| 5  | impossible placement: too  | PlacementError; | test_impossible_gpu_placement_says_the_fix
|    | few GPUs, conflicts; too   | a warning on a  | test_too_few_cores_warn_and_share
|    | few cores                  | CPU-only host;  | test_a_flow_that_cannot_be_placed_fails_
|    |                            | no group starts |   before_any_group_starts
| 6  | unregistered method        | AttributeError  | test_unregistered_method_names_the_decorator
| 7  | unencodable argument (file,| EncodeError,    | test_unencodable_argument_named_not_sent
|    | lambda, local def, lock)   | nothing sent    |
| 8  | TensorBatch shards: keys,  | ValueError,     | test_mismatched_batches_name_column_and_fix
|    | lengths, row shapes, kinds | TypeError       | test_dp_call_with_batches_of_different_lengths
| 9  | prompt data: empty, bad    | ValueError,     | test_bad_prompt_data_names_place_and_fix
|    | JSON, not an object, no    | FileNotFound-   | test_bad_prompt_file_stops_launch_untouched
|    | file, suffix, keys         | Error           |
| 10 | checkpoint of another flow,| CheckpointError | test_wrong_checkpoint_is_refused_in_words
|    | --resume with none, a new  | (`launch` exits | test_wrong_resumes_fail_before_anything_starts
|    | run over checkpoints       | 2), no file     |
|    |                            | touched         |

Entries 6-8 that need ranks share one module-scoped group of one rank (`solo`); the CLI
entries run `python -m asyncrl` as a user does. The worker class is defined here: the rank
loads this file by path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, cli

import asyncrl
from asyncrl import TensorBatch
from asyncrl.cli import main as cli_main
from asyncrl.controller import checkpoint
from asyncrl.controller.placement import Host, Placer
from asyncrl.rl import PromptSource


def expect(exc_type: type[BaseException], call: Callable[[], Any], *parts: str) -> str:
    """`call()` raises `exc_type` whose message contains every one of `parts` (what is wrong,
    and the fix); the message."""
    with pytest.raises(exc_type) as info:
        call()
    message = str(info.value)
    for part in parts:
        assert part in message, f"{part!r} is not in the message: {message}"
    return message


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes: to show that a refused command touched none
    (but the run's lock file, which a launch holds while it checks)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


# -- 1. a broken flow file ------------------------------------------------------------------
def test_broken_flow_file_names_file_line_and_fix(tmp_path):
    bad = tmp_path / "bad_syntax.py"
    bad.write_text("import asyncrl\ndef f(:\n    pass\n")
    out = cli("launch", str(bad))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"{bad} is not valid Python: invalid syntax at {bad}:2" in out.stderr
    assert "def f(:" in out.stderr and "fix the file" in out.stderr

    missing = tmp_path / "bad_import.py"
    missing.write_text("import asyncrl\n\nimport no_such_module_xyz\n")
    out = cli("launch", str(missing))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"importing {missing} failed at {missing}:3: ModuleNotFoundError" in out.stderr
    assert "no_such_module_xyz" in out.stderr and "install the missing module" in out.stderr

    # the syntax error is in a module the flow file imports: that module is the one named
    (tmp_path / "broken_helper.py").write_text("x = (1,\n")
    flow = tmp_path / "uses_helper.py"
    flow.write_text("import asyncrl\nimport broken_helper\n")
    out = cli("launch", str(flow))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    helper = tmp_path / "broken_helper.py"
    assert f"{helper} (imported by {flow}) is not valid Python" in out.stderr
    assert f"at {helper}:1" in out.stderr and "fix the file" in out.stderr


# -- 2-4. the graph: unknown names, cycles, missing inputs -----------------------------------
@asyncrl.node
def gen(prompts):
    return prompts


@asyncrl.node
def judge(gen):
    return gen


@asyncrl.node(inputs={"x": "genn"}, name="typo")
def reads_a_typo(x):
    return x


@asyncrl.node(follows="trian", name="rollout")
def follows_a_typo(gen):
    return gen


@pytest.mark.parametrize("build, what, fix", [
    pytest.param(lambda: asyncrl.DataFlow(nodes=[gen, reads_a_typo], inputs={"prompts": 1}),
                 "node 'typo' needs input 'genn', which no node or input provides",
                 "add a node named 'genn'", id="unknown input name"),
    pytest.param(lambda: asyncrl.DataFlow(nodes=[gen, follows_a_typo], inputs={"prompts": 1}),
                 "node 'rollout' follows 'trian', which is not a node of this flow",
                 "nodes: ['gen', 'rollout']", id="unknown follows"),
    pytest.param(lambda: asyncrl.node(inputs={"y": "gen"})(lambda x: x),
                 "inputs= names ['y'], which are not parameters",
                 "its parameters are ['x']", id="unknown parameter in inputs="),
    pytest.param(lambda: asyncrl.DataFlow(nodes=[judge]), "node 'judge' needs input 'gen'",
                 "add a node named 'gen'", id="missing node"),
    pytest.param(lambda: asyncrl.DataFlow(nodes=[gen, judge]),
                 "node 'gen' needs input 'prompts', which no node or input provides",
                 "give the flow an input 'prompts' (DataFlow(inputs=...)), or give the "
                 "parameter a default", id="missing flow input"),
    pytest.param(lambda: asyncrl.DataFlow(nodes=[gen, gen], inputs={"prompts": 1}),
                 "two nodes are named 'gen'", "rename one with @asyncrl.node(name=...)",
                 id="duplicate node"),
    pytest.param(lambda: asyncrl.DataFlow(nodes=[gen], inputs={"prompts": 1, "gen": 2}),
                 "['gen'] name both a flow input and a node", "rename one",
                 id="input and node clash"),
    pytest.param(lambda: asyncrl.DataFlow(nodes=[len]), "is not a node",
                 "decorate it with @asyncrl.node", id="not a node"),
    pytest.param(lambda: asyncrl.DataFlow(nodes=[gen], inputs={"prompts": 1},
                                          max_staleness=-1),
                 "max_staleness must be an int >= 0", "got -1", id="negative staleness"),
])
def test_graph_errors_name_the_node_and_the_fix(build, what, fix):
    expect(asyncrl.FlowError, build, what, fix)


def test_cycles_are_refused_with_the_cycle():
    @asyncrl.node
    def a(b):
        return b

    @asyncrl.node
    def b(a):
        return a

    @asyncrl.node
    def itself(itself):
        return itself

    expect(asyncrl.FlowError, lambda: asyncrl.DataFlow(nodes=[a, b]),
           "nodes form a cycle: a -> b -> a", "use follows= for an edge to the previous step")
    expect(asyncrl.FlowError, lambda: asyncrl.DataFlow(nodes=[itself]),
           "cycle: itself -> itself", "use follows=")


def test_run_node_unknown_node_or_missing_inputs():
    flow = asyncrl.DataFlow(nodes=[gen, judge], inputs={"prompts": [1]})
    expect(asyncrl.FlowError, lambda: asyncio.run(flow.run_node("jugde", {"gen": 1})),
           "no node named 'jugde'", "nodes: ['gen', 'judge']")
    expect(asyncrl.FlowError, lambda: asyncio.run(flow.run_node("judge", {"prompts": 1})),
           "node 'judge' needs inputs ['gen']", "the saved file has ['prompts']")
    assert asyncio.run(flow.run_node("judge", {"gen": 7})) == 7


# -- 5. impossible placement ------------------------------------------------------------------
def test_impossible_gpu_placement_says_the_fix():
    p = Placer(Host(4, (0, 1)))
    assert p.place("actor", 3, asyncrl.nvlink_group(4)).env == {"CUDA_VISIBLE_DEVICES": "0,1,2"}
    expect(asyncrl.PlacementError, lambda: p.place("big", 5, None),
           "group 'big' needs 5 GPU(s), one per rank, but this host has 4",
           "use nprocs <= 4")
    expect(asyncrl.PlacementError, lambda: p.place("rollout", 2, asyncrl.separate_from("actor")),
           "group 'rollout' needs 2 GPU(s) separate_from(actor), but only 1 of this host's 4",
           "use nprocs <= 1", "drop separate_from")
    expect(asyncrl.PlacementError, lambda: p.place("ref", 1, asyncrl.colocate_with("critic")),
           "group 'ref': colocate_with(critic) names a group that is not placed yet",
           "spawn 'critic' first")
    expect(asyncrl.PlacementError, lambda: p.place("wide", 3, asyncrl.nvlink_group(2)),
           "group 'wide': nvlink_group(2) needs its 3 ranks", "use nprocs <= 2",
           "or nvlink_group(3) if this host's NVLink domains are of 3 GPUs or more")
    # conflicting constraints
    expect(asyncrl.PlacementError, lambda: p.place("x", 1, [asyncrl.colocate_with("actor"),
                                                            asyncrl.separate_from("actor")]),
           "group 'x' is placed both colocate_with(actor) and separate_from(actor)",
           "keep one of the two constraints")
    p.place("reward", 1, asyncrl.separate_from("actor"))  # GPU 3
    expect(asyncrl.PlacementError, lambda: p.place("y", 1, [asyncrl.colocate_with("actor"),
                                                            asyncrl.colocate_with("reward")]),
           "group 'y': colocate_with(actor) puts it on GPUs [0, 1, 2], which conflicts with "
           "colocate_with(reward) (on [3])", "drop one of the constraints")
    p.place("hybrid", 3, asyncrl.colocate_with("actor"))  # GPUs 0-2
    expect(asyncrl.PlacementError, lambda: p.place("w", 1, [asyncrl.colocate_with("actor"),
                                                            asyncrl.separate_from("hybrid")]),
           "which conflicts with separate_from(hybrid) (on [0, 1, 2])",
           "drop one of the constraints")
    expect(TypeError, lambda: p.place("z", 1, "separate"),
           "got 'separate'", "place= takes constraints such as asyncrl.separate_from(g)")
    assert set(p.placed) == {"actor", "reward", "hybrid"}  # nothing refused was placed


def test_ranks_share_gpus_only_when_asked():
    one = Placer(Host(1, (0, 1)))
    expect(asyncrl.PlacementError, lambda: one.place("prod", 2, None),
           "group 'prod' needs 2 GPU(s), one per rank, but this host has 1",
           "or place=asyncrl.share_gpus(k) for k ranks per GPU (no NCCL inside the group)")
    assert one.place("prod", 2, asyncrl.share_gpus(2)).env == {"CUDA_VISIBLE_DEVICES": "0"}
    two = Placer(Host(2, (0, 1)))
    assert two.place("a", 3, asyncrl.share_gpus(2)).env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    expect(asyncrl.PlacementError, lambda: two.place("b", 5, asyncrl.share_gpus(2)),
           "group 'b' needs 3 GPU(s), one per 2 ranks (share_gpus(2)), but this host has 2",
           "use nprocs <= 4")
    expect(asyncrl.PlacementError, lambda: two.place("c", 2, [asyncrl.share_gpus(2),
                                                              asyncrl.separate_from("a")]),
           "needs 1 GPU(s) separate_from(a), but only 0 of this host's 2")
    # a CPU-only host places by cores, as without it
    assert Placer(Host(0, (0, 1))).place("cpu", 2, asyncrl.share_gpus(2)).env == \
        {"ASYNCRL_CPUS": "0,1"}
    expect(ValueError, lambda: asyncrl.share_gpus(0), "share_gpus(ranks_per_gpu) needs an int")
    assert issubclass(asyncrl.PlacementError, asyncrl.AsyncRLError)
    expect(asyncrl.PlacementError, lambda: Placer(Host(0, (0, 1))).place(
        "nv", 1, asyncrl.nvlink_group(2)), "this host has 0 GPU(s)",
        "drop nvlink_group on a host without GPUs")


def test_too_few_cores_warn_and_share(caplog):
    p = Placer(Host(0, (0, 1)))
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        assert p.place("big", 3, None).devices == [0, 1]
    assert "group 'big' needs 3 CPU core(s), one per rank, but this host has 2" in caplog.text
    assert "use nprocs <= 2" in caplog.text and "ranks will share cores" in caplog.text


def test_a_flow_that_cannot_be_placed_fails_before_any_group_starts():
    """Each group is placed on paper first: the first, placeable, never starts."""
    first = asyncrl.group(Solo, name="first")
    wide = asyncrl.group(Solo, name="wide", place=asyncrl.nvlink_group(2))
    early = asyncrl.group(Solo, name="early", place=asyncrl.colocate_with("late"))
    late = asyncrl.group(Solo, name="late")

    @asyncrl.node
    def a(x):
        return [first.record(x), wide.record(x), early.record(x), late.record(x)]

    async def attempt(groups):
        async with asyncrl.Controller() as ctl:
            ctl.placer = Placer(Host(0, (0, 1)))  # a CPU host here and on a GPU machine
            flow = asyncrl.DataFlow(nodes=[a], inputs={"x": [1]}, groups=groups)
            try:
                await flow.open(ctl)
            finally:
                assert ctl.placer.placed == {} and ctl.groups == {}  # nothing started
    with pytest.raises(asyncrl.PlacementError, match="drop nvlink_group on a host without GPUs"):
        asyncio.run(attempt([first, wide]))
    with pytest.raises(asyncrl.PlacementError, match=r"group 'early': colocate_with\(late\) "
                                                     r"names a group that is not placed yet"):
        asyncio.run(attempt([first, early, late]))
    assert first.handle is None


# -- 6-8 on a real group ---------------------------------------------------------------------
class Solo(asyncrl.Worker):
    def __init__(self):
        self.seen: list = []

    @asyncrl.register
    def record(self, x):
        self.seen.append(x)
        return list(self.seen)

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def pair(self, a: TensorBatch, b: TensorBatch) -> TensorBatch:
        return a.union(b)

    def helper(self):  # not registered: the mistake entry 6 is about
        return 0


@pytest.fixture(scope="module")
def solo(bg):
    return bg.spawn(Solo, nprocs=1, name="solo")


@pytest.mark.parametrize("call, method", [
    pytest.param(lambda g: g.helper(), "helper", id="defined, not registered"),
    pytest.param(lambda g: g.nope(), "nope", id="not defined"),
    pytest.param(lambda g: g.call("__init__"), "__init__", id="by name, not registered"),
])
def test_unregistered_method_names_the_decorator(solo, call, method):
    message = expect(AttributeError, lambda: call(solo),
                     f"group 'solo' (Solo) has no registered method '{method}'",
                     "mark methods with @asyncrl.register")
    assert "registered: [" in message and "'record'" in message
    assert "_nccl" not in message  # the runtime's own methods are not the user's


def test_unencodable_argument_named_not_sent(bg, solo, tmp_path):
    async def on_loop(value):
        return solo.record(value)  # on the controller's loop: raises at the call site

    def local(v):
        return v

    with open(tmp_path / "data.txt", "w") as f:
        expect(asyncrl.EncodeError, lambda: bg.run(on_loop(f)),
               "cannot send argument 'x' of solo.record()", "_io.TextIOWrapper cannot be sent",
               "asyncrl sends msgspec-encodable values", "never pickles")
    expect(asyncrl.EncodeError, lambda: bg.run(on_loop(lambda v: v)),
           "argument 'x' of solo.record()", "a lambda cannot be sent",
           "define a module-level function instead")
    expect(asyncrl.EncodeError, lambda: bg.run(on_loop(local)),
           "argument 'x'", "is defined inside a function", "define it at module level")
    expect(asyncrl.EncodeError, lambda: bg.run(on_loop(threading.Lock())),
           "argument 'x'", "_thread.lock cannot be sent")
    expect(asyncrl.EncodeError, lambda: solo.record(object()).result(timeout=60),
           "argument 'x' of solo.record()")  # from another thread: at result()
    assert solo.record("after").result(timeout=60) == [["after"]]  # none of them arrived


# -- 8. TensorBatch shards that do not fit together -------------------------------------------
def batch(n: int = 3, **extra: Any) -> TensorBatch:
    return TensorBatch({"x": torch.arange(n), "s": [f"s{i}" for i in range(n)], **extra})


@pytest.mark.parametrize("call, exc, what, fix", [
    pytest.param(lambda: TensorBatch({"x": torch.zeros(3), "y": [1, 2]}), ValueError,
                 "'x' has 3 rows but 'y' has 2", "give every column one entry per row",
                 id="constructor: lengths"),
    pytest.param(lambda: TensorBatch({"x": torch.tensor(1)}), ValueError,
                 "column 'x' is a 0-d tensor", "give it a leading batch dimension",
                 id="constructor: 0-d"),
    pytest.param(lambda: TensorBatch.concat([batch(), TensorBatch({"x": torch.arange(2)})]),
                 ValueError, "batch 1 has columns ['x'] but batch 0 has ['x', 's']",
                 "batch 1 lacks ['s']; every batch needs the same columns: keep the shared "
                 "ones with .select(['x'])", id="concat: missing column"),
    pytest.param(lambda: TensorBatch.concat([batch(), batch().select(["s", "x"])]), ValueError,
                 "batch 1 has columns ['s', 'x']", "reorder batch 1 with .select(['x', 's'])",
                 id="concat: column order"),
    pytest.param(lambda: TensorBatch.concat([batch(m=torch.zeros(3, 4)),
                                             batch(2, m=torch.zeros(2, 5))]), ValueError,
                 "column 'm' cannot be joined (batch 0: (4,) on cpu; batch 1: (5,) on cpu)",
                 "pad them to one length", id="concat: row shapes"),
    pytest.param(lambda: TensorBatch.concat([batch(), TensorBatch({"x": [1], "s": ["a"]})]),
                 TypeError, "column 'x' is a tensor in some batches ([0]) and a list in "
                 "others ([1])", "torch.tensor(the list)", id="concat: tensor and list"),
    pytest.param(lambda: TensorBatch.concat([]), ValueError,
                 "TensorBatch.concat needs at least one batch", "", id="concat: nothing"),
    pytest.param(lambda: batch().union(TensorBatch({"y": [1, 2]})), ValueError,
                 "this batch has 3 rows but other has 2", "(slice one first)",
                 id="union: lengths"),
    pytest.param(lambda: batch().union(TensorBatch({"x": torch.tensor([0, 1, 9])})),
                 ValueError, "column 'x' is in both batches with different values",
                 "drop it from one side first", id="union: values"),
    pytest.param(lambda: batch().union(TensorBatch({"x": torch.arange(3.0)})), ValueError,
                 "column 'x' is in both batches", "drop it", id="union: dtype"),
    pytest.param(lambda: batch().union(TensorBatch({"s": ["s0", "s1", "S2"]})), ValueError,
                 "column 's' is in both batches", "drop it", id="union: list values"),
    pytest.param(lambda: batch().union(TensorBatch({"x": [0, 1, 2]})), ValueError,
                 "column 'x' is in both batches", "drop it", id="union: list vs tensor"),
    pytest.param(lambda: batch(m=torch.zeros(3, 1)).union(TensorBatch({"m": torch.zeros(3)})),
                 ValueError, "column 'm' is in both batches", "drop it", id="union: shape"),
    pytest.param(lambda: batch().union({"y": [1, 2, 3]}), TypeError,
                 "union(other) needs a TensorBatch, got dict", "wrap columns with TensorBatch",
                 id="union: not a batch"),
])
def test_mismatched_batches_name_column_and_fix(call, exc, what, fix):
    expect(exc, call, what, fix)


def test_dp_call_with_batches_of_different_lengths(solo):
    expect(ValueError, lambda: solo.pair(batch(5), batch(4)).result(timeout=60),
           "DP call on group 'solo'", "different lengths [4, 5]",
           "must have the same number of rows")
    out = solo.pair(batch(2), TensorBatch({"y": [7, 8]})).result(timeout=60)
    assert out.keys() == ["x", "s", "y"] and out["y"] == [7, 8]


# -- 9. prompt files ------------------------------------------------------------------------
def test_bad_prompt_data_names_place_and_fix(tmp_path, monkeypatch):
    def source(name: str, text: str | bytes | None = None) -> Callable[[], PromptSource]:
        path = tmp_path / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        elif text is not None:
            path.write_text(text)
        return lambda: PromptSource(path, batch_size=2)

    empty = tmp_path / "empty.jsonl"
    expect(ValueError, source("empty.jsonl", "\n  \n"), f"no prompts in {empty}: it is empty",
           'write one JSON object per line, such as {"prompt": [token ids], "answer": "7"}')
    bad = tmp_path / "bad.jsonl"
    expect(ValueError, source("bad.jsonl", '{"prompt": "a"}\n\n{"prompt": \n'),
           f"{bad}:3: not valid JSON", "each line must be one JSON object")
    expect(ValueError, source("list.jsonl", '[{"prompt": "a"}]\n'),
           f"{tmp_path / 'list.jsonl'}:1: a list, not a JSON object",
           'each line must be one object such as {"prompt": [token ids]}')
    expect(ValueError, source("array.json", '[\n  {"prompt": "a"}\n]\n'),
           f"{tmp_path / 'array.json'}:1: not valid JSON",
           "a .json file is read as JSON Lines: one object per line, not one array")
    expect(ValueError, source("latin1.jsonl", b'{"prompt": "a"}\n{"prompt": "\xe9"}\n'),
           f"{tmp_path / 'latin1.jsonl'}:2: not UTF-8 text", "save the file as UTF-8")
    monkeypatch.chdir(tmp_path)
    expect(FileNotFoundError, lambda: PromptSource("missing.jsonl", batch_size=2),
           "prompt file missing.jsonl does not exist",
           f"check the path (a relative path is read from {tmp_path})")
    expect(FileNotFoundError, lambda: PromptSource(tmp_path, batch_size=2),
           f"prompt file {tmp_path} is a directory, not a file", "check the path")
    expect(ValueError, source("p.csv", "prompt\na\n"),
           f"prompt file {tmp_path / 'p.csv'} has the suffix '.csv'",
           "PromptSource reads .jsonl (one JSON object per line) or .parquet")
    keys = tmp_path / "keys.jsonl"
    expect(ValueError, source("keys.jsonl", '{"prompt": "a", "answer": 1}\n\n{"prompt": "b"}\n'),
           f"{keys}:3 has keys ['prompt'], but {keys}:1 has ['answer', 'prompt']",
           "every record needs the same keys: add ['answer'] there")
    expect(ValueError, lambda: PromptSource([{"prompt": "a"}, {"x": 1}], batch_size=2),
           "record 1 of the given sequence has keys ['x']",
           "add ['prompt'] and drop ['x'] there")
    expect(ValueError, lambda: PromptSource([{"prompt": "a"}, "b"], batch_size=2),
           "record 1 of the given sequence is a str, not a dict", "pass records as dicts")
    expect(ValueError, lambda: PromptSource([], batch_size=2),
           "no prompts in the given sequence: it is empty", "pass at least one record")
    expect(ValueError, lambda: PromptSource([{"prompt": "a", "seed": 1}], batch_size=2),
           "have a 'seed' key", "rename that key")
    expect(ValueError, lambda: PromptSource([{"prompt": "a"}], batch_size="4"),
           "PromptSource: batch_size must be an int >= 1, got '4'")
    other = PromptSource([{"prompt": "a"}] * 4, batch_size=2, seed=1)
    next(iter(other))
    ok = PromptSource([{"prompt": "a"}] * 3, batch_size=2, seed=1)
    before = ok.state_dict()
    expect(ValueError, lambda: ok.load_state_dict(other.state_dict()),
           "saved for other prompts (records 4 there, 3 here; digest",
           "resume with the prompt data, seed and shuffle the run started with")
    assert ok.state_dict() == before  # the refused position was not taken
    # text prompts reach generation only as token ids (they failed deep inside torch)
    from asyncrl.hybrid.roles import _prompts
    expect(TypeError, lambda: _prompts(TensorBatch({"prompt": ["What is 2+2?"], "seed": [1]})),
           "generate: prompt 0 of this rank's rows (a DP call's chunk) is 'What is 2+2?', not a "
           "list of token ids",
           "PromptSource(..., tokenizer=DIR)")


FLOW_WITH_PROMPTS = """\
import asyncrl
from asyncrl.rl import PromptSource


@asyncrl.node
def count(prompts):
    return len(prompts)


prompts = PromptSource({path!r}, batch_size=2)
flow = asyncrl.DataFlow(nodes=[count], inputs={{"prompts": prompts}})
"""


def fake_run(run_dir: Path, flow_file: str, steps: int = 3) -> None:
    """A run directory as a run of `flow_file` leaves it: metrics rows, a checkpoint."""
    folder = run_dir / checkpoint.CHECKPOINTS / f"step_{steps - 1:06d}"
    folder.mkdir(parents=True)
    meta = {"step": steps - 1, "flow": {"file": flow_file, "nodes": ["rollout"], "groups": {}},
            "inputs": {}}
    (folder / "meta.json").write_text(json.dumps(meta))
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": t, "loss": 1.0 / (t + 1)}) + "\n" for t in range(steps)))


def test_bad_prompt_file_stops_launch_untouched(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    flow = tmp_path / "prompt_flow.py"
    flow.write_text(FLOW_WITH_PROMPTS.format(path=str(data)))
    run_dir = tmp_path / "run"
    fake_run(run_dir, "prompt_flow.py")
    before = files_of(run_dir)
    out = cli("launch", str(flow), "--resume", "--run-dir", str(run_dir))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"importing {flow} failed at {flow}:10: ValueError: {data}:2: not valid JSON" \
        in out.stderr
    assert "each line must be one JSON object" in out.stderr and "fix the flow file" in out.stderr
    assert "run_dir:" not in out.stdout  # refused before the run began
    assert files_of(run_dir) == before  # no metrics row dropped, the checkpoint kept


# -- 10. checkpoints that do not belong to this run ------------------------------------------
def test_wrong_checkpoint_is_refused_in_words(tmp_path):
    flow = asyncrl.DataFlow(nodes=[gen, judge], inputs={"prompts": [1]})
    expect(asyncrl.CheckpointError, lambda: checkpoint.resumable(tmp_path, flow),
           f"--resume: no complete checkpoint was found in {tmp_path / 'checkpoints'}",
           "run without --resume to start afresh, or point --run-dir at a run that wrote "
           "checkpoints")
    (tmp_path / "metrics.jsonl").write_text("")  # a run stopped before its first checkpoint
    expect(asyncrl.CheckpointError, lambda: checkpoint.resumable(tmp_path, flow),
           "start afresh in another --run-dir (or remove this one), or point --run-dir")
    (tmp_path / "metrics.jsonl").unlink()
    fake_run(tmp_path, "other.py")
    expect(asyncrl.CheckpointError, lambda: checkpoint.resumable(tmp_path, flow),
           f"checkpoint {tmp_path / 'checkpoints' / 'step_000002'} was written by another flow",
           "'other.py' there, 'test_bad_input.py' here",
           "nodes: ['rollout'] there, ['gen', 'judge'] here",
           "resume it with the flow file that wrote it, or run this flow in another --run-dir")
    copied = tmp_path / "copied"  # the same nodes and groups from another file: a renamed
    (copied / checkpoint.CHECKPOINTS / "step_000000").mkdir(parents=True)  # copy, or another
    (copied / checkpoint.CHECKPOINTS / "step_000000" / "meta.json").write_text(json.dumps(
        {"step": 0, "flow": {**checkpoint.identity(flow), "file": "flow_v1.py"}}))  # recipe
    expect(asyncrl.CheckpointError, lambda: checkpoint.resumable(copied, flow),
           "if 'test_bad_input.py' is a renamed copy of 'flow_v1.py', resume under that name")
    expect(asyncrl.CheckpointError, lambda: checkpoint.refuse_existing(tmp_path),
           f"{tmp_path} already holds checkpoints of an earlier run (newest: step_000002)",
           "choose another --run-dir, or continue that run with `asyncrl launch ... "
           "--resume`")  # (asyncrl bench has no --resume)
    resized = tmp_path / "resized"  # this flow's, but its group had 2 ranks (actor_procs=2)
    solo = asyncrl.group(Solo, name="solo")
    sized = asyncrl.DataFlow(nodes=[gen, judge], inputs={"prompts": [1]}, groups=[solo])
    folder = resized / checkpoint.CHECKPOINTS / "step_000000"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({
        "step": 0, "flow": checkpoint.identity(sized), "inputs": {}, "sizes": {"solo": 2},
        "overrides": {"actor_procs": "2"}}))
    expect(asyncrl.CheckpointError, lambda: checkpoint.resumable(resized, sized),
           "was written by groups of other sizes (ranks of solo: 2 there, 1 here)",
           "taken again unless the command line gives others: {'actor_procs': '2'}")
    assert checkpoint.checkpoint_overrides(resized) == {"actor_procs": "2"}
    unsaved = tmp_path / "unsaved"  # a run that wrote rows but no checkpoint
    unsaved.mkdir()
    (unsaved / "metrics.jsonl").write_text('{"step": 0}\n')
    expect(asyncrl.CheckpointError, lambda: checkpoint.refuse_existing(unsaved),
           f"{unsaved} already holds metrics.jsonl of an earlier run (with no checkpoint",
           "choose another --run-dir, or remove it to start afresh there")
    (unsaved / "metrics.jsonl").unlink()  # removed alone: TensorBoard's curves would mix
    (unsaved / "tensorboard").mkdir()
    (unsaved / "tensorboard" / "events.out.tfevents.1").write_bytes(b"x")
    expect(asyncrl.CheckpointError, lambda: checkpoint.refuse_existing(unsaved),
           f"{unsaved} already holds tensorboard/ of an earlier run")


def test_wrong_resumes_fail_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (no runs/ here: none to resume)
    with pytest.raises(SystemExit, match="--resume needs --run-dir DIR, the run to continue"):
        cli_main(["launch", str(Path(ROOT) / "examples/flow.py"), "--resume"])
    run_dir = tmp_path / "other"
    fake_run(run_dir, "other.py")
    before = files_of(run_dir)
    out = cli("launch", "examples/flow.py", "--resume", "--run-dir", str(run_dir))
    assert out.returncode == 2 and "written by another flow" in out.stderr
    assert "'other.py' there, 'flow.py' here" in out.stderr
    assert "resume it with the flow file that wrote it" in out.stderr
    out = cli("launch", "examples/flow.py", "--steps", "1", "--run-dir", str(run_dir))
    assert out.returncode == 2 and "already holds checkpoints" in out.stderr
    assert "continue that run with `asyncrl launch ... --resume`" in out.stderr
    assert files_of(run_dir) == before  # nothing was touched
    empty = tmp_path / "empty"
    out = cli("launch", "examples/flow.py", "--resume", "--run-dir", str(empty))
    assert out.returncode == 2 and "no complete checkpoint was found in" in out.stderr
    assert "run without --resume" in out.stderr and not empty.exists()


class Unbuildable(asyncrl.Worker):
    def __init__(self):
        raise RuntimeError("this worker cannot be built")


def test_a_flow_whose_group_fails_to_start_closes_the_groups_that_did():
    """open() fails as a whole: the groups that started are closed and the flow is not left
    half open (a later run() would have skipped open() and failed on its inputs)."""
    fine = asyncrl.group(Solo, name="fine")
    broken = asyncrl.group(Unbuildable, name="broken")

    @asyncrl.node
    def both(x):
        return [fine.record(x), broken.record(x)]

    async def main():
        async with asyncrl.Controller() as ctl:
            flow = asyncrl.DataFlow(nodes=[both], inputs={"x": [1]}, groups=[fine, broken])
            with pytest.raises(asyncrl.AsyncRLError, match="this worker cannot be built"):
                await flow.open(ctl)
            left = dict(ctl.groups)
            with pytest.raises(RuntimeError, match="the flow is not open"):
                await flow.step()
            return left, fine.handle
    assert asyncio.run(main()) == ({}, None)
