"""A driver that spawns a 2-rank group, prints its pids as JSON, and waits forever.

usage: asyncrl launch hold.py [--orphanable]
  --orphanable: torchrun does not die with the controller, so only the ranks' heartbeat
                watchdog can end them when the controller is killed.
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


async def main():
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test's view of a hang
    print(f"hold: SIGINT handler {signal.getsignal(signal.SIGINT)!r}", file=sys.stderr,
          flush=True)
    orphanable = "--orphanable" in sys.argv
    async with asyncrl.Controller(heartbeat_interval=0.2, heartbeat_timeout=2.0,
                                  die_with_controller=not orphanable) as ctl:
        group = await ctl.spawn(Idle, nprocs=2)
        assert await group.ping() == [0, 1]
        print(json.dumps({"agent": group.agent.pid, "ranks": list(group.pids.values())}),
              flush=True)
        await asyncio.Event().wait()
