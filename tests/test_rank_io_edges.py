"""What a rank reads and writes at the edges: bytes that are not UTF-8 on the debugger's
connection, and line ends split between two reads of the rank's output."""

from __future__ import annotations

import random
import socket

import test_debugger
from test_debugger import _connect, _stops_then_calls_helper, _until

from asyncrl.actors.debugger import _Conn
from asyncrl.actors.output import split_lines

rank = test_debugger.rank  # the fixture: breakpoint() on a thread here, as on a rank


def test_the_debugger_connection_replaces_what_is_not_utf8_rather_than_ending():
    """A byte that is not UTF-8 read as end of input (pdb continued, the stop was lost);
    a lone surrogate written dropped its line."""
    here, there = socket.socketpair()
    conn = _Conn(here)
    there.settimeout(30)
    try:
        there.sendall(b"p \xe9t\xe9\n")
        assert conn.readline() == "p \ufffdt\ufffd\n"
        conn.write("name: \udcff.txt\n")
        conn.write("after\n")
        conn.flush()
        assert _until(there, b"after\n") == "name: \\udcff.txt\nafter\n"
    finally:
        conn.close()
        there.close()


def test_a_non_utf8_byte_typed_into_pdb_keeps_the_session(rank):
    """From a latin-1 terminal, `p 'café'`: the rank said "continuing" and closed."""
    rank.start("call", _stops_then_calls_helper)
    rank.next_stop()
    with _connect(rank.session()) as sock:
        _until(sock, b"(asyncrl-pdb g:0)")
        sock.sendall(b"p 'caf\xe9'\n")
        said = _until(sock, b"(asyncrl-pdb g:0)")
        assert "'caf\ufffd'" in said and "continuing" not in said
        sock.sendall(b"p x\n")
        assert _until(sock, b"(asyncrl-pdb g:0)").startswith("20\n")
        sock.sendall(b"!print('\\udcff')\n")  # a lone surrogate: shown escaped
        assert _until(sock, b"(asyncrl-pdb g:0)").startswith("\\udcff\n")
        sock.sendall(b"c\n")
        assert "continuing" in _until(sock, b"\n")
    rank.join()
    assert rank.results == {"call": 42}


def _split(chunks: list[bytes]) -> list[bytes]:
    """The lines of `chunks` read one after another, as the output reader splits them."""
    lines, rest = [], b""
    for chunk in chunks:
        more, rest = split_lines(rest + chunk)
        lines += more
    return lines + ([rest.rstrip(b"\r")] if rest.rstrip(b"\r") else [])


def test_a_line_ending_in_cr_cr_lf_split_between_reads_makes_no_blank_line():
    lines, rest = split_lines(b"a\r\r")
    more, rest = split_lines(rest + b"\nb\n")
    assert (lines + more, rest) == ([b"a", b"b"], b"")
    assert split_lines(b"\r" * 100_000) == ([], b"\r")  # a run of them is held as one


def test_output_split_between_reads_gives_the_lines_of_the_whole():
    chance = random.Random(9)
    for _ in range(5000):
        data = bytes(chance.choice(b"a\r\n") for _ in range(chance.randint(0, 14)))
        cuts = sorted(chance.sample(range(len(data) + 1), min(len(data), chance.randint(0, 4))))
        chunks = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert _split(chunks) == _split([data]), chunks
