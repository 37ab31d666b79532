"""The hybrid engine on CPU: models, the built-in engine, a Policy switching between
training and generation in place, and weight sync (the backends: test_backends.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import assert_gone, group_pids, poll_until, run

import asyncrl
from asyncrl import TensorBatch
from asyncrl.hybrid.models import ModelConfig, build_model
from asyncrl.hybrid.roles import Policy, Rollout
from asyncrl.hybrid.sampler import Sampler, SamplingConfig
from asyncrl.hybrid.weight_sync import unpack

PROMPTS = [[1, 5, 6], [1, 7], [1, 9, 10, 11, 12], [1, 3]]


def fixed_batch() -> TensorBatch:
    model = build_model(ModelConfig(seed=3))
    return Sampler(model, SamplingConfig(max_new_tokens=6)).generate(
        [[1, 4 + i, 5 + i] for i in range(8)], seeds=list(range(8)))


def prompts_batch(n: int) -> TensorBatch:
    return TensorBatch({"prompt": [[1, 4 + i, 9] for i in range(n)], "seed": list(range(n))})


class ReleasingPolicy(Policy):
    """A hybrid Policy that frees its engine's weights while training, as on a GPU."""

    def __init__(self, *args, **kwargs):
        from asyncrl.hybrid.engine import HybridEngine

        HybridEngine._frees_memory = lambda self: True  # (this rank's process only)
        super().__init__(*args, **kwargs)

    @asyncrl.register
    def engine_storages(self) -> int:
        """How many allocations the engine's weights are views of (one per parameter before
        session 27: each freed and allocated again at every switch)."""
        return len({p.untyped_storage().data_ptr()
                    for p in self.hybrid.engine.model.parameters()})

    @asyncrl.register
    def engine_bytes(self) -> int:
        """What the engine's weights hold now (their views' storage, each counted once)."""
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                    for p in self.hybrid.engine.model.parameters()}
        return sum(storages.values())


def test_a_one_rank_policy_fills_its_engine_straight_from_its_shards():
    """One rank: each FSDP2 shard is its whole parameter, copied straight into the engine's
    weights (freed while training, as on a GPU), with no collective and no gather buffer;
    both layouts identical before and after a step."""
    async def main():
        async with asyncrl.Controller() as ctl:
            policy = await ctl.spawn(ReleasingPolicy, {"preset": "tiny-llama", "seed": 0},
                                     {"lr": 3e-3}, {"max_new_tokens": 4}, nprocs=1,
                                     name="policy1")
            pids = group_pids(policy)
            rollout = policy.generate(prompts_batch(2))
            before = [(await policy.weights(layout))[0] for layout in ("engine", "train")]
            await policy.train_step(rollout)
            freed = (await policy.engine_bytes())[0]
            blocks = (await policy.engine_storages())[0]
            await policy.generate(prompts_batch(2))
            after = [(await policy.weights(layout))[0] for layout in ("engine", "train")]
            return before, after, (await policy.switch_report())[0], freed, blocks, pids
    before, after, report, freed, blocks, pids = run(main(), timeout=300)
    assert_gone(pids)
    assert freed == 0 and blocks == 1  # training: freed, as one block (tiny-llama's 362 KB)
    for engine, train in (before, after):
        assert all(torch.equal(engine[k], train[k]) for k in train)
    assert any(not torch.equal(after[1][k], before[1][k]) for k in before[1])  # it trained
    assert report["peak_gather_bytes"] == 0


def test_hybrid_policy_round_trip_keeps_weights_identical_and_gathers_in_buckets():
    from asyncrl.hybrid.roles import Reference

    model = {"preset": "tiny-llama", "seed": 0}

    async def main():
        async with asyncrl.Controller() as ctl:
            policy = await ctl.spawn(Policy, model, {"lr": 3e-3, "micro_batch_size": 2},
                                     {"max_new_tokens": 6, "temperature": 0.7},
                                     bucket_bytes=64 << 10, nprocs=2, name="policy")
            ref = await ctl.spawn(Reference, model, nprocs=1, name="ref")
            pids = group_pids(policy) + group_pids(ref)
            rollout = policy.generate(prompts_batch(4))  # train -> generate
            report = (await policy.switch_report())[0]
            engine_w = (await policy.weights("engine"))[0]
            train_w = (await policy.weights("train"))[0]
            lp = await policy.logprobs(rollout)  # generate -> train; forward on the shards
            ref_lp = await ref.logprobs(rollout)
            gen = await rollout
            stats = await policy.train_step(rollout)
            after = policy.generate(prompts_batch(4))  # the new weights reach the engine
            engine_after = (await policy.weights("engine"))[0]
            train_after = (await policy.weights("train"))[0]
            await after
            return (report, engine_w, train_w, lp, ref_lp, gen, stats, engine_after,
                    train_after, pids)
    (report, engine_w, train_w, lp, ref_lp, gen, stats, engine_after, train_after,
     pids) = run(main(), timeout=300)
    assert_gone(pids)
    assert set(engine_w) >= set(train_w)
    assert all(torch.equal(engine_w[k], train_w[k]) for k in train_w)  # identical, both ways
    assert all(torch.equal(engine_after[k], train_after[k]) for k in train_after)
    assert any(not torch.equal(train_after[k], train_w[k]) for k in train_w)  # it trained
    biggest = max(v.numel() * v.element_size() for v in train_w.values())
    total = sum(v.numel() * v.element_size() for v in train_w.values())
    assert report["mode"] == "generate"
    # buckets of 64 KiB: the largest temporary is a bucket plus the parameter that closed it
    assert biggest < report["peak_gather_bytes"] <= (64 << 10) + biggest < total / 2
    # the engine's log-probs, the training forward and the reference agree before training,
    # at the temperature the rollout was sampled at (its meta carries it to both)
    assert gen.meta["temperature"] == 0.7
    assert (lp["logprobs"] - gen["logprobs"]).abs().max().item() < 1e-5
    assert (ref_lp["logprobs"] - gen["logprobs"]).abs().max().item() < 1e-5
    assert stats[0]["loss"] > 0


async def small_policy(ctl, cls: type, seed: int):
    """A 2-rank hybrid tiny-llama policy with 64 KiB gather buckets."""
    return await ctl.spawn(cls, {"preset": "tiny-llama", "seed": seed},
                           {"lr": 3e-3, "micro_batch_size": 2}, {"max_new_tokens": 4},
                           bucket_bytes=64 << 10, nprocs=2, name="policy")


def test_hybrid_switch_after_log_probs_takes_the_sharded_parameters():
    """FSDP2 leaves the root's parameters gathered after a forward with no backward; the
    backend reshards them, so a first switch right after log-probs plans on the real
    (sharded) parameters, and later switches carry the trained weights."""

    batch = fixed_batch()  # here, not on the controller's loop (it would block heartbeats)

    async def main():
        async with asyncrl.Controller() as ctl:
            policy = await small_policy(ctl, Policy, seed=1)
            pids = group_pids(policy)
            await policy.logprobs(batch)  # train mode, no backward
            await policy.generate(prompts_batch(4))  # the first switch right after it
            await policy.train_step(batch)  # its backward frees FSDP's gathered temporaries
            await policy.generate(prompts_batch(4))
            return ((await policy.weights("engine"))[0], (await policy.weights("train"))[0],
                    pids)
    engine_w, train_w, pids = run(main(), timeout=300)
    assert_gone(pids)
    assert train_w and set(engine_w) >= set(train_w)  # (all() of none: true)
    assert all(torch.equal(engine_w[k], train_w[k]) for k in train_w)


def failing_once(real, message: str, here: bool):
    """`real`, whose first call raises an out-of-memory error `here` (on one rank)."""
    failures = [int(here)]

    def flaky(*args):
        if failures[0]:
            failures[0] -= 1
            raise torch.OutOfMemoryError(message)
        return real(*args)
    return flaky


def fails_once_on_rank_1(policy: Policy, method: str, message: str) -> None:
    """The policy's backend `method` raises an out-of-memory error once, on rank 1."""
    setattr(policy.backend, method,
            failing_once(getattr(policy.backend, method), message, policy.rank == 1))


class FlakySwitchPolicy(Policy):
    """Rank 1's first switch to generation fails before its gathers (its optimizer's memory
    could not be moved: an out-of-memory on a GPU)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        fails_once_on_rank_1(self, "offload_masters", "the masters found no room (rank 1)")


class FlakyFillPolicy(Policy):
    """Rank 1's first gathers fail: copying the first bucket's rows (after its all_gather)
    into the engine's weights (a switch to generation) or a sync_pack's flat buffer."""

    def __init__(self, *args, **kwargs):
        import asyncrl.hybrid.gather as gather

        super().__init__(*args, **kwargs)
        gather._spread = failing_once(gather._spread, "the copy found no room (rank 1)",
                                      self.rank == 1)


@pytest.mark.parametrize("cls, seed, own, peers", [
    (FlakySwitchPolicy, 2, "the masters found no room", "preparing the switch to generation"),
    (FlakyFillPolicy, 3, "the copy found no room", "filling the engine")],
    ids=["before the gathers", "in the gathers"])
def test_a_switch_failing_on_one_rank_fails_its_peers_at_once_and_the_next_one_goes(
        cls, seed, own, peers):
    """A switch that failed on one rank before its gathers left its peers in the first
    all_gather until the collective timeout; then their modes differed (one generating,
    one training), and the group's next collectives met the wrong ones. Failing in its
    gathers (a copy after a bucket's all_gather), it went straight to agreeing the failure
    while its peers went on into the next bucket's all_gather, and waited there (on NCCL,
    the group's collectives out of step after)."""
    async def main():
        async with asyncrl.Controller(collective_timeout=300.0) as ctl:
            policy = await small_policy(ctl, cls, seed=seed)
            pids = group_pids(policy)
            with pytest.raises(asyncrl.RemoteError) as e:
                await policy.generate(prompts_batch(4))

            def said() -> str:  # either rank's error may come first, the other as a note
                return "\n".join([str(e.value), *getattr(e.value, "__notes__", [])])
            await poll_until(lambda: own in said() and f"{peers} failed on another rank"
                             in said(), 30, "both ranks' errors")
            out = await policy.generate(prompts_batch(4))
            return pids, out, (await policy.weights("engine"))[0], \
                (await policy.weights("train"))[0]
    pids, out, engine_w, train_w = run(main(), timeout=120)
    assert_gone(pids)
    assert len(out) == 4 and all(torch.equal(engine_w[k], train_w[k]) for k in train_w)


class FlakyRestorePolicy(Policy):
    """Rank 1's first way back to training fails to bring its optimizer's memory back."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        fails_once_on_rank_1(self, "reload_masters", "no room for the masters (rank 1)")


def test_a_way_back_to_training_failing_on_one_rank_fails_its_peers_at_once():
    """Rank 1 raised on its way back to training while rank 0 went on into the step's
    collectives and waited there until the collective timeout."""
    batch = fixed_batch()

    async def main():
        async with asyncrl.Controller(collective_timeout=300.0) as ctl:
            policy = await small_policy(ctl, FlakyRestorePolicy, seed=3)
            pids = group_pids(policy)
            await policy.generate(prompts_batch(4))
            with pytest.raises(asyncrl.RemoteError) as e:
                await policy.train_step(batch)

            def said() -> str:
                return "\n".join([str(e.value), *getattr(e.value, "__notes__", [])])
            await poll_until(lambda: "no room for the masters" in said() and "switching "
                             "back to training failed on another rank" in said(), 30,
                             "both ranks' errors")
            return pids, await policy.train_step(batch)  # the restore done now: it trains
    pids, stats = run(main(), timeout=120)
    assert_gone(pids)
    assert len(stats) == 2 and all(s["loss"] > 0 for s in stats)


class QuickPolicy(Policy):
    """Waits 2 s, not 300, for rollouts to pull the last sync_pack."""

    sync_release_timeout = 2.0


@pytest.mark.parametrize(("cls", "collective", "held"), [
    (QuickPolicy, 300.0, "2"),
    (Policy, 10.0, "8")])  # (its wait cut to 0.8 of a collective timeout below its own 300 s)
def test_a_sync_pack_held_too_long_fails_every_rank_at_once_and_the_next_step_trains(
        cls, collective, held):
    """Only rank 0 holds sync packs: it alone timed out waiting for the last one to be
    released, while its peer went on into the step's first all_gather and waited there until
    the collective timeout (then the group's collectives were out of step). Its peers wait in
    a collective meanwhile: a wait past the collective timeout failed them alone."""
    batch = fixed_batch()

    async def main():
        async with asyncrl.Controller(collective_timeout=collective) as ctl:
            policy = await ctl.spawn(cls, {"preset": "tiny-llama", "seed": 5},
                                     {"lr": 3e-3, "micro_batch_size": 2}, nprocs=2,
                                     hybrid=False, name="trainer")
            pids = group_pids(policy)
            pack = policy.sync_pack()
            await pack  # pulled, and its future kept: rank 0 still holds the weights' views
            with pytest.raises(asyncrl.RemoteError) as e:  # (not a TimeoutError: a hang)
                await asyncio.wait_for(policy.train_step(batch), 30)

            def said() -> str:
                return "\n".join([str(e.value), *getattr(e.value, "__notes__", [])])
            await poll_until(lambda: f"still held after {held} s" in said() and "waiting for the "
                             "last sync_pack to be released failed on another rank" in said(),
                             30, "both ranks' errors")
            del pack  # released: the next step goes
            return pids, await policy.train_step(batch)
    pids, stats = run(main(), timeout=120)
    assert_gone(pids)
    assert len(stats) == 2 and all(s["loss"] > 0 for s in stats)


class FlakySyncPolicy(Policy):
    """Rank 1's first sync_pack finds no room for the flat buffer of its small weights."""

    def __init__(self, *args, **kwargs):
        import asyncrl.hybrid.weight_sync as weight_sync

        super().__init__(*args, **kwargs)
        weight_sync._flat = failing_once(weight_sync._flat, "no room for the flat buffer "
                                         "(rank 1)", self.rank == 1)


def test_a_sync_pack_failing_on_one_rank_before_its_gathers_fails_its_peers_at_once():
    """Rank 1 raised before the small weights' all_gather (out of memory for their flat
    buffer) while rank 0 went on into it and waited there until the collective timeout."""
    async def main():
        async with asyncrl.Controller(collective_timeout=300.0) as ctl:
            policy = await ctl.spawn(FlakySyncPolicy, {"preset": "tiny-llama", "seed": 6},
                                     {"lr": 3e-3}, nprocs=2, hybrid=False, name="trainer")
            pids = group_pids(policy)
            with pytest.raises(asyncrl.RemoteError) as e:  # (not a TimeoutError: a hang)
                await asyncio.wait_for(policy.sync_pack(), 30)

            def said() -> str:
                return "\n".join([str(e.value), *getattr(e.value, "__notes__", [])])
            await poll_until(lambda: "no room for the flat buffer" in said() and "preparing "
                             "the weights' gathers failed on another rank" in said(), 30,
                             "both ranks' errors")
            pack = await policy.sync_pack()  # the next one goes
            return pids, dict(unpack(pack)), (await policy.weights("train"))[0]
    pids, sent, train_w = run(main(), timeout=120)
    assert_gone(pids)
    assert sent and all(torch.equal(w, train_w[k]) for k, w in sent.items())


class FlakyLargeGatherPolicy(Policy):
    """Every sharded weight gathered alone, as the large ones are; rank 0's first finds no
    room for its buffers (rank 0 alone holds the pack: it runs out first)."""

    def __init__(self, *args, **kwargs):
        import asyncrl.hybrid.weight_sync as weight_sync

        super().__init__(*args, **kwargs)
        weight_sync.SMALL_BYTES = 0
        weight_sync.rows_buffers = failing_once(weight_sync.rows_buffers, "no room to "
                                                "gather (rank 0)", self.rank == 0)


@pytest.mark.parametrize("cls, nprocs, own, peers", [
    (FlakyLargeGatherPolicy, 3, "no room to gather", "weight 'model.embed_tokens.weight'"),
    (FlakyFillPolicy, 2, "the copy found no room", "the small weights")],
    ids=["large, uneven shards", "small"])
def test_a_sync_pack_failing_in_its_gathers_fails_its_peers_at_once_and_the_next_goes(
        cls, nprocs, own, peers):
    """A sync_pack failing in a weight's gather ended that rank's gathers while its peers
    waited in the all_gather until the collective timeout (the group's collectives out of
    step after): rank 0 out of memory for a large weight, or a rank's copy of the small."""
    batch = fixed_batch()

    async def main():
        async with asyncrl.Controller(collective_timeout=20.0) as ctl:
            policy = await ctl.spawn(cls, {"preset": "tiny-llama", "seed": 7},
                                     {"lr": 3e-3, "micro_batch_size": 2}, nprocs=nprocs,
                                     hybrid=False, name="trainer")
            pids = group_pids(policy)
            with pytest.raises(asyncrl.RemoteError) as e:  # (not a TimeoutError: a hang)
                await asyncio.wait_for(policy.sync_pack(), 15)

            def said() -> str:
                return "\n".join([str(e.value), *getattr(e.value, "__notes__", [])])
            await poll_until(lambda: own in said() and f"gathering {peers} failed on another "
                             "rank" in said(), 10, "every rank's errors")
            sent = dict(unpack(await policy.sync_pack()))  # the next one goes
            return pids, sent, (await policy.weights("train"))[0], \
                await policy.train_step(batch)
    pids, sent, train_w, stats = run(main(), timeout=60)
    assert_gone(pids)
    assert sent.keys() == train_w.keys() and all(torch.equal(w, train_w[k])
                                                 for k, w in sent.items())
    assert len(stats) == nprocs and all(s["loss"] > 0 for s in stats)


def test_weights_of_a_policy_without_an_engine_say_to_ask_for_the_train_layout():
    """weights("engine") of a hybrid=False Policy said "layout is 'train' or 'engine', got
    'engine'"."""
    policy = Policy.__new__(Policy)
    policy.hybrid, policy.group_name = None, "trainer"
    with pytest.raises(ValueError, match="'trainer' was built with hybrid=False: it has no "
                                         "generation engine; use layout='train'"):
        policy.weights("engine")


def test_a_policy_checkpoint_brings_back_its_weights_and_the_engine_follows(tmp_path):
    """A Policy that trains (SFT, or a trainer feeding Rollouts) keeps state: its checkpoint
    restores weights and version (it resumed as freshly built), and the next generation runs
    on the restored weights, not on those of the last switch."""
    from asyncrl.controller.declare import GroupSpec

    assert GroupSpec(Policy, (), {}, 1, None, None, None, None, "").stateful
    batch = fixed_batch()

    async def main():
        async with asyncrl.Controller() as ctl:
            policy = await small_policy(ctl, Policy, seed=4)
            pids = group_pids(policy)
            await policy.train_step(batch)
            await policy.save_checkpoint(str(tmp_path))
            saved = (await policy.weights("train"))[0]
            await policy.train_step(batch)
            await policy.generate(prompts_batch(4))  # the engine holds step 2's weights
            await policy.load_checkpoint(str(tmp_path))
            await policy.generate(prompts_batch(4))
            return (saved, (await policy.weights("train"))[0],
                    (await policy.weights("engine"))[0], pids)
    saved, loaded, engine, pids = run(main(), timeout=300)
    assert_gone(pids)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert all(torch.equal(engine[k], saved[k]) for k in saved)


def test_an_engine_freed_while_training_comes_back_with_the_trained_weights():
    async def main():
        async with asyncrl.Controller() as ctl:
            policy = await small_policy(ctl, ReleasingPolicy, seed=2)
            pids = group_pids(policy)
            held = [await policy.engine_bytes()]  # built in train mode: nothing held
            rollout = policy.generate(prompts_batch(4))
            held.append(await policy.engine_bytes())
            await policy.train_step(rollout)
            held.append(await policy.engine_bytes())  # training: freed again
            engine_w = (await policy.weights("engine"))[0]  # gathered again for this
            train_w = (await policy.weights("train"))[0]
            again = await policy.generate(prompts_batch(4))
            return held, engine_w, train_w, again, pids
    held, engine_w, train_w, again, pids = run(main(), timeout=300)
    assert_gone(pids)
    total = sum(v.numel() * v.element_size() for v in train_w.values())
    assert held[0][0] == 0 and held[1][0] >= total and held[2][0] == 0, held
    assert train_w and set(engine_w) >= set(train_w)  # (all() of none: true)
    assert all(torch.equal(engine_w[k], train_w[k]) for k in train_w)
    assert len(again) == 4 and again["response_mask"].sum() > 0


def test_a_bf16_trainers_engine_generates_in_bf16():
    """As on a GPU, where bf16 is the default: the engine's weights are the trainer's cast to
    bf16 (an fp32 engine held twice the memory and computed otherwise than the trainer), and
    its log-probs are close to the trainer's bf16 forward's."""
    async def main():
        async with asyncrl.Controller() as ctl:
            policy = await ctl.spawn(Policy, {"preset": "tiny-llama", "seed": 4},
                                     {"bf16": True}, {"max_new_tokens": 6}, name="bf16")
            rollout = await policy.generate(prompts_batch(4))
            trained = await policy.logprobs(rollout)
            return ((await policy.weights("engine"))[0], (await policy.weights("train"))[0],
                    rollout, trained, group_pids(policy))
    engine_w, train_w, rollout, trained, pids = run(main(), timeout=300)
    assert_gone(pids)
    assert {v.dtype for v in engine_w.values()} == {torch.bfloat16}
    assert train_w and set(engine_w) >= set(train_w)  # (all() of none: true)
    assert all(torch.equal(engine_w[k], train_w[k].bfloat16()) for k in train_w)
    mask = rollout["response_mask"].bool()
    assert torch.allclose(rollout["logprobs"][mask], trained["logprobs"][mask], atol=5e-3)


def test_a_zero_policy_syncs_each_parameter_once_and_no_buffers():
    """tiny-gpt2 ties lm_head to the embeddings: the pack named both (the bytes twice), and
    it held buffers too, which a rollout's engine refuses (as FSDP2's pack never sent)."""
    pytest.importorskip("deepspeed")

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            model = {"preset": "tiny-gpt2", "seed": 5}
            policy, rollout = await asyncio.gather(
                ctl.spawn(Policy, model, backend="zero2", hybrid=False, name="zero"),
                ctl.spawn(Rollout, {**model, "seed": 6}, name="rollout"))
            synced = await rollout.load_weights(policy.sync_pack())
            sampled = await rollout.generate(prompts_batch(4))
            return (synced, sampled, await policy.logprobs(sampled),
                    group_pids(policy) + group_pids(rollout))
    synced, sampled, scored, pids = run(main(), timeout=580)
    assert_gone(pids)
    unique = build_model(ModelConfig(preset="tiny-gpt2")).named_parameters()
    sizes = [p.numel() * p.element_size() for _, p in unique]
    assert synced["sync/tensors"] == len(sizes) and synced["sync/bytes"] == sum(sizes)
    # the rollout samples with the policy's weights (its own seed's are gone)
    assert (scored["logprobs"] - sampled["logprobs"]).abs().max().item() < 1e-5


@pytest.mark.timeout(600)
def test_hybrid_policy_on_zero3_round_trip():
    pytest.importorskip("deepspeed")

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            policy, fsdp = await asyncio.gather(*(
                ctl.spawn(Policy, {"preset": "tiny-llama"}, {"lr": 3e-3}, {"max_new_tokens": 4},
                          backend=backend, nprocs=2, name=backend)
                for backend in ("zero3", "fsdp2")))
            pids = group_pids(policy) + group_pids(fsdp)
            rollout = policy.generate(prompts_batch(4))
            engine_w = (await policy.weights("engine"))[0]
            train_w = (await policy.weights("train"))[0]
            report = (await policy.switch_report())[0]
            # a step after a switch, the masters back from the host: as FSDP2's step
            await asyncio.gather(policy.train_step(rollout), fsdp.train_step(rollout))
            await policy.generate(prompts_batch(4))
            engine_after = (await policy.weights("engine"))[0]
            train_after = (await policy.weights("train"))[0]
            fsdp_after = (await fsdp.weights("train"))[0]
            return engine_w, train_w, engine_after, train_after, fsdp_after, report, pids
    engine_w, train_w, engine_after, train_after, fsdp_after, report, pids = \
        run(main(), timeout=580)
    assert_gone(pids)
    assert train_w and set(engine_w) >= set(train_w)  # (all() of none: true)
    assert all(torch.equal(engine_w[k], train_w[k]) for k in train_w)
    assert all(torch.equal(engine_after[k], train_after[k]) for k in train_after)
    assert any(not torch.equal(train_after[k], train_w[k]) for k in train_w)
    # Adam's first step moves each weight by about lr (3e-3): equal up to 5 % of it (ZeRO
    # and FSDP2 sum gradients in other orders, and Adam divides tiny gradients by themselves)
    assert all(torch.allclose(train_after[k], fsdp_after[k], atol=1.5e-4) for k in fsdp_after)
    # each rank's half of the fp32 masters went to the host (its padding aside)
    params = list(build_model(ModelConfig()).parameters())
    half = 4 * sum(p.numel() for p in params) / 2
    assert report["mode"] == "generate" and abs(report["offloaded_bytes"] - half) <= 4 * len(params)



def test_a_trainers_model_has_no_dropout_whatever_its_config_calls_it(tmp_path):
    """Only a fixed list of dropout fields was zeroed: StarCoder2's residual_dropout and
    embedding_dropout stayed on, and a trainer's log-probs (train mode) carried dropout
    noise, PPO's ratio noisy from step 0. Every float field named like a rate is zeroed,
    in sub-configs and dicts too (DBRX's attn_config.attn_pdrop)."""
    from transformers import AutoModelForCausalLM, DbrxConfig, Starcoder2Config

    from asyncrl.hybrid.models import zero_dropout

    config = Starcoder2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                              residual_dropout=0.1, embedding_dropout=0.1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    model = build_model(ModelConfig(path=str(tmp_path / "ckpt"))).train()
    ids = torch.tensor([PROMPTS[2]])
    assert torch.equal(model(ids).logits, model(ids).logits)
    dbrx = DbrxConfig(emb_pdrop=0.1, attn_config={"attn_pdrop": 0.1})
    nested = {"layerdrop": 0.1, "sub": {"mlp_dropout": 0.2, "use_dropout": True}}
    zero_dropout(dbrx)
    zero_dropout(nested)
    assert (dbrx.emb_pdrop, dbrx.attn_config.attn_pdrop) == (0, 0)
    assert nested == {"layerdrop": 0, "sub": {"mlp_dropout": 0, "use_dropout": True}}


def test_model_overrides_name_the_setting_that_does_what_they_would(tmp_path):
    """overrides={"dtype": ...} passed (the config has the field) and changed nothing: the
    weights stayed float32; "attn_implementation" was refused as no field; a vocab_size
    larger than the checkpoint's failed with transformers' ignore_mismatched_sizes advice,
    no asyncrl option."""
    for key, value in (("dtype", "bfloat16"), ("torch_dtype", torch.bfloat16)):
        with pytest.raises(ValueError, match=rf"'{key}' does not set the weights' dtype; give "
                                             rf"model={{..., 'dtype': 'bfloat16'}} "
                                             rf"\(ModelConfig.dtype=\)"):
            ModelConfig(overrides={key: value})
    model = build_model(ModelConfig(overrides={"attn_implementation": "eager"}))
    assert model.config._attn_implementation == "eager"
    build_model(ModelConfig(seed=1)).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"overrides \{'vocab_size': 160\}: the weights of "
                                         r"checkpoint .*resize_token_embeddings\(n\)"):
        build_model(ModelConfig(path=str(tmp_path / "ckpt"), overrides={"vocab_size": 160}))


def test_a_bf16_reference_scores_as_a_bf16_trainer_does():
    """A Reference computed in its model's dtype (fp32 by default) beside a bf16 trainer (a
    GPU's default): its log-probs differed from the trainer's by ~1e-2, the KL above 0
    before any update. bf16=True (None: on the GPUs that support it) computes as it does."""
    from asyncrl.hybrid.roles import Reference

    model = {"preset": "tiny-llama", "seed": 0}

    async def main():
        async with asyncrl.Controller() as ctl:
            policy = await ctl.spawn(Policy, model, {"bf16": True}, {"max_new_tokens": 6},
                                     hybrid=False, name="policy")
            refs = [await ctl.spawn(Reference, model, bf16=bf16, name=f"ref{i}")
                    for i, bf16 in enumerate((True, None))]
            pids = group_pids(policy) + [p for r in refs for p in group_pids(r)]
            rollout = Sampler(build_model(ModelConfig(preset="tiny-llama", seed=0)),
                              SamplingConfig(max_new_tokens=6)).generate(
                [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]], seeds=[0, 1, 2, 3])
            trainer = (await policy.logprobs(rollout))["logprobs"]
            scored = [(await r.logprobs(rollout))["logprobs"] for r in refs]
            return trainer, scored, rollout["response_mask"].bool(), pids
    trainer, (bf16, default), mask, pids = run(main(), timeout=300)
    assert_gone(pids)
    gap = [(lp - trainer)[mask].abs().max().item() for lp in (bf16, default)]
    assert gap[0] < 1e-5 < 1e-3 < gap[1], gap  # (no GPU here: the default is fp32)
