"""Separate trainer and rollout groups: weights pushed worker to worker with a version,
generations interrupted by new weights, staleness bounds and corrections, end to end."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
from helpers import ROOT, assert_gone, group_pids, launch_example, run

import asyncrl
from asyncrl import TensorBatch
from asyncrl.hybrid import weight_sync
from asyncrl.hybrid.models import ModelConfig, build_model, sequence_logprobs
from asyncrl.hybrid.roles import Policy, Rollout
from asyncrl.hybrid.sampler import Sampler, SamplingConfig
from asyncrl.hybrid.weight_sync import ALL_RANKS, SyncSource, unpack
from asyncrl.rl import Actor, Critic

PROMPTS = [[1, 5, 6], [1, 7], [1, 9, 9, 9], [1, 4]]


def test_a_flat_pack_copies_the_weights_into_buckets_of_one_dtype(monkeypatch):
    """GPU packs (flat by default there; forced here): every parameter back unchanged, of
    its dtype and shape, from buckets of one dtype and at most FLAT_BYTES (a larger
    parameter alone), each at a 16-byte aligned offset; a copy, not a view: the weights may
    change once it is packed."""
    monkeypatch.setattr(weight_sync, "FLAT_BYTES", 1000)
    named = [("a", torch.arange(6, dtype=torch.float32).view(2, 3)),
             ("b", torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
             ("d", torch.ones(250)),  # 1,000 bytes: a's bucket is full
             ("big", torch.arange(400, dtype=torch.float64)),  # 3,200 bytes: alone
             ("c", torch.tensor([True, False, True])), ("empty", torch.zeros(0, 4))]
    pack = SyncSource().pack(named, version=2, flat=True)
    assert [pack.meta["flat"][n] for n, _ in named] == \
        [["flat.0", 0], ["flat.1", 0], ["flat.2", 0], ["flat.3", 0], ["flat.4", 0],
         ["flat.2", 252]]  # 16-byte aligned
    assert [pack[k].dtype for k in sorted(pack.keys())] == \
        [torch.float32, torch.bfloat16, torch.float32, torch.float64, torch.bool]
    assert pack.meta["nbytes"] == sum(t.numel() * t.element_size() for _, t in named)
    out = list(unpack(pack))
    assert [n for n, _ in out] == [n for n, _ in named]
    for (_, got), (_, want) in zip(out, named, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    named[0][1].add_(100)
    assert dict(out)["a"][0, 0] == 0  # packed bytes: not the live tensor
    pack.meta["flat"]["d"][1] = 10  # a damaged offset: past its bucket's end
    with pytest.raises(ValueError, match="'d' .250 values from 10. lies outside its bucket"):
        list(unpack(pack))


def test_a_flat_pack_lets_each_parameter_go_once_its_bucket_is_made(monkeypatch):
    """Gathered parameters arrive one by one (a generator): a full bucket is concatenated
    and its parameters freed before the next arrives, so packing holds at most a bucket
    beyond the pack itself."""
    monkeypatch.setattr(weight_sync, "FLAT_BYTES", 64)
    made: list[weakref.ref] = []

    def gathered():
        for i in range(6):  # 16 floats, 64 bytes: a bucket each
            if i >= 2:  # bucket i - 2 closed when parameter i - 1 arrived
                assert made[i - 2]() is None, f"parameter {i - 2} still held"
            t = torch.full((16,), float(i))
            made.append(weakref.ref(t))
            yield f"p{i}", t
            del t

    pack = SyncSource().pack(gathered(), version=0, flat=True)
    assert len(pack.keys()) == 6 and all(r() is None for r in made)
    assert [float(t[0]) for _, t in unpack(pack)] == [0, 1, 2, 3, 4, 5]


def test_a_pack_is_views_of_the_weights_and_the_trainer_waits_until_it_is_released():
    model = build_model(ModelConfig(seed=3))
    source = SyncSource()
    pack = source.pack(model.named_parameters(), version=4)
    assert pack.meta["version"] == 4 and len(pack) == 1
    params = dict(model.named_parameters())
    for name, t in unpack(pack):
        assert torch.equal(t, params[name]), name
        assert t.data_ptr() == params[name].data_ptr()  # no packing copy
    with pytest.raises(TimeoutError, match="still held"):
        source.wait_released(0.01)  # held: the weights must not change yet
    released = threading.Event()
    waiter = threading.Thread(target=lambda: (source.wait_released(30), released.set()))
    waiter.start()
    del pack, t
    waiter.join(30)
    assert released.is_set()


def test_a_generation_takes_new_weights_at_a_token_boundary_and_keeps_its_tokens():
    old, new = build_model(ModelConfig(seed=1)), build_model(ModelConfig(seed=2))
    cfg = SamplingConfig(max_new_tokens=10)
    seeds = [11, 12, 13, 14]
    plain = Sampler(build_model(ModelConfig(seed=1)), cfg).generate(PROMPTS, seeds)
    engine = Sampler(old, cfg)

    def swap(step: int) -> None:  # another thread swaps while the generation waits
        if step == 4:
            t = threading.Thread(target=engine.load_weights,
                                 args=(list(new.named_parameters()), 1))
            t.start()
            t.join(30)
            assert not t.is_alive()

    engine.on_token = swap
    out = engine.generate(PROMPTS, seeds)
    # token 4 was sampled from logits the old weights computed; token 5 on, the new ones
    versions = out["versions"]
    assert versions[:, :5].eq(0).all() and versions[:, 5:].eq(1).all()
    assert torch.equal(out["response_ids"][:, :5], plain["response_ids"][:, :5])  # kept
    assert not torch.equal(out["response_ids"][:, 5:], plain["response_ids"][:, 5:])


class HeldRollout(Rollout):
    """Its generation waits after token 3 until new weights have arrived; the weights wait
    for it to get there (a loaded host may start the generation late)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reached, self.loaded = threading.Event(), threading.Event()
        self.engine.on_token = self._hold

    def _hold(self, step):
        if step == 3:
            self.reached.set()
            self.loaded.wait(60)

    @asyncrl.register(dispatch=ALL_RANKS, concurrent=True)
    def load_weights(self, weights, version=None):
        self.reached.wait(60)  # (set once: later syncs go straight in)
        out = super().load_weights(weights, version)
        self.loaded.set()
        return out


def prompts(n: int) -> TensorBatch:
    return TensorBatch({"prompt": [PROMPTS[i % 4] for i in range(n)], "seed": list(range(n))})


@pytest.mark.parametrize("transport", ["auto", "nccl"])
def test_sync_moves_weights_between_groups_into_a_generation_in_flight(transport, monkeypatch,
                                                                        tmp_path):
    """transport="nccl": through the NCCL path, with tests/fake_nccl.py for CuPy's NCCL."""
    sampling = {"max_new_tokens": 8}
    env = {}
    if transport == "nccl":
        monkeypatch.setenv("ASYNCRL_NCCL_MODULE", "fake_nccl")
        monkeypatch.setenv("ASYNCRL_FAKE_NCCL_ROOT", str(tmp_path / "nccl"))
        env = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}

    async def main():
        async with asyncrl.Controller(transport=transport) as ctl:
            trainer = await ctl.spawn(Policy, {"seed": 2}, nprocs=2, hybrid=False,
                                      name="trainer", env=env)
            rollout = await ctl.spawn(HeldRollout, {"seed": 1}, sampling, nprocs=2,
                                      name="rollout", env=env)
            pids = group_pids(trainer) + group_pids(rollout)
            assert not set(group_pids(trainer)) & set(group_pids(rollout))
            held = rollout.generate(prompts(6))
            sync = await rollout.load_weights(trainer.sync_pack(), version=7)
            out = await held
            generated = rollout.generate(prompts(6))
            # a trained step, synced through the pack buffer the first sync filled
            await trainer.train_step(generated)
            after = await generated
            assert (await rollout.load_weights(trainer.sync_pack(), version=8))["sync/version"] == 8
            again = rollout.generate(prompts(6))
            scored, again = await trainer.logprobs(again), await again
            assert ctl.payload_bytes == 0  # the weights went worker to worker
            # NCCL links made once per direction: weights one way, samples the other
            assert ctl.links.setups == (2 if transport == "nccl" else 0)
            return sync, out, after, pids, again, scored
    sync, out, after, pids, again, scored = run(main())
    assert_gone(pids)
    torch.testing.assert_close(again["logprobs"], scored["logprobs"], atol=1e-5, rtol=0)
    assert sync["sync/version"] == 7 and sync["sync/bytes"] > 0
    versions = out["versions"][out["response_mask"].bool()]
    assert set(versions.tolist()) == {0, 7}  # tokens before and after the swap, all kept
    assert out["versions"][:, :3].eq(0).all()
    trained = build_model(ModelConfig(seed=2))  # the trainer's weights, now the rollout's
    expect = sequence_logprobs(trained, after["prompt_ids"], after["prompt_mask"],
                               after["response_ids"], after["response_mask"])
    torch.testing.assert_close(after["logprobs"], expect, atol=1e-5, rtol=0)
    assert after["versions"][after["response_mask"].bool()].eq(7).all()



def test_separate_groups_on_policy_equal_the_colocated_run(tmp_path):
    small = ("prompts=5", "group_size=3")
    colocated = launch_example("grpo_tiny.py", tmp_path / "colocated", 3, *small, "actor_procs=1")
    separate = launch_example("grpo_async.py", tmp_path / "separate", 3, *small, "max_staleness=0")
    for a, b in zip(colocated, separate, strict=True):
        common = {k for k in a if k in b and not k.startswith(("time/", "perf/"))}
        assert common >= {"reward/mean", "actor/kl", "actor/pg_loss", "actor/grad_norm"}
        for k in sorted(common):
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-6), k
        assert b["staleness/lag_0"] == 1.0 and b["sync/bytes"] > 0


def trace_spans(run_dir: Path) -> dict[tuple[str, int], tuple[float, float]]:
    trace = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    return {(e["name"], e["args"]["step"]): (e["ts"], e["ts"] + e["dur"]) for e in trace
            if e["ph"] == "X" and rows[e["tid"]] in ("rollout", "trainer")}


def test_staleness_one_overlaps_stays_bounded_and_still_learns(tmp_path):
    rows = launch_example("grpo_async.py", tmp_path / "k1", 20, "max_staleness=1")
    frozen = launch_example("grpo_async.py", tmp_path / "lr0", 20, "max_staleness=1", "lr=0")
    lags = {k for r in rows for k in r if k.startswith("staleness/lag_")}
    assert lags <= {"staleness/lag_0", "staleness/lag_1"}  # never beyond the bound
    assert any(r.get("staleness/lag_1", 0) > 0 for r in rows)  # and really off-policy
    assert all(r["staleness/dropped"] == 0 for r in rows)
    spans = trace_spans(tmp_path / "k1")  # worker-side busy spans of each call
    overlapped = [t for t in range(1, 20) if ("rollout", t) in spans and ("train", t - 1) in spans
                  and spans[("rollout", t)][0] < spans[("train", t - 1)][1]]
    assert overlapped, "no rollout ran while the previous step trained"
    for t in range(2, 20):  # rollout t starts only once sync t-2 (train t-2) has finished
        assert spans[("rollout", t)][0] >= spans[("train", t - 2)][1]
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    base = sum(r["reward/mean"] for r in frozen[-5:]) / 5
    assert last > base + 0.2, (last, base)


def test_bench_reports_where_the_time_went(tmp_path):
    run_dir = tmp_path / "bench"
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl", "bench", "examples/grpo_async.py", "--steps", "5",
         "--warmup", "1", "--run-dir", str(run_dir), "steps=5", "prompts=5", "group_size=3"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads((run_dir / "bench.json").read_text())
    assert figures["steps"] == 4 and figures["tokens_per_s"] > 0  # steps 1-4: 0 left out
    # the period between the starts of steps 1 and 4, from the timeline's own spans
    trace = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    began = {t: min(e["ts"] for e in trace if e["ph"] == "X" and e["args"]["step"] == t
                    and names[e["tid"]] != "controller") / 1e6 for t in (1, 4)}
    assert figures["period_s"] == pytest.approx((began[4] - began[1]) / 3)
    assert set(figures["groups"]) == {"trainer", "rollout", "ref", "reward"}
    for g in figures["groups"].values():  # busy and idle split the run's wall time
        assert g["busy_s"] + g["idle_s"] == pytest.approx(figures["wall_s"])
        assert 0 < g["utilisation"] <= 1
    path = figures["critical_path"]
    assert path[0] == "rollout" and path[-1] == "sync" and "train" in path
    assert figures["overlap_efficiency"] >= 1.0 - 1e-6  # a step never beats its busiest group
    assert "critical path: rollout ->" in out.stdout and "overlap efficiency:" in out.stdout
    assert (run_dir / "timeline.png").stat().st_size > 0


@pytest.mark.parametrize("mini_batches", [2, 1])  # 1: the weights come from the training pass
def test_the_trainer_drops_samples_beyond_the_bound_and_weights_the_rest(mini_batches):
    ids = torch.tensor([[1, 5], [1, 5], [1, 7], [1, 7]])  # two groups of one prompt each
    resp = torch.tensor([[9, 10, 2], [11, 2, 0], [12, 13, 14], [9, 9, 2]])
    rmask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    model = build_model(ModelConfig(seed=0))
    prox = sequence_logprobs(model, ids, torch.ones_like(ids), resp, rmask).detach()
    shift = torch.tensor([[-2.0, 0.5, 0.1], [1.0, -0.3, 0.0], [0.2, 0.2, 0.2], [0.0, 0.0, 0.0]])
    rollout = TensorBatch({"prompt_ids": ids, "prompt_mask": torch.ones_like(ids),
                           "response_ids": resp, "response_mask": rmask,
                           "logprobs": (prox + shift) * rmask,  # the rollout's old weights
                           # lags 0, 0, 1, 2 behind the trainer (version 0)
                           "versions": torch.tensor([[0], [0], [-1], [-2]]).expand(4, 3) * rmask})
    scores = TensorBatch({"reward": torch.tensor([1.0, 0.0, 1.0, 0.0])})
    rl = {"algo": "grpo", "group_size": 2, "max_staleness": 1, "correction": "tis",
          "tis_cap": 2.0, "mini_batches": mini_batches}

    async def main():
        async with asyncrl.Controller() as ctl:
            trainer = await ctl.spawn(Actor, {"seed": 0}, rl, {"lr": 0.0}, nprocs=1,
                                      hybrid=False)
            stats = await trainer.update(rollout, scores)
            with_kl = await ctl.spawn(Actor, {"seed": 0}, {**rl, "kl_coef": 0.1}, nprocs=1,
                                      hybrid=False, name="with_kl")
            with pytest.raises(asyncrl.RemoteError, match=re.escape(
                    "RLConfig.kl_coef=0.1 but update() got no ref=")):
                await with_kl.update(rollout, scores)  # no KL term would train, silently
            return stats
    stats = run(main())
    assert stats["staleness/dropped"] == 1  # the sample 2 versions behind
    assert stats["actor/version"] == 1  # one update, whatever its optimizer steps
    assert stats["staleness/lag_0"] == 0.5 and stats["staleness/lag_1"] == 0.25
    assert stats["staleness/lag_2"] == 0.25 and stats["staleness/mean"] == 0.75
    kept = rmask.float()
    kept[3] = 0
    weight = torch.exp(-shift).clamp(max=2.0)  # current / rollout probability, truncated
    expect = float((weight * kept).sum() / kept.sum())
    assert stats["actor/is_weight_mean"] == pytest.approx(expect, rel=1e-4)


def test_an_update_whose_every_sample_is_too_stale_leaves_the_weights_as_they_were():
    """No token to train on: no optimizer step (AdamW's momentum from the step before moved
    the weights all the same), and the version stays that of the policy that generated."""
    ids = torch.tensor([[1, 5], [1, 5], [1, 7], [1, 7]])
    resp = torch.tensor([[9, 10, 2], [11, 2, 0], [12, 13, 14], [9, 9, 2]])
    rmask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])

    def tagged(version: int) -> TensorBatch:
        return TensorBatch({"prompt_ids": ids, "prompt_mask": torch.ones_like(ids),
                            "response_ids": resp, "response_mask": rmask,
                            "logprobs": torch.zeros(4, 3),
                            "versions": torch.full((4, 3), version) * rmask})
    scores = TensorBatch({"reward": torch.tensor([1.0, 0.0, 1.0, 0.0])})
    rl = {"algo": "grpo", "group_size": 2, "max_staleness": 0}

    async def main():
        async with asyncrl.Controller() as ctl:
            trainer = await ctl.spawn(Actor, {"seed": 0}, rl, {"lr": 1e-2}, nprocs=1,
                                      hybrid=False)
            fresh = await trainer.update(tagged(0), scores)  # version 0 -> 1
            before = (await trainer.weights())[0]
            stale = await trainer.update(tagged(0), scores)  # lag 1 > 0: every row dropped
            after = (await trainer.weights())[0]
            again = await trainer.update(tagged(1), scores)  # the policy's own: trained
            return fresh, stale, again, before, after
    fresh, stale, again, before, after = run(main())
    assert (fresh["actor/skipped_steps"], fresh["actor/version"]) == (0, 1)
    assert stale["staleness/dropped"] == 4 and stale["actor/skipped_steps"] == 1
    assert stale["actor/version"] == 1 and "actor/pg_loss" not in stale
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (again["actor/skipped_steps"], again["actor/version"]) == (0, 2)


def fails_second_step(backend) -> None:
    """`backend`'s second optimizer step fails (after the first moved the weights)."""
    step, calls = backend.train_step, [0]

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("the second mini-batch's step failed")
        return step(*a, **k)
    backend.train_step = flaky


class FailsSecondStep(Actor):
    """Its second optimizer step of an update fails (after the first moved the weights)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        fails_second_step(self.backend)


def test_an_update_failing_after_an_optimizer_step_still_gives_a_new_version():
    """The weights moved by the first mini-batch's step kept the old version when a later
    one failed: the next generation and weight sync tagged other weights with it."""
    ids = torch.tensor([[1, 5], [1, 5], [1, 7], [1, 7]])
    resp = torch.tensor([[9, 10, 2], [11, 2, 0], [12, 13, 14], [9, 9, 2]])
    rollout = TensorBatch({"prompt_ids": ids, "prompt_mask": torch.ones_like(ids),
                           "response_ids": resp, "response_mask": (resp > 0).long(),
                           "logprobs": torch.zeros(4, 3)})
    scores = TensorBatch({"reward": torch.tensor([1.0, 0.0, 1.0, 0.0])})
    rl = {"algo": "grpo", "group_size": 2, "mini_batches": 2}

    async def main():
        async with asyncrl.Controller() as ctl:
            trainer = await ctl.spawn(FailsSecondStep, {"seed": 0}, rl, {"lr": 1e-2},
                                      nprocs=1, hybrid=False)
            with pytest.raises(asyncrl.RemoteError, match="second mini-batch's step failed"):
                await trainer.update(rollout, scores)
            return await trainer.update(rollout, scores)
    assert run(main())["actor/version"] == 2  # one for each update that moved the weights


class CriticFailsSecondStep(Critic):
    """A critic whose second optimizer step of an update fails."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        fails_second_step(self.backend)


def test_a_critic_update_failing_after_an_optimizer_step_still_counts_a_version():
    """As the actor's: the critic's weights moved by its first mini-batch kept the old
    version when a later one failed, so it measured staleness a version behind the actor's
    and trained on rows the actor dropped."""
    ids = torch.tensor([[1, 5], [1, 6], [1, 7], [1, 8]])
    resp = torch.tensor([[9, 10, 2], [11, 2, 0], [12, 13, 14], [9, 9, 2]])
    rmask = (resp > 0).long()
    rollout = TensorBatch({"prompt_ids": ids, "prompt_mask": torch.ones_like(ids),
                           "response_ids": resp, "response_mask": rmask,
                           "logprobs": torch.zeros(4, 3),
                           "versions": torch.tensor([0, 0, 1, 1])[:, None] * rmask})
    scores = TensorBatch({"reward": torch.tensor([1.0, 0.0, 1.0, 0.0])})
    rl = {"algo": "ppo", "mini_batches": 2, "max_staleness": 0}

    async def main():
        async with asyncrl.Controller() as ctl:
            critic = await ctl.spawn(CriticFailsSecondStep, {"seed": 0}, rl, {"lr": 1e-2},
                                     nprocs=1)
            values = await critic.values(rollout)
            with pytest.raises(asyncrl.RemoteError, match="second mini-batch's step failed"):
                await critic.update(rollout, scores, values=values)
            return await critic.update(rollout, scores, values=values)
    assert run(main())["critic/dropped"] == 2  # those of version 0, now one behind


class FailsAfterFirstStep:
    """Its first train step steps the optimizer (and schedule), then raises (ZeRO steps
    inside the last backward; the statistics' all_reduce or grad norm after it may fail)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        step, calls = self.backend.train_step, [0]

        def fails_after(*a, **k):
            out, calls[0] = step(*a, **k), calls[0] + 1
            if calls[0] == 1:
                raise RuntimeError("the step's statistics failed")
            return out
        self.backend.train_step = fails_after

    @asyncrl.register
    def current_version(self) -> int:
        return self.version


# (named as the module's attributes: the ranks import them by name)
ActorFailsAfterItsStep, CriticFailsAfterItsStep, PolicyFailsAfterItsStep = (
    type(f"{role.__name__}FailsAfterItsStep", (FailsAfterFirstStep, role), {})
    for role in (Actor, Critic, Policy))


def test_a_train_step_failing_after_its_optimizer_step_still_gives_a_new_version():
    """Policy.train_step counted a version only when the backend's step returned: one
    failing after the optimizer stepped left moved weights under the old version."""
    ids, resp = torch.tensor([[1, 5], [1, 7]]), torch.tensor([[9, 10, 2], [12, 13, 14]])
    batch = TensorBatch({"prompt_ids": ids, "prompt_mask": torch.ones_like(ids),
                         "response_ids": resp, "response_mask": torch.ones_like(resp)})

    async def main():
        async with asyncrl.Controller() as ctl:
            policy = await ctl.spawn(PolicyFailsAfterItsStep, {"seed": 0}, {"lr": 1e-2},
                                     nprocs=1, hybrid=False)
            with pytest.raises(asyncrl.RemoteError, match="the step's statistics failed"):
                await policy.train_step(batch)
            versions = await policy.current_version()
            await policy.train_step(batch.slice(0, 0))  # no rows: no step, no new version
            return versions + await policy.current_version()
    assert run(main()) == [1, 1]  # (a list: one per rank, after each)


def test_an_update_failing_inside_its_optimizer_step_still_counts_a_version():
    """Actor and Critic counted a version after a failed update only where a train step had
    returned: one that stepped the optimizer and then raised (ZeRO) left moved weights under
    the old version. They count by the schedule now, as Policy.train_step does."""
    ids = torch.tensor([[1, 5], [1, 5], [1, 7], [1, 7]])  # (GRPO's groups of 2)
    resp = torch.tensor([[9, 10, 2], [11, 2, 0], [12, 13, 14], [9, 9, 2]])
    rollout = TensorBatch({"prompt_ids": ids, "prompt_mask": torch.ones_like(ids),
                           "response_ids": resp, "response_mask": (resp > 0).long(),
                           "logprobs": torch.zeros(4, 3)})
    scores = TensorBatch({"reward": torch.tensor([1.0, 0.0, 1.0, 0.0])})

    async def main():
        async with asyncrl.Controller() as ctl:
            actor, critic = await asyncio.gather(
                ctl.spawn(ActorFailsAfterItsStep, {"seed": 0},
                          {"algo": "grpo", "group_size": 2}, {"lr": 1e-2}, nprocs=1,
                          hybrid=False),
                ctl.spawn(CriticFailsAfterItsStep, {"seed": 0}, {"algo": "ppo"},
                          {"lr": 1e-2}, nprocs=1))
            values = await critic.values(rollout)
            with pytest.raises(asyncrl.RemoteError, match="the step's statistics failed"):
                await actor.update(rollout, scores)
            with pytest.raises(asyncrl.RemoteError, match="the step's statistics failed"):
                await critic.update(rollout, scores, values=values)
            return await actor.current_version(), await critic.current_version()
    assert run(main()) == ([1], [1])  # (lists: one per rank)


def test_the_critic_drops_the_samples_the_actor_drops(tmp_path):
    """A row too stale for the actor is left out of the critic's value loss as well: the
    critic's loss on the whole batch equals its loss on the batch without that row. Its
    version advances once per update, comes back from its checkpoint, and can be given."""
    ids = torch.tensor([[1, 5], [1, 6], [1, 7], [1, 8]])
    resp = torch.tensor([[9, 10, 2], [11, 2, 0], [12, 13, 14], [9, 9, 2]])
    rmask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])

    def tagged(*tags: int) -> TensorBatch:  # each row's tokens made by policy version tag
        return TensorBatch({"prompt_ids": ids, "prompt_mask": torch.ones_like(ids),
                            "response_ids": resp, "response_mask": rmask,
                            "logprobs": torch.zeros(4, 3),
                            "versions": torch.tensor(tags)[:, None].expand(4, 3) * rmask})
    rollout = tagged(0, 0, -1, -2)  # lags 0, 0, 1, 2 behind version 0
    scores = TensorBatch({"reward": torch.tensor([1.0, 0.0, 1.0, 5.0])})
    rl = {"algo": "ppo", "max_staleness": 1}

    async def main():
        async with asyncrl.Controller() as ctl:
            whole, kept = await asyncio.gather(*(
                ctl.spawn(Critic, {"seed": 0}, rl, {"lr": 0.0}, nprocs=1, name=name)
                for name in ("whole", "kept")))
            values = await whole.values(rollout)
            first = await whole.update(rollout, scores, values=values)
            fresh = await kept.update(rollout.slice(0, 3), scores.slice(0, 3),
                                      values=values.slice(0, 3))
            dropped = [first["critic/dropped"], fresh["critic/dropped"]]
            later = tagged(0, 0, 0, -1)  # at version 1: lags 1, 1, 1, 2
            dropped.append((await whole.update(later, scores, values=values))["critic/dropped"])
            await whole.save_checkpoint(str(tmp_path))  # at version 2; kept is at 1
            shutil.copytree(tmp_path / "whole", tmp_path / "kept")  # by group name
            await kept.load_checkpoint(str(tmp_path))
            last = tagged(2, 1, 0, 0)  # at version 2: lags 0, 1, 2, 2
            for given in (None, 3):  # at 3: lags 1, 2, 3, 3
                stats = await kept.update(last, scores, values=values, version=given)
                dropped.append(stats["critic/dropped"])
            return first, fresh, dropped
    first, fresh, dropped = run(main())
    assert dropped == [1, 0, 1, 2, 3]
    assert first["critic/vf_loss"] == pytest.approx(fresh["critic/vf_loss"], rel=1e-6)


@pytest.mark.parametrize("correction", ["tis", "decoupled"])
def test_a_correction_in_the_training_pass_equals_one_from_a_separate_pass(correction):
    """One optimizer step per update: the proximal log-probs taken (detached) from the
    training forward give the loss and gradients of the separate no-grad pass they replace."""
    from asyncrl.rl.actor import importance_weights, policy_loss
    from asyncrl.rl.config import RLConfig

    cfg = RLConfig(algo="grpo", group_size=2, correction=correction, kl_coef=0.1,
                   **({"tis_cap": 1.5} if correction == "tis" else {}))
    ids, resp = torch.tensor([[1, 5], [1, 6], [1, 7]]), torch.tensor([[9, 10], [11, 2], [12, 3]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    model = build_model(ModelConfig(seed=0))

    def forward():
        return sequence_logprobs(model, ids, torch.ones_like(ids), resp, mask.long(),
                                 entropy=True)
    prox = forward()[0].detach() * mask
    rollout = (prox + torch.tensor([[-1.0, 0.5], [0.3, 0.0], [0.0, 2.0]])) * mask
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.5, 0.5]])
    columns = {"prompt_ids": ids, "response_ids": resp, "loss_mask": mask,
               "ref_logprobs": prox - 0.2}
    meta = {"tokens": 5.0, "seqs": 3.0, "rows": 3, "dp": 1}
    results = []
    for in_pass in (False, True):
        if in_pass:  # the rollout's log-probs and the plain advantages go in
            batch = TensorBatch({**columns, "logprobs": rollout, "advantages": adv}, meta)
        else:  # the actor's separate pass: proximal log-probs, weighted advantages
            weight = importance_weights(prox, rollout, mask, cfg)
            batch = TensorBatch({**columns, "logprobs": prox, "advantages": adv * weight * mask},
                                meta)
        model.zero_grad()
        logp, ent = forward()
        loss, stats = policy_loss(cfg, in_pass)({"logprobs": logp, "entropy": ent}, batch)
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()], stats))
    (loss_a, grads_a, _), (loss_b, grads_b, stats) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.allclose(a, b, atol=1e-7), (a - b).abs().max()
    # by hand: prox - rollout at the 5 loss tokens, e^that (tis: capped at 1.5)
    weights = [math.exp(d) for d in (1.0, -0.5, -0.3, 0.0, -2.0)]
    weights = [min(w, 1.5) for w in weights] if correction == "tis" else weights
    assert stats["is_weight_mean"] == pytest.approx(sum(weights) / 5, rel=1e-5)


def test_a_full_pack_from_a_trainer_tied_otherwise_is_refused():
    """Only LoRA packs said which model they fit: a tied trainer's pack (no lm_head) loaded
    into an untied engine left its head random, and an untied trainer's two weights loaded
    into a tied engine made its embeddings the trainer's head, both without a word."""
    from asyncrl.hybrid.models import ModelConfig, build_model
    from asyncrl.hybrid.sampler import Sampler

    tied = build_model(ModelConfig(preset="tiny-gpt2", seed=1))
    untied = build_model(ModelConfig(preset="tiny-gpt2", seed=1,
                                     overrides={"tie_word_embeddings": False}))
    assert untied.lm_head.weight is not untied.get_input_embeddings().weight

    def pack(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]

    with pytest.raises(ValueError, match=r"leave out \['lm_head.weight'\] of the engine's "
                                         r"model \(the trainer's model and this engine's "
                                         r"tie lm_head"):
        Sampler(untied).adopt_weights(pack(tied), 1, whole=True)
    engine = Sampler(tied)
    with pytest.raises(ValueError, match="are one tied weight in the engine's model, but two "
                                         "weights were given"):
        engine.adopt_weights(pack(untied), 1, whole=True)
    assert engine.version != 1  # nothing changed
    assert engine.adopt_weights(pack(tied), 2, whole=True) == len(pack(tied))
    assert engine.load_weights(pack(tied)[:1], 3) == 1  # a part of them, by name: as before
