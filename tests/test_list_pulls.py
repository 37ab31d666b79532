"""Pulls of list columns (a list of images or long texts a row) and of whole values that are
mostly strings or bytes: they come inside the reply's signed message, not as tensor frames,
and are given time and buckets for their bytes all the same."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq
from test_pulls import SECRET, Producer, served

import asyncrl
from asyncrl.comm import codec, dataplane, dataserver, messages
from asyncrl.comm.remote import Piece, RemoteBatch, Shard
from asyncrl.futures.store import schema_of


def test_list_rows_pulled_over_a_slow_link_are_given_time_for_their_bytes(monkeypatch):
    """A list column's rows come in the reply's message; their bytes were counted nowhere
    (schema nbytes 128 for 512 MiB of images a row), so a pull of them had transfer_timeout
    of silence alone: TransferTimeout every time, the bytes still on their way."""
    rows = 1000
    stored = asyncrl.TensorBatch({"text": [f"{r:07}" * 8 for r in range(rows)]})
    schema = schema_of(stored)  # (the producer's estimate: ~57 bytes a row)
    monkeypatch.setattr(dataplane, "LINK_MIN_RATE", rows * 56 / 5)  # 5 s worth at it
    ctx = zmq.Context()
    producer = Producer(ctx)

    def script():
        who, req = producer.pull()
        time.sleep(0.6)  # the slow link: its bytes still on their way past the timeout
        lists = codec.encode({"text": stored["text"][req.start:req.stop]})
        producer.answer(who, messages.Pulled(req.xfer_id, lists=msgspec.Raw(lists)))

    producer.play(script)
    client = dataplane.DataClient(ctx, SECRET, "cons/0", "127.0.0.1", None, timeout=0.2)
    try:
        got = client.fetch_batch(RemoteBatch([Piece(producer.shard, 0, rows)],
                                             schema.columns))
        assert got["text"] == stored["text"] and schema.nbytes > rows * 56
    finally:
        assert producer.thread is not None
        producer.thread.join(10)
        client.close()
        producer.sock.close(0)
        ctx.term()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_rows_heavy_with_lists_are_pulled_in_buckets_of_their_bytes(monkeypatch, transport):
    """Buckets were sized by the tensor columns alone: rows of a few bytes of tensors and
    hundreds of MB of list items came as one pull, one message (held whole by ZeroMQ, given
    the time of its tensors only). A row's list bytes count now: ~50 bytes a row here."""
    monkeypatch.setattr(dataplane, "BUCKET_BYTES", 100)  # two rows a bucket
    x = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # 8 bytes a row
    stored = asyncrl.TensorBatch({"x": x, "text": [f"{r}" * 40 for r in range(6)]})
    sent: list[int] = []
    real_send = dataserver.DataServer._send

    def send(self, identity, body, buffers):
        reply = messages.decode(body)
        if isinstance(reply, messages.Pulled):
            sent.append(len(codec.decode(reply.lists)["text"]))
        real_send(self, identity, body, buffers)
    monkeypatch.setattr(dataserver.DataServer, "_send", send)
    with served({1: stored}, "lists", transport) as (shard, client):
        got = client.fetch_batch(RemoteBatch([Piece(shard, 0, 6)], schema_of(stored).columns))
        assert torch.equal(got["x"], x) and got["text"] == stored["text"]
    assert sent == [2, 2, 2]  # each pull's rows of the list column


def test_parts_whose_list_bytes_differ_concatenate_with_the_most():
    """Each producer estimates its own rows' list bytes: parts of one result differ in them
    (and must still concatenate), the pull of them all is given the most."""
    shard = Shard("g", 0, 1, "tcp://a:1", "h")
    short, long = (schema_of(asyncrl.TensorBatch({"t": [text] * 2})).columns
                   for text in ("ab", "ab" * 1000))
    both = RemoteBatch.concat([RemoteBatch([Piece(shard, 0, 2)], c) for c in (short, long)])
    assert both.columns == long and long[0].row_bytes > 2000


def test_a_whole_value_of_large_strings_or_bytes_counts_their_bytes():
    """A whole value's bytes counted its arrays only: a dict holding 512 MiB of bytes said
    0, and a pull of it had transfer_timeout of silence alone (TransferTimeout after 0.3 s,
    the bytes on their way). Small strings and numbers still do not count."""
    assert schema_of({"blob": b"x" * (5 << 20)}).nbytes >= 5 << 20
    assert schema_of(["t" * (1 << 20)] * 5).nbytes >= 5 << 20
    assert schema_of({"ids": list(range(10)), "x": torch.zeros(4)}).nbytes == 16
