"""A driver for tests/test_security.py, run under a sitecustomize that records every unpickling.

usage: python no_pickle.py MARKER

Real groups and calls: arguments and results both ways, a TensorBatch produced on one group
pulled worker to worker by another (over TCP: the rows cross a socket), a result too big to
come inline (fetched). Then pickles whose __reduce__ would create MARKER, thrown at the
controller's ROUTER, at a rank's DEALER (through the live ROUTER) and at a rank's data server
— raw, and signed with the run's secret so that they pass the MAC and reach the decoders —
and the same calls again. Prints one JSON line: what each socket dropped.
"""

import asyncio
import json
import os
import pickle
import sys

import msgspec
import torch
import zmq
import zmq.asyncio

import asyncrl
from asyncrl import TensorBatch
from asyncrl.comm import messages
from asyncrl.comm.auth import Signer, read_secret


class Target(asyncrl.Worker):
    @asyncrl.register
    def add(self, a, b):
        return a + b

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def make(self, n: TensorBatch) -> TensorBatch:
        return TensorBatch({"x": n["i"].float() * 2, "s": [str(int(i)) for i in n["i"]]})

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def total(self, batch: TensorBatch) -> float:
        return float(batch["x"].sum())

    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def big(self) -> torch.Tensor:
        return torch.ones(100_000)  # 400 KB: more than a Result carries, fetched on await


class Boom:
    """Unpickling this creates the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


async def calls(prod: asyncrl.GroupHandle, cons: asyncrl.GroupHandle) -> None:
    assert await prod.add(2, 3) == [5, 5]
    summed = await prod.add(torch.arange(3.0), torch.ones(3))  # tensors both ways
    assert all(torch.equal(t, torch.tensor([1.0, 2.0, 3.0])) for t in summed)
    made = prod.make(TensorBatch({"i": torch.arange(10)}))
    assert await cons.total(made) == [90.0]
    assert (await made)["s"] == [str(i) for i in range(10)]
    assert float((await prod.big()).sum()) == 100_000.0


async def main(marker: str) -> dict:
    bomb = pickle.dumps(Boom(marker))
    async with asyncrl.Controller(transport="tcp", echo_logs=False) as ctl:
        prod = await ctl.spawn(Target, nprocs=2, name="prod")
        cons = await ctl.spawn(Target, nprocs=1, name="cons")
        await calls(prod, cons)
        secret = read_secret(str(ctl.secret_file))
        ctx = zmq.asyncio.Context()

        # the controller's ROUTER: raw, and signed (passes the MAC, then fails to decode)
        intruder = ctx.socket(zmq.DEALER)
        intruder.setsockopt(zmq.IDENTITY, b"prod/0/io/1")
        intruder.connect(ctl.channel.address)
        for frames in ([bomb], [bomb, bomb], [bomb, bytes(32)],  # (a MAC's size, wrong)
                       Signer(secret).sign(b"prod/0/io/1", bomb)):
            await intruder.send_multipart(frames)

        # a rank's DEALER, through the live ROUTER: raw, signed, and as a Call's arguments
        rank = prod.ranks[0]
        route = b">" + rank.identity
        ctl.channel.send_frames([rank.identity, bomb])
        ctl.channel.send_frames([rank.identity, *ctl.channel._signer.sign(route, bomb)])
        ctl.channel.send(rank.exec_identity, messages.Call(10**9, "add", msgspec.Raw(bomb)))

        # a rank's data server: raw, and a signed "pull" that is a pickle
        data = ctx.socket(zmq.DEALER)
        data.setsockopt(zmq.IDENTITY, b"cons/0/pull9")
        data.connect(rank.data_addr)
        pull_route = b"cons/0/pull9@" + rank.data_addr.encode()
        for frames in ([bomb], [bomb, bomb], Signer(secret).sign(pull_route, bomb)):
            await data.send_multipart(frames)

        await calls(prod, cons)  # after everything above, in order on each socket
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        # the rank's drops arrive with its heartbeats: a bounded poll
        while prod.dropped_frames[0] < 5 and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        intruder.close(0)
        data.close(0)
        ctx.term()
        return {"controller": ctl.dropped_frames, "rank": prod.dropped_frames[0],
                "dead": [g.name for g in (prod, cons) if g.dead is not None],
                "pids": [*prod.pids.values(), *cons.pids.values()]}


if __name__ == "__main__":
    result = asyncrl.run(main(sys.argv[1]))
    result["marker"] = os.path.exists(sys.argv[1])
    result["driver"] = os.getpid()
    print(json.dumps(result), flush=True)
