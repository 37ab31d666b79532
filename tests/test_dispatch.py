"""Dispatch without processes: @register's checks, the DP protocol's split and collect on
the controller, a rank's chunk, user protocols' splits and collects, held calls' contexts
(real groups: test_groups.py)."""

from __future__ import annotations

import ast
import asyncio
import contextvars
import inspect
import threading
import types

import pytest
import torch

import asyncrl
from asyncrl.actors import protocols
from asyncrl.actors.protocols import (
    DPRows,
    Layout,
    Split,
    _dp_collect,
    _dp_collect_encoded,
    check_split,
    get_protocol,
    take_dp_rows,
)
from asyncrl.comm import codec
from asyncrl.comm.messages import Column, MethodSpec, Schema
from asyncrl.controller import group
from asyncrl.controller.objects import ObjectRef
from asyncrl.controller.timeline import called_groups
from asyncrl.futures.future import DistFuture

DP = asyncrl.Dispatch.DP
PAIR = Layout("g", (("dp", 2),))


def dp_split(*args, **kwargs) -> Split:
    return get_protocol(DP.value).split(PAIR, args, kwargs)


# -- padding rows ----------------------------------------------------------------------------
def test_a_ranks_padding_row_owns_its_list_items():
    """take_dp_rows pads a rank's chunk as chunk(pad=True) does: the padding row's list is a
    copy, so appending a turn to each row's messages appends once to row 4's."""
    batch = asyncrl.TensorBatch({"messages": [[f"p{i}"] for i in range(5)]})
    split = dp_split(batch)
    (chunk,), _ = take_dp_rows([batch], {}, split.dp_rows, 0, 1)
    for messages in chunk["messages"]:
        messages.append("turn")
    assert batch["messages"][3:] == [["p3", "turn"], ["p4", "turn"]]
    assert chunk["messages"][2] == ["p4", "turn"]  # the padding row's own list


# -- collecting: padding dropped from batches; other values as the ranks returned them -------
def test_dp_collect_cuts_padding_from_batches_and_leaves_other_values():
    """A list or tensor as long as the rows a rank was sent may be one item a row or a
    summary ((loss, tokens) on a chunk of two rows): it is not cut (a summary cut lost half
    of itself); a batch is."""
    split = dp_split(asyncrl.TensorBatch({"x": torch.arange(5)}))  # 3 + 2 rows and 1 pad
    got = _dp_collect(PAIR, {0: torch.tensor([0, 2, 4]), 1: torch.tensor([6, 8, 8])},
                      split.state)
    assert [t.tolist() for t in got] == [[0, 2, 4], [6, 8, 8]]
    assert _dp_collect(PAIR, {0: [0, 2, 4], 1: [6, 8, 8]}, split.state) == [[0, 2, 4],
                                                                             [6, 8, 8]]
    for value in ([1, 2], {"a": 1, "b": 2, "c": 3}, 7, None):
        assert _dp_collect(PAIR, {0: value, 1: value}, split.state) == [value, value]
    # a batch among other values is cut (dp rank 1's real row and not its pad)
    one = dp_split(asyncrl.TensorBatch({"x": torch.arange(3)})).state
    mixed = _dp_collect(PAIR, {0: None, 1: asyncrl.TensorBatch({"x": torch.tensor([2, 2])})},
                        one)
    assert mixed[0] is None and mixed[1]["x"].tolist() == [2]


def test_dp_collect_keeps_a_summary_batch_whole():
    """A batch whose rows are not r per row sent (one row of metrics per rank) is no rows
    of the input: kept whole, decoded or from its encoding, rather than refused."""
    state = dp_split(asyncrl.TensorBatch({"x": torch.arange(5)})).state
    summary = {r: asyncrl.TensorBatch({"loss": torch.tensor([float(r)])}) for r in (0, 1)}
    assert _dp_collect(PAIR, summary, state)["loss"].tolist() == [0.0, 1.0]
    raws = {r: codec.encode(b) for r, b in summary.items()}
    assert _dp_collect_encoded(PAIR, raws, state)["loss"].tolist() == [0.0, 1.0]


# -- splitting ------------------------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda b: dp_split({"b": b}), lambda b: dp_split(3, [b]), lambda b: dp_split(x=(1, b))])
def test_dp_refuses_a_batch_nested_in_an_argument(call):
    """A batch one level down was sent whole to every rank: 8 rows collected from 4."""
    with pytest.raises(ValueError, match=r"argument .* holding a TensorBatch.*pass the "
                                         r"TensorBatch itself as an argument"):
        call(asyncrl.TensorBatch({"x": torch.arange(4)}))
    batch = asyncrl.TensorBatch({"x": torch.arange(4)})  # beside a batch argument: as before
    assert dp_split(batch, {"ref": batch}).dp_rows == DPRows(4, 2)


def test_a_user_split_may_not_set_dp_rows():
    whole = Split({0: ((), {}), 1: ((), {})}, [0, 1], dp_rows=DPRows(4, 2))
    with pytest.raises(ValueError, match="'mine': split set Split.dp_rows.*leave it None"):
        check_split("mine", whole, 2)
    # one whose split is DP's own (asyncrl.rl's dp_stats: DP's rows, rank 0's answer) may
    import asyncrl.rl.batch  # noqa: F401 - registers dp_stats

    check_split("dp_stats", whole, 2)


def test_a_user_splits_error_names_the_protocol_and_group():
    def split(layout, args, kwargs):
        return {"rows": args[0]["missing"]}

    name = asyncrl.register_protocol("test_dispatch_noted", split=split,
                                     collect=lambda *a: None)
    try:
        with pytest.raises(KeyError) as info:
            get_protocol(name).split(PAIR, ({},), {})
        assert any("'test_dispatch_noted'" in n and "group 'g'" in n
                   for n in info.value.__notes__)
    finally:
        del protocols._PROTOCOLS[name]


def summing_collect(layout, results, state):  # a user's collect, written for values
    return sum(results[r] for r in sorted(results))


def handles(*names: str, ranks: int = 1, **ctl: object) -> list[group.GroupHandle]:
    """Groups of `ranks` ranks with a method f and a concurrent one, link, on a stand-in
    controller (on this loop)."""
    fake = types.SimpleNamespace(
        loop=asyncio.get_running_loop(), _loop_thread=threading.get_ident(), calls={},
        transfer_timeout=1.0, timeline=None, transport="tcp", post=lambda *a: None,
        releases=types.SimpleNamespace(later=lambda *a: None), **ctl)
    out = []
    for name in names:
        handle = group.GroupHandle(fake, name, object, Layout(name, (("dp", ranks),)), None)
        handle.methods = {"f": MethodSpec("one_to_all"), "link": MethodSpec("one_to_all", True)}
        handle.ranks = {r: group.RankInfo(1, "h", 0.0) for r in range(ranks)}
        out.append(handle)
    return out


def test_a_user_collect_given_references_says_so():
    """A result passed to another group's call is collected from references; a collect
    written for values failed with a bare TypeError naming neither it nor the input."""
    name = asyncrl.register_protocol("test_dispatch_summing", split=lambda *a: None,
                                     collect=summing_collect)

    async def main() -> BaseException | None:
        a, c = handles("a", "c", ranks=2, links=types.SimpleNamespace(needed=lambda *a: False))
        total = DistFuture._new(a._ctl.loop, "a.total")
        call = group._Pending(7, "total", get_protocol(name), total, None, set(), {0, 1}, [],
                              schemas={r: Schema(-1, nbytes=8) for r in (0, 1)})
        a._pending[7] = call
        a._done(call)  # (the ranks answered)
        out = c.call("f", total)
        for _ in range(8):
            await asyncio.sleep(0)
        return out._fut.exception()
    try:
        error = asyncio.run(main())
    finally:
        del protocols._PROTOCOLS[name]
    assert isinstance(error, TypeError)
    assert "collect() of protocol 'test_dispatch_summing' got references (RemoteValue/" \
           "RemoteBatch), not values, when its result was passed as input 0 of c.f() " \
           "(a.total)" in "".join(getattr(error, "__notes__", []))


def test_a_builtin_collects_error_is_not_blamed_on_references():
    """The note that a collect was given references went on any collect's error: DP's
    refusal of batches whose columns differ (a data error) said to change DP's collect."""
    async def main() -> BaseException | None:
        a, c = handles("a", "c", ranks=2, links=types.SimpleNamespace(needed=lambda *a: False))
        batches = DistFuture._new(a._ctl.loop, "a.batches")
        call = group._Pending(7, "batches", get_protocol("dp"), batches,
                              protocols._DPState([2, 2], [0, 0], True), set(), {0, 1},
                              [], schemas={r: Schema(2, (Column(f"x{r}", "float32"),))
                                           for r in (0, 1)})
        a._pending[7] = call
        a._done(call)
        out = c.call("f", batches)
        for _ in range(8):
            await asyncio.sleep(0)
        return out._fut.exception()
    error = asyncio.run(main())
    assert isinstance(error, ValueError) and "differ in columns" in str(error)
    assert not any("got references" in n for n in getattr(error, "__notes__", [])), \
        error.__notes__


def test_a_held_call_sets_up_its_links_as_a_call_of_the_node_that_made_it():
    """Held calls wait in one drain task, made in the context of the node whose call was
    held first: the link a later node's call set up was counted as the first node's call
    (the groups it called, its finished waits, its timeline spans)."""
    async def ensure(producer, consumer, required=False):  # a link's set-up calls both
        producer.call("link")
        consumer.call("link")

    async def main() -> tuple[set[str], set[str], int]:
        links = types.SimpleNamespace(needed=lambda *a: True, ensure=ensure)
        a, c = handles("a", "c", links=links)
        sent: list = []
        a._send = c._send = sent.append
        first, later = DistFuture._new(a._ctl.loop, "a.x"), DistFuture._new(a._ctl.loop, "a.y")
        node_1, node_2 = {"node 1"}, {"node 2"}

        def call_in(node: set[str], fut: DistFuture) -> None:  # as a DataFlow node does
            called_groups.set(node)
            c.call("f", fut)
        contextvars.Context().run(call_in, node_1, first)
        contextvars.Context().run(call_in, node_2, later)
        for obj, fut in enumerate((first, later)):
            fut._set_result(ObjectRef(a, obj, lambda p: p[0], {0: Schema(-1, nbytes=1)}, {}))
        for _ in range(8):
            await asyncio.sleep(0)
        return node_1, node_2, len(sent)
    node_1, node_2, sent = asyncio.run(main())
    assert sent == 2 * 3  # each held call, and its link's two calls
    assert node_1 == {"node 1", "c", "a"} and node_2 == {"node 2", "c", "a"}


def test_a_methods_parameter_named_method_or_self_can_be_passed_by_keyword():
    """`reward.score(b, method="fuzzy")` raised TypeError: got multiple values for argument
    'method' (call's own parameter), and `self=` the same."""
    async def main() -> list:
        (c,) = handles("c")
        sent: list = []
        c._send = sent.append
        c.f(1, method="y", self="z")
        c.call("f", 1, method="y", self="z")
        await asyncio.sleep(0)
        return sent
    assert [(q.method, q.args, q.kwargs) for q in asyncio.run(main())] == \
        [("f", (1,), {"method": "y", "self": "z"})] * 2

    @asyncrl.node  # a node's function, called as a plain one, the same
    def scored(self, method):
        return self, method
    assert scored(self=1, method=2) == (1, 2)


# -- @register -------------------------------------------------------------------------------
def test_register_says_to_pass_the_protocol_by_keyword():
    with pytest.raises(TypeError, match=r"write @register\(dispatch=Dispatch.DP\)"):
        asyncrl.register(DP)
    with pytest.raises(TypeError, match=r"write @register\(dispatch='dp'\)"):
        asyncrl.register("dp")
    with pytest.raises(TypeError, match=r"dispatch= takes an asyncrl.Dispatch or a protocol "
                                        r"name \(str\), got dict"):
        asyncrl.register(dispatch={})


def test_a_method_the_group_handle_would_shadow_is_refused():
    with pytest.raises(TypeError, match="registers 'ready', also the name of a GroupHandle "
                                        "attribute.*another name"):
        class Shadowed(asyncrl.Worker):
            @asyncrl.register
            def ready(self):
                return True

    class Fine(asyncrl.Worker):  # the same name, not registered: not callable, no clash
        def ready(self):
            return True


def test_the_shadowed_names_are_the_group_handles_public_attributes():
    """GROUP_HANDLE_NAMES (kept in register.py, which ranks import) against group.py."""
    from asyncrl.actors.register import GROUP_HANDLE_NAMES

    tree = ast.parse(inspect.getsource(group.GroupHandle))
    body = tree.body[0].body  # the class's methods and properties, then what they set
    names = {n.name for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    names |= {t.attr for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.AnnAssign)
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
              and t.value.id == "self"}
    assert {n for n in names if not n.startswith("_")} == GROUP_HANDLE_NAMES
