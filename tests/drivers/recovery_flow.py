"""A two-group flow for the recovery tests: a stateless scorer and a stateful trainer.

    step t ──▶ score (scorer: t * 10) ──▶ train (trainer: appends (t, score) to its history;
                                                 with mixed=1, then asks the scorer to echo t)
    peek=1: score first reads the trainer (so it is never re-run) and train awaits score's
    value (a death it did not call, which re-running train cannot repair)
    collective=1: the scorer has two ranks that all-reduce, score awaits it (an async node);
    a hold there holds rank 1 only, so killing it breaks rank 0's collective

`hold=<group>:<step>`: that group's call of that step, on its first try only, writes its pid
to `<marks>/<group>.pid` and waits there until the test kills or stops it. `wait=<group>:
<step>`: that call writes `<marks>/<group>.waiting` and waits until the test writes
`<marks>/go`. `staleness=k`: steps t-k-2 to t in flight (more to overlap). `draw=1`: a
node draws a random number per step on the controller (seeded: a rewind draws the same ones
again). `fail_build=1`: the first scorer built after the held one died raises in __init__
(a respawn that fails to build). `pair=1`: score returns two futures, the scorer's pid
(done first) and [its pid, the score]; train checks they are of one attempt. `die_saving=
<step>`: the scorer's rank exits while that step's checkpoint is saved (once). `die_loading=
1`: the trainer's rank exits the first time it loads a checkpoint (a rewind's). `slow_save=S`:
the trainer's first save of die_saving's step takes S seconds (a large model's). The trainer's
history is in every checkpoint (trainer/history.json): a run that recovered must hold each
step exactly once.
"""

import json
import os
import random
import time
from pathlib import Path

import asyncrl

cfg = asyncrl.config(steps=6, hold="", marks="", checkpoint_every=2, restarts=2, mixed=0,
                     peek=0, collective=0, wait="", staleness=0, draw=0, fail_build=0, pair=0,
                     die_saving=0, die_loading=0, slow_save=0.0)
HOLD_GROUP, _, HOLD_STEP = cfg["hold"].partition(":")
WAIT_GROUP, _, WAIT_STEP = cfg["wait"].partition(":")


def _wait(group: str, step: int) -> None:
    if group != WAIT_GROUP or step != int(WAIT_STEP):
        return
    marks = Path(cfg["marks"])
    (marks / f"{group}.waiting").write_text(str(os.getpid()))
    deadline = time.monotonic() + 60  # bounded: a test that never lets it go fails
    while not (marks / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{group} waited at step {step} and was never let go")
        time.sleep(0.05)


def _hold(group: str, step: int) -> None:
    if group != HOLD_GROUP or step != int(HOLD_STEP):
        return
    mark = Path(cfg["marks"]) / f"{group}.pid"
    if mark.exists():  # the re-run after the kill goes through
        return
    tmp = mark.with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, mark)
    deadline = time.monotonic() + 60  # bounded: a test that never kills fails, not hangs
    while time.monotonic() < deadline:
        time.sleep(0.05)
    raise TimeoutError(f"{group} held at step {step} and nobody killed it")


class Scorer(asyncrl.Worker):
    def __init__(self):
        # fail_build=1: the first scorer built after the held one was killed raises
        marks = Path(cfg["marks"]) if cfg["marks"] else None
        if cfg["fail_build"] and marks is not None and (marks / "scorer.pid").exists() and \
                not (marks / "build_failed").exists():
            (marks / "build_failed").write_text(str(os.getpid()))
            raise RuntimeError("the respawned scorer failed to build (once)")

    @asyncrl.register(dispatch="rank_zero")
    def score(self, step):
        _hold("scorer", step)
        return step * 10

    @asyncrl.register
    def score_all(self, step):  # every rank, through an all-reduce
        import torch
        import torch.distributed as dist

        if self.rank == 1:
            _hold("scorer", step)
        t = torch.tensor([float(step * 10)])
        dist.all_reduce(t)
        return t.item() / self.world_size

    @asyncrl.register
    def save_checkpoint(self, path):
        if cfg["die_saving"] and f"step_{cfg['die_saving']:06d}" in path:
            mark = Path(cfg["marks"]) / "scorer.died_saving"
            if not mark.exists():
                mark.write_text(str(os.getpid()))
                os._exit(9)
        return super().save_checkpoint(path)

    @asyncrl.register(dispatch="rank_zero")
    def tag(self, step):
        return os.getpid()

    @asyncrl.register(dispatch="rank_zero")
    def scored(self, step):
        _hold("scorer", step)
        return [os.getpid(), step * 10]

    @asyncrl.register(dispatch="rank_zero")
    def echo(self, step):
        _hold("echo", step)
        return step


class Trainer(asyncrl.Worker):
    def __init__(self):
        self.history = []

    @asyncrl.register(dispatch="rank_zero")
    def train(self, step, score):
        _hold("trainer", step)
        _wait("trainer", step)
        self.history.append([step, score])
        if cfg["marks"]:  # the tests kill a scorer once the step before is trained: before,
            # train might still be pulling that step's score from it (a lost input: a rewind)
            (Path(cfg["marks"]) / f"trained.{step}").touch()
        return {"trained": len(self.history), "seen": step}

    @asyncrl.register(dispatch="rank_zero")
    def trained(self):
        return len(self.history)

    def save_state(self, folder):
        if cfg["slow_save"] and f"step_{cfg['die_saving']:06d}" in str(folder):
            mark = Path(cfg["marks"]) / "trainer.saved_slowly"
            if not mark.exists():  # the first try only: the save made again is quick
                mark.write_text(str(os.getpid()))
                time.sleep(cfg["slow_save"])
        (folder / "history.json").write_text(json.dumps(self.history))

    def load_state(self, folder):
        if cfg["die_loading"]:
            mark = Path(cfg["marks"]) / "trainer.died_loading"
            if not mark.exists():
                mark.write_text(str(os.getpid()))
                os._exit(9)
        self.history = json.loads((folder / "history.json").read_text())


scorer = asyncrl.group(Scorer, name="scorer", nprocs=2 if cfg["collective"] else 1,
                       max_restarts=cfg["restarts"], restart_backoff=0.1)
trainer = asyncrl.group(Trainer, name="trainer", max_restarts=cfg["restarts"],
                        restart_backoff=0.1)


@asyncrl.node
async def score(step):
    if cfg["collective"]:
        return (await scorer.score_all(step))[0]
    if cfg["peek"]:
        trainer.trained()
    if cfg["pair"]:
        tag = scorer.tag(step)
        await tag  # done before the other is called
        return [tag, scorer.scored(step)]
    return scorer.score(step)


@asyncrl.node
async def train(step, score):
    if cfg["peek"]:
        score = await score
    if cfg["pair"]:
        tag, (pid, score) = await score[0], await score[1]
        if tag != pid:
            raise RuntimeError(f"step {step}: the node's outputs come from two attempts")
    out = trainer.train(step, score)
    if cfg["mixed"]:  # a stateless group called after a stateful one: never re-run
        assert await scorer.echo(step) == step
    return out


@asyncrl.node
def noise(step):
    return random.random()


if cfg["draw"]:
    random.seed(0)
flow = asyncrl.DataFlow(nodes=[score, train] + ([noise] if cfg["draw"] else []),
                        inputs={"step": list(range(cfg["steps"]))},
                        checkpoint_every=cfg["checkpoint_every"],
                        max_staleness=cfg["staleness"])  # k: steps t-k-2.. in flight
