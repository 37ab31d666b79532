"""A driver that spawns a 2-rank group, prints its pids as JSON, and waits forever.

usage: asyncrl launch hold.py [--orphanable] [--pull]
  --orphanable: torchrun does not die with the controller, so only the ranks' heartbeat
                watchdog can end them when the controller is killed.
  --pull: the group's ranks first pull rows from another group's (into their shared
          memory); the JSON has the run's id too.
"""

import asyncio
import faulthandler
import json
import signal
import sys

import asyncrl


class Idle(asyncrl.Worker):
    @asyncrl.register
    def ping(self):
        return self.rank

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def take(self, batch: asyncrl.TensorBatch) -> int:
        return len(batch)


class Maker(asyncrl.Worker):
    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def make(self, batch: asyncrl.TensorBatch) -> asyncrl.TensorBatch:
        return asyncrl.TensorBatch({"x": batch["i"].double().repeat_interleave(1000)
                                    .view(len(batch), 1000)})


async def main():
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test's view of a hang
    print(f"hold: SIGINT handler {signal.getsignal(signal.SIGINT)!r}", file=sys.stderr,
          flush=True)
    orphanable = "--orphanable" in sys.argv
    async with asyncrl.Controller(heartbeat_interval=0.2, heartbeat_timeout=2.0,
                                  die_with_controller=not orphanable) as ctl:
        group = await ctl.spawn(Idle, nprocs=2)
        assert await group.ping() == [0, 1]
        pids = list(group.pids.values())
        if "--pull" in sys.argv:
            import torch

            maker = await ctl.spawn(Maker, nprocs=1)
            made = maker.make(asyncrl.TensorBatch({"i": torch.arange(8)}))
            assert sum(await group.take(made)) == 8
            pids += list(maker.pids.values()) + [maker.agent.pid]
        print(json.dumps({"agent": group.agent.pid, "ranks": pids, "run": ctl.run_id}),
              flush=True)
        await asyncio.Event().wait()
