"""Pieces without processes: the public API, codec, auth, TensorBatch, protocols."""

from __future__ import annotations

import hmac
import os
import textwrap

import msgspec
import numpy as np
import pytest
import torch

import asyncrl
from asyncrl.actors.protocols import Layout, get_protocol
from asyncrl.comm import codec, messages
from asyncrl.comm.auth import Signer, Verifier
from asyncrl.comm.refs import make_ref, resolve_ref

DP = asyncrl.Dispatch.DP


def test_public_api_is_the_facade():
    assert sorted(asyncrl.__all__) == sorted([
        "AsyncRLError", "CheckpointError", "ClosedError", "Controller", "Dispatch",
        "DistFuture", "EncodeError", "GroupDeadError", "GroupHandle", "Layout", "RemoteError",
        "SpawnError", "SpawnTimeout",
        "Split", "TensorBatch", "TransferTimeout", "Worker", "register", "register_protocol",
        "run", "DataFlow", "FlowError", "NodeError", "PlacementError", "colocate_with",
        "config", "group", "node", "nvlink_group", "same_host_as", "separate_from",
        "breakpoint"])
    for name in asyncrl.__all__:
        assert getattr(asyncrl, name) is not None


# -- codec ---------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [
    torch.randn(3, 4), torch.arange(5), torch.randn(2, 2).bfloat16(), torch.tensor(3.0),
    torch.empty(0, 3), torch.tensor([True, False]), torch.randn(4, 6)[:, ::2]])
def test_tensors_round_trip_exactly(t):
    out = codec.decode(codec.encode(t))
    assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)


def test_decoded_tensors_own_writable_memory():
    # 1-d and n-d, of a dtype numpy has and of one it lacks
    sent = [torch.arange(3), torch.ones(2, 2),
            torch.ones(2).bfloat16(), torch.ones(1, 2).bfloat16()]
    buf = bytearray(codec.encode(sent))
    out = codec.decode(buf)
    buf[:] = bytes(len(buf))  # the receive buffer is reused
    for t in out:
        t += 1
    assert [t.tolist() for t in out] == [[1, 2, 3], [[2, 2], [2, 2]], [2, 2], [[2, 2]]]


def test_values_round_trip():
    batch = asyncrl.TensorBatch({"x": torch.randn(4, 2), "s": ["a", "b", "c", "d"]}, {"k": 1})
    value = {"b": batch, "n": np.arange(3.0), "cls": asyncrl.TensorBatch, "f": codec.encode,
             "nested": [1, "two", None, {"3": 4.5}], "np_scalar": np.float32(2.5)}
    out = codec.decode(codec.encode(value))
    assert torch.equal(out["b"]["x"], batch["x"]) and out["b"]["s"] == batch["s"]
    assert out["b"].meta == {"k": 1}
    assert np.array_equal(out["n"], value["n"])
    assert out["cls"] is asyncrl.TensorBatch and out["f"] is codec.encode
    assert out["nested"] == value["nested"] and out["np_scalar"] == 2.5


@pytest.mark.parametrize("value, message", [
    (lambda: 0, "lambda"), (object(), "builtins.object cannot be sent"),
    (np.array([object()]), "numpy array of Python objects")])
def test_unsendable_values_are_refused_never_pickled(value, message):
    with pytest.raises(TypeError, match=message):
        codec.encode(value)


def test_call_encoding_names_the_failing_argument():
    with pytest.raises(codec.ArgEncodeError) as info:
        codec.encode_call((1, 2), {"fn": lambda: 0}, ["a", "b"])
    assert info.value.name == "fn"
    args, kwargs = codec.decode_call(codec.encode_call((1, [2]), {"k": "v"}, ["a", "b"]))
    assert args == [1, [2]] and kwargs == {"k": "v"}


def test_classes_from_a_script_resolve_by_path(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent("""
        import asyncrl
        class Mine(asyncrl.Worker):
            pass
        if __name__ == "__main__":
            raise SystemExit("the guard must stay off when loaded by path")
    """))
    cls = resolve_ref("user_script", "Mine", str(script))  # not importable by name here
    assert cls.__name__ == "Mine" and issubclass(cls, asyncrl.Worker)
    assert resolve_ref(*make_ref(cls)) is cls


def test_malformed_messages_raise_decode_errors_not_crashes():
    for junk in (b"", b"\xc1", b"\x93\x01\x02", messages.encode(messages.Heartbeat())[:-1]):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            messages.decode(junk)


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
        assert mac == hmac.digest(secret, b"g/0/io/1" + body, "sha256")


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
def _dp(mesh, rows, method_rows=1):
    layout = Layout("g", tuple(mesh.items()))
    proto = get_protocol(DP.value)
    batch = asyncrl.TensorBatch({"x": torch.arange(rows)})
    split = proto.split(layout, (batch,), {})
    results = {}
    for r in split.collect:
        (chunk,), _ = split.calls[r]
        results[r] = asyncrl.TensorBatch({"x": chunk["x"].repeat_interleave(method_rows)})
    return layout, split, proto.collect(layout, results, split.state)


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 9])
@pytest.mark.parametrize("method_rows", [1, 2])
def test_dp_keeps_every_real_row_in_order(rows, method_rows):
    _, split, out = _dp({"dp": 4}, rows, method_rows)
    assert out["x"].tolist() == torch.arange(rows).repeat_interleave(method_rows).tolist()
    sizes = {len(args[0]) for args, _ in split.calls.values()}
    assert len(sizes) == 1  # every rank gets the same number of rows (collectives line up)


def test_dp_marks_padding_and_feeds_replicas_the_same_chunk():
    layout, split, _ = _dp({"dp": 2, "tp": 2}, 3)
    assert split.collect == [0, 2]
    chunk = {r: args[0] for r, (args, _) in split.calls.items()}
    assert chunk[0] is chunk[1] and chunk[2] is chunk[3]
    assert chunk[0].meta.get("dp_pad", 0) == 0 and chunk[2].meta["dp_pad"] == 1
    assert chunk[2]["x"].tolist() == [2, 2]  # the padding row repeats a real row


def test_mesh_coordinates_are_row_major():
    layout = Layout("g", (("dp", 2), ("tp", 3)))
    assert [layout.coords(r) for r in (0, 1, 3, 5)] == [
        {"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 2}]


def test_register_rejects_unknown_protocols():
    with pytest.raises(ValueError, match="unknown dispatch protocol 'nope'"):
        asyncrl.register(dispatch="nope")
    with pytest.raises(ValueError, match="built in"):
        asyncrl.register_protocol("dp", split=lambda *a: None, collect=lambda *a: None)
