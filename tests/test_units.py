"""Pieces without processes: the public API, auth, TensorBatch, protocols (the codec:
test_codec.py)."""

from __future__ import annotations

import asyncio
import hmac
import os
import random
import re
import types

import pytest
import torch

import asyncrl
from asyncrl.actors.protocols import (
    Layout,
    _dp_collect,
    _dp_collect_encoded,
    dp_block,
    get_protocol,
    take_dp_rows,
)
from asyncrl.actors.worker import construct
from asyncrl.comm import codec
from asyncrl.comm.auth import Signer, Verifier

DP = asyncrl.Dispatch.DP


def test_public_api_is_the_facade():
    assert sorted(asyncrl.__all__) == sorted([
        "AsyncRLError", "CheckpointError", "ClosedError", "Controller", "Dispatch",
        "DistFuture", "EncodeError", "GroupDeadError", "GroupHandle", "InputLostError", "Layout",
        "InputsExhausted", "RecoveryError", "RemoteError", "Rows", "concat",
        "SpawnError", "SpawnTimeout",
        "Split", "TensorBatch", "TransferTimeout", "Worker", "register", "register_protocol",
        "run", "DataFlow", "FlowError", "NodeError", "PlacementError", "colocate_with",
        "config", "group", "node", "nvlink_group", "same_host_as", "separate_from", "share_gpus",
        "breakpoint"])
    for name in asyncrl.__all__:
        assert getattr(asyncrl, name) is not None
    # every exported error is one of ours: `except asyncrl.AsyncRLError` catches it
    # (RecoveryError, which flow.run raises when it cannot go back, was a bare RuntimeError,
    # as were DynamicSamplingError and a tracker's)
    from asyncrl import rl
    from asyncrl.controller.trackers import TrackerError

    errors = [getattr(m, n) for m in (asyncrl, rl) for n in m.__all__
              if n.endswith(("Error", "Exhausted"))] + [TrackerError]
    assert all(issubclass(e, asyncrl.AsyncRLError) for e in errors), errors


# -- auth ----------------------------------------------------------------------------------
def test_signed_frames_verify_once_and_only_on_their_link():
    secret = os.urandom(32)
    signer, verifier = Signer(secret), Verifier(secret)
    frames = signer.sign(b"g/0/io/1", b"payload")
    assert bytes(verifier.verify(b"g/0/io/1", frames)) == b"payload"
    assert verifier.verify(b"g/0/io/1", frames) is None  # replay
    assert verifier.verify(b"g/1/io/1", signer.sign(b"g/0/io/1", b"x")) is None  # other link
    assert verifier.verify(b"g/0/io/1", [frames[0], b"\0" * 32]) is None
    assert verifier.verify(b"g/0/io/1", [b"short"]) is None
    assert Verifier(os.urandom(32)).verify(b"g/0/io/1", signer.sign(b"g/0/io/1", b"x")) is None
    assert dict(verifier.dropped) == {"replay": 1, "bad_mac": 2, "malformed": 1}


def test_frame_mac_is_rfc_2104_hmac_sha256():
    for secret in (os.urandom(32), os.urandom(64), os.urandom(100)):  # > one block: hashed
        body, mac = Signer(secret).sign(b"g/0/io/1", b"payload")
        route = b"g/0/io/1"
        assert mac == hmac.digest(secret, len(route).to_bytes(4, "big") + route + body,
                                  "sha256")


def test_a_frame_cannot_move_its_route_body_boundary():
    """Re-sent from identity route + body[:k] with body[k:], a frame must not verify."""
    secret = os.urandom(32)
    body, mac = Signer(secret).sign(b"g/0/io/1", b"\x00" * 8 + b"payload")
    for k in (1, 8, 12):
        assert Verifier(secret).verify(b"g/0/io/1" + body[:k], [body[k:], mac]) is None


# -- TensorBatch ---------------------------------------------------------------------------
def test_tensorbatch_basics_and_errors():
    b = asyncrl.TensorBatch({"x": torch.arange(10), "s": list("abcdefghij")})
    assert len(b) == 10 and b["s"][3] == "d"
    chunks = b.chunk(3)
    assert [len(c) for c in chunks] == [4, 3, 3]
    again = asyncrl.TensorBatch.concat(chunks)
    assert torch.equal(again["x"], b["x"]) and again["s"] == b["s"]
    assert [len(c) for c in asyncrl.TensorBatch({"x": torch.arange(2)}).chunk(4)] == [1, 1, 0, 0]
    with pytest.raises(KeyError, match="no column 'z'"):
        b["z"]
    with pytest.raises(TypeError, match="columns are torch tensors or lists"):
        asyncrl.TensorBatch({"x": 3})


# -- protocols -----------------------------------------------------------------------------
def _rank_args(layout, split, rank, hosts=None):
    """What `rank` runs with: its (args, kwargs) as a rank ends up with them. A windowed DP
    split is cut as GroupHandle and the rank cut it: the rows of the rank's host (`hosts`: a
    list of rank lists; default one host per rank), then the rank's own chunk."""
    if split.dp_rows is None:
        return split.calls[rank]
    host = next(h for h in (hosts or [[r] for r in range(layout.world_size)]) if rank in h)
    spans = [split.dp_rows.span(layout.dp_rank(r)) for r in host]
    first, last = min(s[0] for s in spans), max(s[1] for s in spans)
    args, kwargs = dp_block(*split.calls[rank], first, last)
    args, kwargs = take_dp_rows(list(args), kwargs, split.dp_rows, first, layout.dp_rank(rank))
    return tuple(args), kwargs


def _dp(mesh, rows, method_rows=1):
    layout = Layout("g", tuple(mesh.items()))
    proto = get_protocol(DP.value)
    batch = asyncrl.TensorBatch({"x": torch.arange(rows)})
    split = proto.split(layout, (batch,), {})
    results = {}
    for r in split.collect:
        (chunk,), _ = _rank_args(layout, split, r)
        results[r] = asyncrl.TensorBatch({"x": chunk["x"].repeat_interleave(method_rows)})
    return layout, split, proto.collect(layout, results, split.state)


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 9])
@pytest.mark.parametrize("method_rows", [1, 2])
def test_dp_keeps_every_real_row_in_order(rows, method_rows):
    layout, split, out = _dp({"dp": 4}, rows, method_rows)
    assert out["x"].tolist() == torch.arange(rows).repeat_interleave(method_rows).tolist()
    sizes = {len(_rank_args(layout, split, r)[0][0]) for r in split.calls}
    assert len(sizes) == 1  # every rank gets the same number of rows (collectives line up)


def test_dp_marks_padding_and_feeds_replicas_the_same_chunk():
    layout, split, _ = _dp({"dp": 2, "tp": 2}, 3)
    assert split.collect == [0, 2]
    chunk = {r: _rank_args(layout, split, r)[0][0] for r in split.calls}
    for a, b in ((0, 1), (2, 3)):
        assert chunk[a]["x"].tolist() == chunk[b]["x"].tolist() and chunk[a].meta == chunk[b].meta
    assert chunk[0].meta.get("dp_pad", 0) == 0 and chunk[2].meta["dp_pad"] == 1
    assert chunk[2]["x"].tolist() == [2, 2]  # the padding row repeats a real row


@pytest.mark.parametrize("seed", range(40))
def test_dp_chunks_taken_on_the_ranks_equal_chunking_on_the_controller(seed):
    """Whatever rows a host is sent, each rank's chunk is exactly chunk(dp, pad=True)'s."""
    rng = random.Random(seed)
    dp, tp = rng.randint(1, 9), rng.choice([1, 2])
    rows = rng.randint(dp, 40)  # below dp the controller chunks itself (an empty chunk)
    pad = rng.choice([0, 0, 1, 3])  # the batch may itself be a padded chunk
    batch = asyncrl.TensorBatch({"x": torch.arange(rows * 2).reshape(rows, 2),
                                 "s": [f"r{i}" for i in range(rows)]},
                                {"dp_pad": pad, "k": 1} if pad else {"k": 1})
    layout = Layout("g", (("dp", dp), ("tp", tp)))
    split = get_protocol(DP.value).split(layout, (batch, 5), {"b": batch})
    assert split.dp_rows is not None
    ranks = list(range(layout.world_size))
    cuts = sorted(rng.sample(ranks[1:], rng.randint(0, len(ranks) - 1)))
    hosts = [ranks[a:b] for a, b in zip([0, *cuts], [*cuts, len(ranks)], strict=True)]
    expected = batch.chunk(dp, pad=True)
    for r in ranks:
        (mine, five), kwargs = _rank_args(layout, split, r, hosts)
        want = expected[layout.dp_rank(r)]
        for got in (mine, kwargs["b"]):
            assert got["x"].tolist() == want["x"].tolist() and got["s"] == want["s"]
            assert got.meta == want.meta
        assert five == 5


def test_mesh_coordinates_are_row_major():
    layout = Layout("g", (("dp", 2), ("tp", 3)))
    assert [layout.coords(r) for r in (0, 1, 3, 5)] == [
        {"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 2}]


def test_register_rejects_unknown_protocols():
    with pytest.raises(ValueError, match="unknown dispatch protocol 'nope'"):
        asyncrl.register(dispatch="nope")
    with pytest.raises(ValueError, match="built in"):
        asyncrl.register_protocol("dp", split=lambda *a: None, collect=lambda *a: None)


@pytest.mark.parametrize("seed", range(60))
def test_dp_collect_from_encoded_results_equals_decoding_each(seed):
    """The DP protocol collects ranks' encoded TensorBatches one tensor per column; whatever
    they hold, the value (or the error) is the one decoding each and collecting gives."""
    rng = random.Random(seed)
    dp, rows = rng.randint(1, 6), rng.randint(0, 20)
    layout = Layout("g", (("dp", dp),))
    split = get_protocol(DP.value).split(
        layout, (asyncrl.TensorBatch({"x": torch.arange(rows)}),), {})
    dtype = rng.choice([torch.float32, torch.int64, torch.bfloat16, torch.bool])
    row_shape = rng.choice([(), (3,), (2, 2)])
    per_row = rng.choice([1, 1, 2])  # rows a rank returns per row it was sent
    odd = rng.random() < 0.15  # one rank returns a row count padding cannot be cut from
    results = {}
    for r in range(dp):
        n = (split.state.chunk_rows[r] if rows else 0) * per_row + (odd and r == 0)
        cols = {"t": (torch.rand(n, *row_shape) * 10).to(dtype),
                "s": [f"{r}.{i}" for i in range(n)]}
        if rng.random() < 0.1:  # a part whose columns differ: decoded one by one instead
            cols = {"s": cols["s"], "t": cols["t"]}
        meta = {"k": r}
        if rng.random() < 0.3 and n:
            meta["dp_pad"] = rng.randint(1, n)
        results[r] = asyncrl.TensorBatch(cols, meta)
    raws = {r: codec.encode(b) for r, b in results.items()}

    def decoding_each():
        return _dp_collect(layout, {r: codec.decode(raw) for r, raw in raws.items()},
                           split.state)

    def as_controller():  # ObjectRef.value(): encoded first, each decoded where it cannot
        return _dp_collect_encoded(layout, raws, split.state) or decoding_each()

    try:
        want = decoding_each()
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e))):
            as_controller()
        return
    got = as_controller()
    if len({tuple(b.keys()) for b in results.values()}) == 1:  # one tensor per column
        assert _dp_collect_encoded(layout, raws, split.state) is not None
    assert got.keys() == want.keys() and got.meta == want.meta and len(got) == len(want)
    assert got["s"] == want["s"]
    assert got["t"].dtype == want["t"].dtype and torch.equal(got["t"], want["t"])


def test_a_group_name_too_long_for_its_socket_names_is_refused_before_the_spawn():
    """A ~220-character name passed, and each rank then failed with "ZMQError: Invalid
    argument" (a socket identity is at most 255 bytes, and the name starts every one)."""
    from asyncrl.controller.logs import check_group_name

    check_group_name("g" * 100)
    with pytest.raises(ValueError, match="group name 'gggg.*is 220 characters long: use at "
                                         "most 100"):
        check_group_name("g" * 220)


class AsyncHooks(asyncrl.Worker):
    """A worker whose hooks are `async def`, as its methods may be."""

    async def save_state(self, folder):
        await asyncio.sleep(0)
        (folder / "weights.txt").write_text("3")

    async def load_state(self, folder):
        await asyncio.sleep(0)
        self.weights = int((folder / "weights.txt").read_text())

    async def on_close(self):
        await asyncio.sleep(0)
        self.closed_on = asyncio.get_running_loop()


def test_async_def_hooks_run_to_their_end(tmp_path):
    """An `async def` save_state, load_state or on_close was called and its coroutine
    dropped: a checkpoint marked complete without the weights, a resume on fresh ones, and
    no on_close."""
    from asyncrl.actors import rank_main

    worker = construct(AsyncHooks, [], {}, {"group_name": "g", "rank": 0})
    calls_loop = asyncio.new_event_loop()  # (runs a call's awaitable, as the rank's does)
    try:
        calls_loop.run_until_complete(worker.save_checkpoint(str(tmp_path)))
        assert (tmp_path / "g" / "weights.txt").read_text() == "3"
        assert (tmp_path / "g" / "rng_rank0.pt").is_file()
        calls_loop.run_until_complete(worker.load_checkpoint(str(tmp_path)))
        assert worker.weights == 3
        rank = types.SimpleNamespace(worker=worker, group="g", rank=0, calls_loop=calls_loop,
                                     settle=lambda timeout: True)
        rank_main._close(rank, 0, None)  # the in-order calls settled: on their loop
        assert worker.closed_on is calls_loop
    finally:
        calls_loop.close()


# -- mends of this session's own changes (a review of its diff) -----------------------------
def test_a_concat_whose_failure_the_node_handled_leaves_it_no_later_part_failure():
    """A concat's parts are awaited one by one: the node caught the first part's failure,
    and a second part failing later was taken for one the node never saw (the node failed)."""
    from asyncrl.controller.finished import Calls
    from asyncrl.futures.future import DistFuture, concat

    async def main():
        loop = asyncio.get_running_loop()
        calls, (a, b) = Calls(), (DistFuture._new(loop, "g.a"), DistFuture._new(loop, "g.b"))
        calls.add(a)
        calls.add(b)
        a._fut.set_exception(RuntimeError("a failed"))
        with pytest.raises(RuntimeError, match="a failed"):
            await concat(a, b)
        b._fut.set_exception(RuntimeError("b failed"))
        await calls.done()
        return calls.failed
    assert asyncio.run(main()) is None


def test_unset_fields_are_left_out_of_the_checks_as_msgspec_leaves_them_out():
    """A Struct field at msgspec.UNSET, a dataclass field never set (init=False): encoded
    without them, yet the new checks refused the one and raised AttributeError on the other."""
    import dataclasses

    import msgspec

    from asyncrl.futures.store import schema_of

    class P(msgspec.Struct):
        a: int
        b: int | msgspec.UnsetType = msgspec.UNSET

    @dataclasses.dataclass
    class D:
        a: int
        b: int = dataclasses.field(init=False)
    for value in (P(1), D(1), [P(1)] * 3):
        assert schema_of(value).nbytes == 0 and not codec.encodes_past(value, 100)


def test_repeat_copies_the_containers_of_list_items_not_their_tensors():
    """repeat(k) deep-copied each row's items: a tensor per row (an image) was copied k
    times over (seconds and GBs); appending to one copy's messages must still not reach
    another's."""
    image = torch.zeros(3, 4, 4)
    batch = asyncrl.TensorBatch({"img": [image], "m": [[{"role": "user"}]]})
    out = batch.repeat(2)
    out["m"][0].append({"role": "assistant"})
    assert out["img"][0] is image and out["img"][1] is image
    assert out["m"][1] == [{"role": "user"}] and batch["m"][0] == [{"role": "user"}]


def test_a_resume_of_an_empty_run_dir_says_to_run_without_resume(tmp_path):
    """The run's lock file made an empty folder look used: "start afresh in another
    --run-dir" where a fresh run there is taken."""
    from asyncrl.controller import checkpoint
    from asyncrl.controller.launch import hold_run_dir

    os.close(hold_run_dir(tmp_path / "run"))
    flow = asyncrl.DataFlow(nodes=[asyncrl.node(lambda x: x, name="echo")], inputs={"x": [1]})
    with pytest.raises(asyncrl.CheckpointError, match="run without --resume"):
        checkpoint.resumable(tmp_path / "run", flow)


def test_a_rank_of_a_group_over_hosts_gives_gloo_the_interface_of_its_hosts_address(
        monkeypatch):
    """Gloo listened where the machine's name resolves (127.0.1.1 on Debian): peers on other
    hosts were told loopback, and init_process_group waited out the collective timeout."""
    import socket

    from asyncrl.actors import gloo_interface as gi

    held = {"lo": "127.0.0.1", "eth7": "10.1.2.3"}
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth7")])
    monkeypatch.setattr(gi, "interface_address", held.get)
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")  # (it is loopback)
    over = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "ASYNCRL_DATA_HOST": "10.1.2.3",
            "ASYNCRL_ADDR": "tcp://10.0.0.1:5000"}
    env = dict(over)
    gi.set_gloo_interface(env)
    assert env["GLOO_SOCKET_IFNAME"] == "eth7"
    for kept in ({**over, "LOCAL_WORLD_SIZE": "2"}, {**over, "GLOO_SOCKET_IFNAME": "ib0"},
                 {**over, "ASYNCRL_ADDR": "tcp://127.0.0.1:5000", "ASYNCRL_DATA_HOST": "a"}):
        env = dict(kept)  # one host, the user's choice, or hosts imitated on loopback
        gi.set_gloo_interface(env)
        assert env == kept
    with pytest.raises(RuntimeError, match=r"'localhost' resolves to loopback .* no interface "
                                           r"here holds the host's address '10\.9\.9\.9'.*"
                                           r"GLOO_SOCKET_IFNAME"):
        gi.set_gloo_interface({**over, "ASYNCRL_DATA_HOST": "10.9.9.9"})
    real = gi.addresses  # a SLURM host's address is its name, 127.0.1.1 on Debian
    named = {"node1": {"127.0.1.1"}, "node2": {"127.0.0.1"}}  # (lo holds 127.0.0.1)
    monkeypatch.setattr(gi, "addresses", lambda h: named.get(h) or real(h))
    for node, address in named.items():
        with pytest.raises(RuntimeError, match=f"'{node}' resolves to loopback here "
                                               f"\\({re.escape(*address)}"):
            gi.set_gloo_interface({**over, "ASYNCRL_DATA_HOST": node})
    monkeypatch.undo()  # this machine's own interfaces, read for real
    found = {n: gi.interface_address(n) for _, n in socket.if_nameindex()}
    assert found.get("lo") == "127.0.0.1"
    for name, address in found.items():
        if address is not None and name != "lo":
            env = {**over, "ASYNCRL_DATA_HOST": address}
            gi.set_gloo_interface(env)
            assert env["GLOO_SOCKET_IFNAME"] == name


def test_a_secret_file_missing_on_a_host_names_tmpdir(tmp_path):
    from asyncrl.comm.auth import read_secret

    with pytest.raises(FileNotFoundError, match=f"secret file {tmp_path}/none is not on host "
                                                f".*point TMPDIR at a folder on the shared"):
        read_secret(str(tmp_path / "none"))
