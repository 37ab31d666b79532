"""DataFlow: building and checking the graph, placement, running steps on real groups, state
edges across steps, and `asyncrl launch / run / timeline` end to end."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import subprocess
import sys
import time
from typing import NamedTuple

import pytest
import torch
from helpers import ROOT, run, tensorboard_scalars, wandb_history

import asyncrl
from asyncrl.controller.launch import Metrics, load_inputs
from asyncrl.controller.launcher import rank_env
from asyncrl.controller.objects import ObjectRef
from asyncrl.controller.placement import Host, Placer
from asyncrl.controller.timeline import Event, Timeline
from asyncrl.controller.trackers import Wandb
from asyncrl.errors import SettingError
from asyncrl.rl import PromptSource


# -- the graph (no processes) ----------------------------------------------------------------
@asyncrl.node
def gen(prompts):
    return prompts


@asyncrl.node
def judge(gen):
    return gen


@asyncrl.node
def learn(gen, judge, reference=None):
    return (gen, judge, reference)


def test_graph_is_built_from_parameter_names():
    flow = asyncrl.DataFlow(nodes=[learn, judge, gen], inputs={"prompts": [1]})
    assert flow.order == ["gen", "judge", "learn"]
    assert flow.deps["learn"] == {"gen": ("node", "gen"), "judge": ("node", "judge"),
                                  "reference": None}  # optional: no node provides it


def test_saved_inputs_note_where_futures_were_and_get_them_back():
    """What `--save-inputs` writes for `asyncrl run --node`: values, and the paths of the
    DistFutures among them (in lists, tuples and dicts), made done futures again."""
    from asyncrl.comm import codec
    from asyncrl.futures.future import held_at, resolved

    async def main():
        given = {"a": [1, asyncrl.DistFuture.held({"x": 5}, "p")], "b": "s",
                 "c": (asyncrl.DistFuture.held(7, "q"), 2)}
        found: list = []
        saved = codec.decode(codec.encode(await resolved(given, found=found)))
        assert saved == {"a": [1, {"x": 5}], "b": "s", "c": [7, 2]} and found == [
            ["a", 1], ["c", 0]]
        again = saved
        for path in found:
            again = held_at(again, path, "saved")
        assert isinstance(again["a"][1], asyncrl.DistFuture) and again["a"][0] == 1
        return await again["a"][1], await again["c"][0], again["c"][1]
    assert asyncio.run(main()) == ({"x": 5}, 7, 2)


@asyncrl.node
def numbered(prompts, step):
    return {"seen": [prompts, step]}


def test_a_parameter_named_step_gets_the_step_index_unless_an_input_has_that_name():
    """Validation every N steps needs the step: a built-in source, which a rewind and a
    resume give again as they are (an iterator input such as itertools.count() could not be
    read again from a checkpoint's position)."""
    flow = asyncrl.DataFlow(nodes=[numbered], inputs={"prompts": [10, 20, 30]}, groups=[])
    assert flow.deps["numbered"] == {"prompts": ("input", "prompts"), "step": ("step", "step")}
    shadowed = asyncrl.DataFlow(nodes=[numbered], inputs={"prompts": [1, 2], "step": [7, 9]},
                                groups=[])
    assert shadowed.deps["numbered"]["step"] == ("input", "step")

    async def main():
        async with asyncrl.Controller():
            first = await flow.run()
            await shadowed.open(asyncrl.Controller.current())
            try:
                shadowed.resume_at(1, {"prompts": {"consumed": 1}, "step": {"consumed": 1}})
                resumed = await shadowed.run()
            finally:
                await shadowed.close()
            return first, resumed
    first, resumed = run(main())
    assert [v["numbered"]["seen"] for v in first] == [[10, 0], [20, 1], [30, 2]]
    assert [v["numbered"]["seen"] for v in resumed] == [[2, 9]]


@asyncrl.node
def paired(prompts, offsets):
    return {"x": prompts["x"], "offset": offsets}


def test_an_input_that_ends_leaves_the_ones_before_it_where_the_steps_left_them():
    """Two inputs, the second shorter: the step that finds it ended has already read the
    first's next batch, which no step uses. The position saved at the run's end (its last
    checkpoint) is the one the last step left: resumed from it, the run reads that batch."""
    def source():
        return PromptSource([{"x": i} for i in range(8)], batch_size=2, seed=3, epochs=None)
    prompts = source()
    flow = asyncrl.DataFlow(nodes=[paired], inputs={"prompts": prompts, "offsets": [0, 1]},
                            groups=[])

    async def main():
        async with asyncrl.Controller():
            return await flow.run(), flow.positions()
    out, positions = run(main())
    straight = iter(source())
    assert [v["paired"]["x"] for v in out] == [next(straight)["x"] for _ in range(2)]
    resumed = source()
    resumed.load_state_dict(positions["prompts"])
    assert resumed.next_batch()["x"] == next(straight)["x"]


def test_out_suffix_and_input_mapping():
    @asyncrl.node(inputs={"x": "gen_out"}, name="copy")
    def copy_of(x):
        return x

    flow = asyncrl.DataFlow(nodes=[gen, copy_of], inputs={"prompts": 1})
    assert flow.deps["copy"] == {"x": ("node", "gen")}


def test_a_0d_tensor_or_array_input_is_a_constant_and_an_input_iter_refuses_is_named():
    """Issue 4: an input is an iterable (an item a step) or a constant. A 0-d tensor or array
    has __iter__: it was read as an iterable and failed once the groups had started,
    "iteration over a 0-d tensor", naming no input."""
    class Broken:
        def __iter__(self):
            raise TypeError("not today")

    def flow(source):  # (no groups)
        return asyncrl.DataFlow(nodes=[gen], inputs={"prompts": source}, groups=[])

    async def main():
        async with asyncrl.Controller():
            with pytest.raises(asyncrl.FlowError, match="input 'prompts': a Broken has "
                               "__iter__ but cannot be iterated"):
                await flow(Broken()).run(steps=1)
            return [await flow(x).run(steps=2) for x in (torch.tensor(0.5),
                                                         torch.tensor(0.5).numpy())]
    for values in run(main()):
        assert [float(v["gen"]) for v in values] == [0.5, 0.5]


def test_config_overrides(monkeypatch):
    monkeypatch.setenv("ASYNCRL_OVERRIDES", json.dumps({"lr": 0.1}))
    monkeypatch.delenv("ASYNCRL_OVERRIDES_CHECKED", raising=False)  # (a launcher's, once
    # it found every key declared by a call: then a call takes those it declares)
    assert asyncrl.config(lr=1.0, steps=3) == {"lr": 0.1, "steps": 3}
    with pytest.raises(SettingError, match="unknown setting\\(s\\) \\['lr'\\]"):
        asyncrl.config(steps=3)


# -- placement (a described host) -----------------------------------------------------------
def test_cpu_placement_keeps_groups_apart_where_cores_allow(caplog):
    p = Placer(Host(0, (0, 1, 2, 3)))
    assert p.place("policy", 2, None).env == {"ASYNCRL_CPUS": "0,1"}
    assert p.place("reward", 1, asyncrl.separate_from("policy")).devices == [2]
    assert p.place("hybrid", 2, asyncrl.colocate_with("policy")).devices == [0, 1]
    assert p.place("other", 1, None).devices == [3]  # the least used core
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        shared = p.place("big", 4, [asyncrl.separate_from("policy"),
                                    asyncrl.separate_from("reward")])
    assert shared.devices == [3] and "ranks will share cores" in caplog.text


def test_metric_names_keep_full_names_and_add_tokens_per_second(tmp_path):
    metrics = Metrics(tmp_path, 2, Timeline())
    metrics(0, {"train": {"loss": 1.0, "reward/mean": 0.5, "perf/tokens": 100,
                          "stats": {"kl": 0.1, "actor/lr": 0.01}, "ok": True},
                "score": 3}, 2.0)
    metrics.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row == {"step": 0, "time/step_s": 2.0, "train/loss": 1.0, "reward/mean": 0.5,
                   "perf/tokens": 100.0, "train/stats/kl": 0.1, "actor/lr": 0.01,
                   "score": 3.0, "perf/tokens_per_s": 50.0}
    metrics = Metrics(tmp_path, 2, Timeline())  # a diverging loss shows (it was dropped)
    metrics(1, {"train": {"loss": float("nan"), "grad_norm": float("inf")}}, 1.0)
    metrics.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])
    assert row["train/loss"] is None and row["train/grad_norm"] is None


def test_metrics_read_their_own_step_and_a_rewind_drops_later_steps(tmp_path):
    tl = Timeline()
    for t in range(3):
        tl.add(Event("policy", "rollout", t, 10.0 * t, 10.0 * t + 1 + t))
        tl.add(Event("policy", "train", t, 10.0 * t + 5, 10.0 * t + 6))
    metrics = Metrics(tmp_path, 3, tl)
    metrics(1, {}, 10.0)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "actor/lo')  # a row cut short by a kill: dropped, not fatal
    metrics.rewind(0)  # steps 1 and 2 run again
    assert [e.step for e in tl.events] == [0, 0] and tl.of_step(1) == tl.of_step(2) == []
    tl.add(Event("policy", "rollout", 1, 50.0, 50.5))
    metrics(1, {}, 10.0)
    metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1  # the first step-1 row went with the rewind
    assert rows[0]["time/busy/policy_s"] == 0.5 and rows[0]["time/rollout_s"] == 0.5


def test_tensorboard_shows_each_step_once_after_a_rewind_and_a_resume(tmp_path):
    """Event files are append-only: the scalars of steps run again after a rewind, or after
    a resume, are hidden by a purge (they showed twice, old values beside new ones)."""
    Metrics(tmp_path / "failed", 4, Timeline()).close()  # a run that failed before a row
    assert not (tmp_path / "failed").exists()  # leaves nothing to refuse a relaunch over
    metrics = Metrics(tmp_path, 4, Timeline())
    for t in range(3):
        metrics(t, {"train": {"loss": float(t)}}, 1.0)
    metrics.rewind(0)  # steps 1 and 2 run again, and compute other values
    for t in (1, 2):
        metrics(t, {"train": {"loss": 10.0 + t}}, 1.0)
    metrics.close()
    assert tensorboard_scalars(tmp_path, "train/loss") == [(0, 0.0), (1, 11.0), (2, 12.0)]
    resumed = Metrics(tmp_path, 4, Timeline(), first_step=2)  # after step 1's checkpoint
    for t in (2, 3):
        resumed(t, {"train": {"loss": 20.0 + t}}, 1.0)
    resumed.close()
    assert tensorboard_scalars(tmp_path, "train/loss") == [(0, 0.0), (1, 11.0), (2, 22.0),
                                                           (3, 23.0)]


def test_wandb_gets_each_step_once_through_a_rewind_and_a_resume(tmp_path, monkeypatch,
                                                                 capsys):
    """One wandb run across a resume (its id kept in the run directory); wandb refuses a step
    below its last, so the steps run again keep their first values there, and that is said."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    metrics = Metrics(tmp_path, 5, Timeline(),
                      trackers=[Wandb(tmp_path, "asyncrl-tests", {"lr": 0.5})])
    try:
        # the controller's wandb service is not the ranks' (a worker's wandb.init would join
        # it, and lose it when the run ends)
        assert "WANDB_SERVICE" in os.environ
        assert "WANDB_SERVICE" not in rank_env(dict(os.environ), {})
        for t in range(3):
            metrics(t, {"train": {"loss": float(t)}}, 1.0)
        metrics.rewind(0)  # steps 1 and 2 run again
        for t in (1, 2):
            metrics(t, {"train": {"loss": 10.0 + t}}, 1.0)
    finally:
        metrics.close()  # (wandb's service process with it, whatever failed)
    assert "step 1 ran again; wandb keeps the values it was given first (through step 2)" \
        in capsys.readouterr().err
    # resumed after step 1's checkpoint: step 2 is logged again (a killed controller's last
    # rows may never have reached wandb), into the same wandb run
    resumed = Metrics(tmp_path, 5, Timeline(), first_step=2, trackers=[
        Wandb(tmp_path, "asyncrl-tests", {"lr": 0.5}, resumed_after=1)])
    try:
        for t in (2, 3):
            resumed(t, {"train": {"loss": 20.0 + t}, "perf/tokens": 8}, 2.0)
    finally:
        resumed.close()
    history, config, ids = wandb_history(tmp_path)
    assert [(step, row["train/loss"]) for step, row in history] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (2, 22.0), (3, 23.0)]
    assert history[-1][1]["perf/tokens_per_s"] == 4.0 and "step" not in history[-1][1]
    assert len(ids) == 1 and config["lr"] == 0.5
    assert json.loads((tmp_path / "wandb.json").read_text()) == {  # what a resume reads
        "id": next(iter(ids)), "project": "asyncrl-tests"}
    # resumed into another project: a wandb run of its own there
    other = Wandb(tmp_path, "asyncrl-other", {}, resumed_after=3)
    try:
        assert other.run.id not in ids and other.run.project == "asyncrl-other"
    finally:
        other.close()


# -- running on real groups -----------------------------------------------------------------
class Clocked(asyncrl.Worker):
    """Records when each call ran, by the rank's own clock (one host: one clock)."""

    def __init__(self):
        self.log: list = []

    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def work(self, tag, seconds: float):
        start = time.time()
        time.sleep(seconds)  # stands in for a forward pass: work, not synchronisation
        self.log.append([tag, start, time.time()])
        return tag

    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def meet(self, folder: str, me: str, other: str) -> bool:
        """Whether `other`'s call ran while this one did (calls one after the other would
        each wait the 30 s out alone): a rendezvous by files, polled with a deadline."""
        open(os.path.join(folder, me), "w").close()
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(folder, other)) and time.monotonic() < deadline:
            time.sleep(0.01)
        return os.path.exists(os.path.join(folder, other))

    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def history(self):
        return self.log

    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def rows(self, step):
        return asyncrl.TensorBatch({"x": torch.full((4, 1), float(step))})

    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def boom(self):
        raise RuntimeError("reward model exploded")


left = asyncrl.group(Clocked, name="left")
right = asyncrl.group(Clocked, name="right")


@asyncrl.node
def on_left(step):
    return left.work(["left", step], 0.4)


@asyncrl.node
def brief(step):
    return left.work(["brief", step], 0.1)


def test_a_steps_seconds_are_the_period_it_adds_not_its_time_since_dispatch():
    """Steps are dispatched ahead (step t once step t-2 finished, at max_staleness 0): a
    step's seconds (time/step_s, tokens/s, idle time) run from the end of the step before,
    so they add up to the run's time, not about twice it."""
    flow = asyncrl.DataFlow(nodes=[brief], inputs={"step": range(5)}, groups=[left])
    seen: list[float] = []

    async def main():
        async with asyncrl.Controller(), flow:
            start = time.perf_counter()
            await flow.run(on_step=lambda t, values, seconds: seen.append(seconds))
            return time.perf_counter() - start
    wall = run(main())
    assert len(seen) == 5 and sum(seen) >= 0.4  # the steps' own work (0.1 s each) is in
    assert sum(seen) <= wall  # their periods, and each period is counted once


@asyncrl.node
def meet_left(folder):
    return left.meet(folder, "left", "right")


@asyncrl.node
def meet_right(folder):
    return right.meet(folder, "right", "left")


def test_independent_nodes_run_at_the_same_time_on_their_groups(tmp_path):
    flow = asyncrl.DataFlow(nodes=[meet_left, meet_right], inputs={"folder": [str(tmp_path)]},
                            groups=[left, right])

    async def main():
        async with asyncrl.Controller() as ctl, flow:
            results = await flow.step()  # dispatched at once: both are futures here
            assert all(isinstance(r, asyncrl.DistFuture) for r in results.values())
            return await results["meet_left"], await results["meet_right"], len(ctl.groups)
    met_left, met_right, ngroups = run(main())
    assert ngroups == 2
    assert met_left and met_right  # each ran while the other did


@asyncrl.node(follows="train")
def roll(step):
    return left.work(["roll", step], 0.05)


@asyncrl.node
def train(roll, step):
    return right.work(["train", step], 0.4)


def _events(staleness: int) -> tuple[dict, dict, list]:
    flow = asyncrl.DataFlow(nodes=[roll, train], inputs={"step": range(4)},
                            max_staleness=staleness, groups=[left, right])

    async def main_with_history():  # step by step: the groups stay up to read their logs
        async with asyncrl.Controller() as ctl:
            await flow.open(ctl)
            try:
                results = []
                while (r := await flow.step()) is not None:
                    results.append(r)
                for r in results:
                    await r["train"]
                return await left.history(), await right.history()
            finally:
                await flow.close()
    rolls, trains = run(main_with_history())
    start = {s: a for (tag, s), a, _ in rolls}
    end = {s: b for (tag, s), _, b in trains}
    return start, end, rolls


def test_state_edges_on_policy_wait_for_the_previous_train():
    start, end, _ = _events(0)
    assert all(start[t] >= end[t - 1] for t in range(1, 4))


def test_state_edges_with_staleness_one_overlap_but_stay_bounded():
    start, end, _ = _events(1)
    assert any(start[t] < end[t - 1] for t in range(1, 4))  # rollout ran during a train
    assert all(start[t] >= end[t - 2] for t in range(2, 4))  # never two trains behind


aside = asyncrl.group(Clocked, name="aside")


@asyncrl.node
async def slow_eval(train, step):  # a side node of the trained weights: nothing of a later
    await train  # step needs it
    return aside.work(["eval", step], 0.5)


def test_a_slow_side_node_does_not_hold_back_the_next_rollout():
    """max_staleness=0: rollout t waits for train t-1 (its state edge), not for the slow eval
    of step t-1 beside it; the eval may lag one step, not more (every node of step t-2 has
    finished before step t starts)."""
    flow = asyncrl.DataFlow(nodes=[roll, train, slow_eval], inputs={"step": range(4)},
                            groups=[left, right, aside])

    async def main():
        async with asyncrl.Controller() as ctl:
            await flow.open(ctl)
            try:
                await flow.run()
                return await left.history(), await right.history(), await aside.history()
            finally:
                await flow.close()
    rolls, trains, evals = run(main())
    start = {s: a for (tag, s), a, _ in rolls}
    trained = {s: b for (tag, s), _, b in trains}
    evaluated = {s: b for (tag, s), _, b in evals}
    assert all(start[t] >= trained[t - 1] for t in range(1, 4))  # on-policy still
    assert any(start[t] < evaluated[t - 1] for t in range(1, 4))  # not behind the eval
    assert all(start[t] >= evaluated[t - 2] for t in range(2, 4))  # a lag of one at most


@asyncrl.node
def explode(step):
    return left.boom()


def test_run_returns_values_and_failures_name_node_and_group():
    ok = asyncrl.DataFlow(nodes=[on_left], inputs={"step": range(2)}, groups=[left])
    bad = asyncrl.DataFlow(nodes=[explode], inputs={"step": [0]}, groups=[left])

    async def main():
        async with asyncrl.Controller():
            values = await ok.run()
            with pytest.raises(asyncrl.NodeError) as info:
                await bad.run()
            return values, info.value
    values, err = run(main())
    assert values == [{"on_left": ["left", 0]}, {"on_left": ["left", 1]}]
    assert err.node == "explode" and "group 'left'" in str(err)
    assert "reward model exploded" in str(err.__cause__)


@asyncrl.node
def rows_of(step):
    return left.rows(step)


def test_a_run_that_keeps_nothing_fetches_no_batch_for_on_step():
    """asyncrl launch's run: a long run's batches stay on their ranks; numbers still come."""
    flow = asyncrl.DataFlow(nodes=[on_left, rows_of], inputs={"step": range(3)},
                            groups=[left])
    seen = []

    async def main():
        async with asyncrl.Controller() as ctl:
            await flow.open(ctl)  # open here: run() leaves the groups up for the awaits below
            try:
                kept = await flow.run(on_step=lambda t, values, s: seen.append(values),
                                      keep=False)
                return kept, [await v["rows_of"] for v in seen]
            finally:
                await flow.close()
    kept, batches = run(main())
    assert kept == []
    assert [v["on_left"] for v in seen] == [["left", t] for t in range(3)]
    assert all(isinstance(v["rows_of"], asyncrl.DistFuture) and v["rows_of"].done()
               for v in seen)
    assert [b.tensor("x")[0, 0].item() for b in batches] == [0.0, 1.0, 2.0]


def test_a_long_run_lets_the_futures_of_finished_steps_go():
    """A run's steps hold their nodes' futures (and so the ranks' objects: a future let go
    releases its object) only while a later step may wait on them, so what a run holds does
    not grow with its number of steps."""
    flow = asyncrl.DataFlow(nodes=[rows_of], inputs={"step": range(12)}, groups=[left])

    async def main():
        async with asyncrl.Controller() as ctl:
            await flow.open(ctl)
            try:
                await flow.run(on_step=lambda t, values, s: None, keep=False)
                gc.collect()
                return [ref for ref in gc.get_objects()
                        if type(ref) is ObjectRef and ref.group is left.handle]
            finally:
                await flow.close()
    held = run(main())
    # steps 10 and 11's batches: a next step (max_staleness 0) would wait on them (all of
    # step 10, step 11's followed nodes). (`left` has no restarts: recovery would follow the
    # outputs too)
    assert len(held) == 2


class Pair(NamedTuple):
    first: object
    second: object


restartable = asyncrl.group(Clocked, name="restartable", max_restarts=1)


@asyncrl.node
def twice(step):  # one future twice, in a namedtuple, followed by recovery (restarts on)
    fut = restartable.work(["again", step], 0.0)
    return Pair(fut, {"same": fut})


def test_a_node_may_return_a_namedtuple_holding_one_future_twice():
    flow = asyncrl.DataFlow(nodes=[twice], inputs={"step": range(2)}, groups=[restartable])

    async def main():
        async with asyncrl.Controller():
            return await flow.run()
    values = run(main())
    assert values == [{"twice": Pair(["again", t], {"same": ["again", t]})} for t in range(2)]
    assert isinstance(values[0]["twice"], Pair)


def test_launch_run_node_and_timeline_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run_dir = tmp_path / "run"

    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "asyncrl", *args], capture_output=True,
                             text=True, timeout=240, cwd=ROOT, env=env)
        assert out.returncode == 0, out.stderr
        return out

    out = cli("launch", "examples/flow.py", "--steps", "3", "--run-dir", str(run_dir),
              "--save-inputs", "--wandb", "asyncrl-tests", "batch=4", "lr=0.25")
    assert f"run_dir: {run_dir}" in out.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("train/reward" in r and "time/train_s" in r for r in rows)
    assert "step 3/3" in out.stderr
    # a resume logs to the run's wandb run, without --wandb again
    out = cli("launch", "examples/flow.py", "--steps", "4", "--run-dir", str(run_dir),
              "--resume")
    assert "logging to wandb project 'asyncrl-tests' as the run did" in out.stderr
    history, config, ids = wandb_history(run_dir)
    assert [step for step, _ in history] == [0, 1, 2, 3] and len(ids) == 1
    assert [row["train/reward"] for _, row in history[:3]] == [r["train/reward"] for r in rows]
    assert (config["batch"], config["lr"], config["length"]) == (4, 0.25, 8)  # settings
    assert config["asyncrl"]["steps"] == 4  # as the resumed run set it
    saved = run_dir / "inputs" / "step1" / "score.msgpack"
    out = cli("run", "examples/flow.py", "--node", "score", "--inputs", str(saved))
    scores = eval(out.stdout.strip().splitlines()[-1])  # a list of floats, printed by repr
    assert len(scores) == 4  # batch=4 reached the ranks
    rollout = load_inputs(saved)[0]["rollout"]  # the step's own samples, scored again
    assert scores == pytest.approx((rollout["tokens"] == 4).float().mean(1).tolist())  # GOOD
    assert sum(scores) / 4 == pytest.approx(rows[1]["train/reward"])
    # an async node that awaits its inputs (DistFutures in the run: done ones again here),
    # on groups built with the run's overrides (lr=0.25), unless the command line says else
    saved = run_dir / "inputs" / "step2" / "train.msgpack"
    values, futures = load_inputs(saved)
    assert futures == {"rollout": [[]], "score": [[]], "reference": [[]]}
    tokens, rewards = values["rollout"]["tokens"], torch.tensor(values["score"])
    counts = torch.zeros(4, 16).scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float))
    grad = ((rewards - rewards.mean())[:, None] * counts).mean(0)
    for extra, lr in ((), 0.25), (("lr=0",), 0.0):
        out = cli("run", "examples/flow.py", "--node", "train", "--inputs", str(saved), *extra)
        got = eval(out.stdout.strip().splitlines()[-1])
        assert got["reward"] == pytest.approx(float(rewards.mean()))
        assert got["p_good"] == pytest.approx(float(torch.softmax(lr * grad, -1)[4]))
    out = cli("timeline", str(run_dir))
    png = run_dir / "timeline.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000
