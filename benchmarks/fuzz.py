"""Fuzzing the live sockets: a running controller's ROUTER, a rank's DEALER and a host relay's
DEALER (both through the live ROUTER) and a rank's data-plane server get random, truncated,
unsigned, forged, replayed and oversized frames (seeded); afterwards no group may be dead and
a valid call and a worker-to-worker transfer must still succeed.

    {"bench": "fuzz", "frames": N, "crashes": 0, "dropped": {...}, "seconds": ...}

Run: `.venv/bin/python benchmarks/fuzz.py [--frames 20000] [--seed 0]`. Driver code stays
behind __main__ (the ranks import this file to find the workers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import torch
import zmq
import zmq.asyncio
from machine import describe, version

import asyncrl
from asyncrl import TensorBatch
from asyncrl.comm import messages
from asyncrl.comm.auth import Signer, read_secret


class Target(asyncrl.Worker):
    @asyncrl.register
    def add(self, a: int, b: int) -> int:
        return a + b

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def make(self, n: TensorBatch) -> TensorBatch:
        return TensorBatch({"x": n["i"].float()})

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def total(self, batch: TensorBatch) -> float:
        return float(batch["x"].sum())


def frames_of(rng: random.Random, valid: list[list[bytes]]) -> list[bytes]:
    """One hostile multipart message: garbage, a valid one cut short or bit-flipped, a
    replay, a forged signature, or something very large."""
    kind = rng.randrange(6)
    if kind == 0:  # garbage parts
        return [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 6))]
    if kind == 1 and valid:  # a valid message, truncated
        msg = list(rng.choice(valid))
        i = rng.randrange(len(msg))
        msg[i] = msg[i][:rng.randrange(0, max(1, len(msg[i])))]
        return msg[:rng.randrange(1, len(msg) + 1)]
    if kind == 2 and valid:  # a valid message with one byte flipped
        msg = list(rng.choice(valid))
        i = rng.randrange(len(msg))
        if msg[i]:
            b = bytearray(msg[i])
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            msg[i] = bytes(b)
        return msg
    if kind == 3 and valid:  # replayed as is
        return list(rng.choice(valid))
    if kind == 4:  # signed with another key
        body = messages.encode(rng.choice([messages.Shutdown(), messages.Heartbeat(),
                                           messages.Release([1, 2, 3])]))
        return Signer(rng.randbytes(32)).sign(b"fuzz/0/io/1", body)
    return [rng.randbytes(rng.choice([1 << 20, 4 << 20]))]  # oversized


async def fuzz(total: int, seed: int) -> dict:
    rng = random.Random(seed)
    async with asyncrl.Controller(heartbeat_interval=0.5, heartbeat_timeout=10,
                                  echo_logs=False) as ctl:
        target = await ctl.spawn(Target, nprocs=2, name="target")
        sink = await ctl.spawn(Target, nprocs=1, name="sink")
        relayed = await ctl.spawn(Target, nprocs=2, name="relayed", relay=True)
        secret = read_secret(str(ctl.secret_file))
        good = Signer(secret)
        valid = [good.sign(b"fuzz/0/io/1", messages.encode(messages.Heartbeat()))
                 for _ in range(8)]
        ctx = zmq.asyncio.Context()
        intruder = ctx.socket(zmq.DEALER)
        intruder.setsockopt(zmq.IDENTITY, b"fuzz/0/io/1")
        intruder.connect(ctl.channel.address)
        data = ctx.socket(zmq.DEALER)
        data.connect(target.ranks[0].data_addr)
        rank_io = target.ranks[1].identity
        relay = ctl.relay_of[relayed.ranks[0].identity]  # its host's relay (rank 0's thread)
        t0 = time.perf_counter()
        for i in range(total):
            msg = frames_of(rng, valid)
            where = i % 4
            if where == 0:
                await intruder.send_multipart(msg)
            elif where == 1:
                ctl.channel.send_frames([rank_io, *msg])
            elif where == 2:
                ctl.channel.send_frames([relay, *msg])
            else:
                await data.send_multipart(msg)
            if i % 500 == 0:
                await asyncio.sleep(0)  # let the controller's loop run
        seconds = time.perf_counter() - t0
        intruder.close(0)
        data.close(0)
        ctx.term()
        crashes = 0
        try:
            ok = await asyncio.wait_for(target.add(2, 3), 30) == [5, 5]
            ok = ok and await asyncio.wait_for(relayed.add(2, 3), 30) == [5, 5]
            moved = await asyncio.wait_for(sink.total(target.make(TensorBatch(
                {"i": torch.arange(10)}))), 30)
            ok = ok and sum(moved) == 45.0
        except Exception:  # noqa: BLE001 - any failure afterwards is what we count
            ok = False
        crashes += 0 if ok else 1
        crashes += sum(g.dead is not None for g in (target, sink, relayed))
        return {"bench": "fuzz", "frames": total, "crashes": crashes,
                "dropped": {"controller": ctl.dropped_frames,
                            "rank": target.dropped_frames[1],
                            "relay": relayed.dropped_frames[0]},
                "seconds": round(seconds, 2),
                **describe(torch=torch.__version__, pyzmq=zmq.__version__,
                           libzmq=zmq.zmq_version(), msgspec=version("msgspec"),
                           asyncrl=asyncrl.__version__)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frames", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(json.dumps(asyncrl.run(fuzz(args.frames, args.seed))), flush=True)


if __name__ == "__main__":
    main()
