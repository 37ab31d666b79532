"""What a peer's bytes must not make the controller do: import modules by a name it sent,
write its chosen identity raw into the log, or hash gigabytes in one turn of the loop."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import ROOT

NAMED_DTYPES = textwrap.dedent("""
    import sys
    import msgspec
    import torch
    from asyncrl.comm import buckets, codec

    LAZY = ("torch._dynamo", "torch._inductor", "torch.onnx")  # torch imports them on getattr
    assert not any(m in sys.modules for m in LAZY), [m for m in LAZY if m in sys.modules]

    def ext(name):  # a tensor as the codec puts it on the wire, of dtype `name`
        head = msgspec.msgpack.encode([name, [0]])
        return msgspec.msgpack.encode(msgspec.msgpack.Ext(
            codec.EXT_TENSOR, len(head).to_bytes(4, "big") + head))

    for name in ("_dynamo", "_inductor", "onnx", "qint8", "Tensor", 3):
        try:
            codec.decode(ext(name))
        except ValueError as e:
            assert "tensor dtype" in str(e), e
        else:
            raise AssertionError(f"dtype {name!r} decoded")
        if name != "qint8":  # (a column's dtype: torch makes the rows)
            try:
                buckets.row_bytes(name, ())
            except ValueError as e:
                assert "tensor dtype" in str(e), e
            else:
                raise AssertionError(f"row_bytes took dtype {name!r}")
    assert not any(m in sys.modules for m in LAZY), [m for m in LAZY if m in sys.modules]
    for dt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.complex64,
               torch.bool, torch.uint16, torch.int8):
        t = torch.ones(2, 3).to(dt)
        got = codec.decode(codec.encode(t))
        assert got.dtype == dt and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
        assert buckets.row_bytes(str(dt)[6:], (3,)) == 3 * dt.itemsize
    assert buckets.row_bytes("half", ()) == 2  # (torch's aliases, as getattr took them)
    print("ok")
""")


def test_a_dtype_name_from_a_peer_imports_nothing():
    """A tensor's dtype name (and a column's, from a producer's schema) was looked up with
    getattr(torch, name): "_inductor" made torch import its compiler (1.2 s on the loop,
    +71 MB, 800 modules) before the name was refused. In a process of its own: this one's
    modules are every test's."""
    out = subprocess.run([sys.executable, "-c", NAMED_DTYPES], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_a_peers_identity_cannot_forge_log_lines(caplog):
    """A dropped frame's warning named its route raw: an identity with a newline and a
    terminal escape wrote a line of its own into the controller's log."""
    from asyncrl.comm import auth

    forged = b"x\n[asyncrl] policy:0: no heartbeat for 30 s\x1b[2J"
    with caplog.at_level("WARNING", logger="asyncrl"):
        for route in (forged, b"\xff\xe2\x80\xae/0/io", b"g/0/io/tag"):
            verifier = auth.Verifier(b"s" * 32)  # (each says its first drop of a reason)
            verifier.verify(route, [b"\0" * 40, b"y" * 32])
            verifier.verify(route, [b"\0"])  # (a reason of its own: said too)
    said = [r.getMessage() for r in caplog.records]
    assert said and not any(c in m for m in said for c in "\n\r\x1b\u202e"), said
    assert any("from x\\n[asyncrl] policy:0" in m for m in said), said  # escaped, still read
    assert any("from g/0/io:" in m for m in said), said  # a rank's route as before


def test_one_turn_of_the_reader_hashes_a_bounded_number_of_bytes():
    """Each signed body is hashed before it is checked, and a turn of the reader took up to
    DRAIN_MAX messages whatever their size: three unsigned 2 GiB bodies held the loop ~3.6 s
    (ranks give the controller up after 3 s unheard). A turn now ends after DRAIN_BYTES."""
    from asyncrl.comm import channel
    from asyncrl.comm.auth import Verifier

    class Part:  # a part of `size` bytes, not allocated
        def __init__(self, size: int, more: bool):
            self.size, self.more, self.bytes = size, more, b"route"

        def __len__(self):
            return self.size

    class Flood:  # messages of 48 MiB bodies, without end
        closed, reads = False, 0

        def recv(self, flags, copy):
            self.reads += 1
            return Part((48 << 20) if self.reads % 3 == 2 else 32, self.reads % 3 != 0)

    ch = object.__new__(channel.ControllerChannel)
    sock = Flood()
    ch._sock, ch._scheduled, ch._partial, ch._excess = sock, False, [], 0
    ch._handle, ch._verifier = (lambda identity, msg: None), Verifier(b"s" * 32)
    seen: list = []
    ch._dispatch = lambda frames, handle: seen.append(len(frames[1]))
    later: list = []
    ch._loop = type("Loop", (), {"call_soon": lambda self, fn: later.append(fn)})()
    ch._drain()
    assert seen == [48 << 20] * 2 and later == [ch._drain]  # the rest in the next turns
    ch._scheduled = False
    ch._drain()
    assert len(seen) == 4 and sock.reads == 12
