"""Pulls at the edges of what a batch can be: no rows at all."""

from __future__ import annotations

import pytest
import torch
from test_pulls import served

import asyncrl
from asyncrl.comm import messages
from asyncrl.comm.remote import Piece, RemoteBatch


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_batch_of_no_rows_is_pulled_as_empty_columns(transport):
    """A producer's 0-row result (a filter kept nothing), passed whole or as the empty
    chunks of a DP split: its columns were built on np.empty(0), whose stride 0 torch
    refused to view as float32 ("self.stride(-1) must be 1")."""
    empty = {"x": torch.zeros(0, 3), "i": torch.zeros(0, dtype=torch.long), "t": []}
    store = {1: asyncrl.TensorBatch(empty)}
    with served(store, "empty", transport) as (shard, client):
        cols = [messages.Column("x", "float32", (3,)), messages.Column("i", "int64", ()),
                messages.Column("t", "list", ())]
        whole = RemoteBatch([Piece(shard, 0, 0)], cols)
        for rb in [whole, *whole.chunk(2, pad=True), whole.slice(0, 0), whole.take([])]:
            got = client.fetch_batch(rb)
            assert got["x"].shape == (0, 3) and got["x"].dtype == torch.float32
            assert got["i"].shape == (0,) and got["i"].dtype == torch.int64
            assert got["t"] == []
