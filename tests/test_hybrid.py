"""Models, the built-in generation engine and the FSDP2 training backend (CPU)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import assert_gone, group_pids, run

import asyncrl
from asyncrl import TensorBatch
from asyncrl.hybrid.fsdp import FSDPBackend, TrainConfig, sequence_mean_nll
from asyncrl.hybrid.models import ModelConfig, build_model, sequence_logprobs
from asyncrl.hybrid.roles import Policy
from asyncrl.hybrid.sampler import Sampler, SamplingConfig, sample, streams, top_p_filter, uniforms

PROMPTS = [[1, 5, 6], [1, 7], [1, 9, 10, 11, 12], [1, 3]]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_engine_logprobs_equal_a_training_forward_pass(preset):
    model = build_model(ModelConfig(preset=preset))
    out = Sampler(model, SamplingConfig(max_new_tokens=10)).generate(PROMPTS, seeds=[1, 2, 3, 4])
    forward = sequence_logprobs(model, out["prompt_ids"], out["prompt_mask"],
                                out["response_ids"], out["response_mask"])
    assert (forward - out["logprobs"]).abs().max().item() < 1e-5
    assert out["response_mask"].sum().item() == 4 * 10


def test_a_model_config_takes_a_preset_or_a_path_and_defaults_to_tiny_llama():
    """path= alone was refused: the preset default was there too."""
    assert ModelConfig().preset == "tiny-llama"
    assert (ModelConfig(path="/ckpt").preset, ModelConfig(path="/ckpt").path) == (None, "/ckpt")
    with pytest.raises(ValueError, match="preset= .* or path= .*not both: got preset='tiny-"):
        ModelConfig(preset="tiny-llama", path="/ckpt")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        ModelConfig(preset="huge")


def test_seeds_stop_tokens_temperature_and_top_p():
    model = build_model(ModelConfig())
    engine = Sampler(model)
    cfg = SamplingConfig(max_new_tokens=12, temperature=0.7)
    a = engine.generate(PROMPTS, seeds=[1, 2, 3, 4], config=cfg)
    b = engine.generate(PROMPTS, seeds=[1, 2, 3, 4], config=cfg)
    c = engine.generate(PROMPTS, seeds=[5, 6, 7, 8], config=cfg)
    assert torch.equal(a["response_ids"], b["response_ids"])  # a seed per sample
    assert not torch.equal(a["response_ids"], c["response_ids"])
    forward = sequence_logprobs(model, a["prompt_ids"], a["prompt_mask"], a["response_ids"],
                                a["response_mask"], temperature=0.7)
    assert (forward - a["logprobs"]).abs().max().item() < 1e-5
    stop = int(a["response_ids"][0, 3])  # make that token a stop token: row 0 ends there
    s = engine.generate(PROMPTS, seeds=[1, 2, 3, 4],
                        config=SamplingConfig(max_new_tokens=12, temperature=0.7,
                                              stop_token_ids=(stop,)))
    first = (a["response_ids"][0] == stop).nonzero()[0].item()
    mask = s["response_mask"][0].tolist()
    assert mask == [1] * (first + 1) + [0] * (12 - first - 1)  # a prefix, stop included
    assert s["response_ids"][0, first] == stop and s["logprobs"][0, first + 1:].eq(0).all()
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    kept = top_p_filter(logits, 0.7).isfinite()[0].tolist()
    assert kept == [True, True, False, False]  # 0.64 < 0.7: the second token is kept too
    with pytest.raises(ValueError, match="one seed per sample"):
        engine.generate(PROMPTS, seeds=[1])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SamplingConfig(temperature=0)


def test_sampling_follows_the_distribution_and_depends_on_seed_and_step_only():
    probs = torch.tensor([0.5, 0.3, 0.0, 0.2]).expand(20_000, 4)
    stream = streams(range(20_000))
    drawn = sample(probs, uniforms(stream, step=0))
    freq = torch.bincount(drawn, minlength=4) / 20_000
    # 4 standard deviations of a binomial at n=20,000 is below 0.015
    assert (freq - probs[0]).abs().max().item() < 0.015 and freq[2] == 0
    later = sample(probs, uniforms(stream, step=1))
    assert 0.3 < (later == drawn).float().mean().item() < 0.45  # steps independent (0.38)
    u = uniforms(stream, 0)
    assert 0 <= u.min().item() and u.max().item() < 1 and abs(u.mean().item() - 0.5) < 0.01
    # a sample draws the same uniforms alone or in any batch, whatever its seed's size
    assert torch.equal(uniforms(streams([7]), 3)[0], uniforms(streams([5, 6, 7]), 3)[2])
    assert uniforms(streams([-1, 2**64 - 1, 2**70]), 0).isfinite().all()
    one_hot = torch.tensor([[0.0, 0.0, 1.0]])  # top-p left one token: always that one
    assert sample(one_hot, torch.tensor([0.0])).item() == 2
    assert sample(one_hot, torch.tensor([1 - 2**-53])).item() == 2
    cut = torch.tensor([[0.3, 0.7, 0.0]])  # u rounds up to the total in fp32: not token 2
    assert sample(cut, torch.tensor([1 - 2**-30], dtype=torch.float64)).item() == 1
    with pytest.raises(ValueError, match="probabilities contain NaN"):
        sample(torch.tensor([[float("nan"), 1.0]]), torch.tensor([0.5]))
    model = build_model(ModelConfig())
    engine = Sampler(model, SamplingConfig(max_new_tokens=8))
    alone = engine.generate(PROMPTS[2:3], seeds=[3])
    batch = engine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    n = int(alone["response_mask"].sum())
    assert torch.equal(alone["response_ids"][0, :n], batch["response_ids"][2, :n])


def test_engine_loads_weights_in_place_and_sleeps():
    src, dst = build_model(ModelConfig(seed=1)), build_model(ModelConfig(seed=2))
    engine = Sampler(dst)
    before = {n: p.data_ptr() for n, p in dst.named_parameters()}
    assert engine.load_weights(src.named_parameters()) == len(before)
    assert all(torch.equal(p, dict(src.named_parameters())[n]) for n, p in dst.named_parameters())
    assert {n: p.data_ptr() for n, p in dst.named_parameters()} == before  # no new memory
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, seeds=[0, 0, 0, 0])
    engine.wake()
    assert len(engine.generate(PROMPTS, seeds=[0, 0, 0, 0])) == 4


def test_engine_takes_state_dicts_of_tied_models_bf16_packs_and_refuses_bad_ones_whole():
    src, dst = build_model(ModelConfig(preset="tiny-gpt2", seed=1)), build_model(
        ModelConfig(preset="tiny-gpt2", seed=2))
    engine = Sampler(dst)
    state = src.state_dict()  # its tied lm_head.weight is a name of the embedding too
    assert engine.load_weights(state.items()) == len(state)
    assert all(torch.equal(v, dst.state_dict()[k]) for k, v in state.items())
    half = {k: v.to(torch.bfloat16) for k, v in build_model(
        ModelConfig(preset="tiny-gpt2", seed=3)).state_dict().items()}  # a bf16 trainer's pack
    assert engine.adopt_weights(half.items(), version=4) == len(half)
    assert all(p.dtype == torch.float32 for p in dst.parameters()) and engine.version == 4
    assert all(torch.equal(v.float(), dst.state_dict()[k]) for k, v in half.items())
    kept = {k: v.clone() for k, v in dst.state_dict().items()}
    bad = [*state.items(), ("transformer.wte.weight", torch.zeros(3, 3))]
    with pytest.raises(ValueError, match=r"transformer.wte.weight is \(3, 3\)"):
        engine.adopt_weights(bad, version=5)
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.load_weights([*state.items(), ("nope", torch.zeros(1))])
    assert all(torch.equal(v, dst.state_dict()[k]) for k, v in kept.items())  # nothing changed
    assert engine.version == 4


def fixed_batch() -> TensorBatch:
    model = build_model(ModelConfig(seed=3))
    return Sampler(model, SamplingConfig(max_new_tokens=6)).generate(
        [[1, 4 + i, 5 + i] for i in range(8)], seeds=list(range(8)))


class Trainer(asyncrl.Worker):
    def __init__(self, model_cfg: dict, train_cfg: dict):
        self.backend = FSDPBackend(ModelConfig(**model_cfg), TrainConfig(**train_cfg),
                                   self.device_mesh)

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def step(self, batch: TensorBatch) -> dict:
        return self.backend.train_step(batch)

    @asyncrl.register  # every rank: gathering the full weights is a collective
    def weights(self) -> dict:
        return self.backend.state_dict()

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def poisoned_step(self, batch: TensorBatch) -> dict:  # a loss that is NaN on rank 1 only
        def loss_fn(out, micro):
            loss = sequence_mean_nll(out["logprobs"], micro)
            return (loss * float("nan") if self.rank == 1 else loss), {}
        return self.backend.train_step(batch, loss_fn)


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"dp": 1, "tp": 2}], ids=["dp2", "dp1-tp2"])
def test_fsdp2_steps_match_one_process_on_the_whole_batch(mesh):
    batch = fixed_batch()
    model_cfg, train_cfg = {"preset": "tiny-llama", "seed": 0}, {"lr": 3e-3, "micro_batch_size": 2}

    # the same three steps in this process, unsharded, on the whole batch
    ref = build_model(ModelConfig(**model_cfg)).train()
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.0)
    expected = []
    for _ in range(3):
        loss = sequence_mean_nll(sequence_logprobs(ref, batch["prompt_ids"], batch["prompt_mask"],
                                                   batch["response_ids"], batch["response_mask"]),
                                 batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        expected.append(loss.detach().item())

    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Trainer, model_cfg, train_cfg, nprocs=2, mesh=mesh)
            pids = group_pids(group)
            losses = []
            for _ in range(3):
                per_chunk = await group.step(batch)
                assert len({c["loss"] for c in per_chunk}) == 1  # all-reduced over dp
                losses.append(per_chunk[0]["loss"])
            weights = (await group.weights())[0]
            poisoned = await group.poisoned_step(batch)  # every rank skips the step
            kept = (await group.weights())[0]
            return losses, weights, poisoned, kept, pids
    losses, weights, poisoned, kept, pids = run(main(), timeout=300)
    assert_gone(pids)
    assert [p["grad_nonfinite"] for p in poisoned] == [1.0] * mesh["dp"]
    assert all(torch.equal(kept[k], weights[k]) for k in weights)  # no NaN weights
    assert losses[2] < losses[0]
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
    ref_sd = ref.state_dict()
    assert set(weights) == set(ref_sd)
    assert max((weights[k] - ref_sd[k]).abs().max().item() for k in ref_sd) < 1e-4


def prompts_batch(n: int) -> TensorBatch:
    return TensorBatch({"prompt": [[1, 4 + i, 9] for i in range(n)], "seed": list(range(n))})


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
    assert all(torch.equal(engine_w[k], train_w[k]) for k in train_w)


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


class ReleasingPolicy(Policy):
    """A hybrid Policy that frees its engine's weights while training, as on a GPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hybrid._frees_memory = lambda: True
        self.hybrid._release()  # as its constructor does on a GPU

    @asyncrl.register
    def engine_numel(self) -> int:
        return sum(p.numel() for p in self.hybrid.engine.model.parameters())


def test_an_engine_freed_while_training_comes_back_with_the_trained_weights():
    async def main():
        async with asyncrl.Controller() as ctl:
            policy = await small_policy(ctl, ReleasingPolicy, seed=2)
            pids = group_pids(policy)
            held = [await policy.engine_numel()]  # built in train mode: nothing held
            rollout = policy.generate(prompts_batch(4))
            held.append(await policy.engine_numel())
            await policy.train_step(rollout)
            held.append(await policy.engine_numel())  # training: freed again
            engine_w = (await policy.weights("engine"))[0]  # gathered again for this
            train_w = (await policy.weights("train"))[0]
            again = await policy.generate(prompts_batch(4))
            return held, engine_w, train_w, again, pids
    held, engine_w, train_w, again, pids = run(main(), timeout=300)
    assert_gone(pids)
    total = sum(v.numel() for v in train_w.values())
    assert held[0][0] == 0 and held[1][0] >= total and held[2][0] == 0, held
    assert all(torch.equal(engine_w[k], train_w[k]) for k in train_w)
    assert len(again) == 4 and again["response_mask"].sum() > 0


class AnyTrainer(asyncrl.Worker):
    """FSDP2 or ZeRO-2/3 behind one interface."""

    def __init__(self, kind: str, model_cfg: dict, train_cfg: dict):
        if kind == "fsdp2":
            self.backend = FSDPBackend(ModelConfig(**model_cfg), TrainConfig(**train_cfg),
                                       self.device_mesh)
        else:
            from asyncrl.hybrid.zero import ZeroBackend

            self.backend = ZeroBackend(ModelConfig(**model_cfg), TrainConfig(**train_cfg),
                                       stage=int(kind[-1]))

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def step(self, batch: TensorBatch) -> dict:
        return self.backend.train_step(batch)

    @asyncrl.register
    def weights(self) -> dict:
        return self.backend.state_dict()

    @asyncrl.register
    def reload(self, weights: dict) -> bool:
        self.backend.load_state_dict(weights)
        return True

    @asyncrl.register
    def save(self, folder: str) -> None:
        self.backend.save(folder)

    @asyncrl.register
    def load(self, folder: str) -> None:
        self.backend.load(folder)

    @asyncrl.register
    def save_as_before_schedules(self, folder: str) -> None:
        """A checkpoint as saved before schedules: weights and optimizer only (FSDP2), or
        DeepSpeed's with no scheduler (None in its place)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        backend = self.backend
        if isinstance(backend, FSDPBackend):
            model_sd, optim_sd = get_state_dict(backend.model, backend.opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
            return
        sched, backend.engine.lr_scheduler = backend.engine.lr_scheduler, None
        try:
            backend.save(folder)
        finally:
            backend.engine.lr_scheduler = sched


def test_trainer_forward_passes_have_no_dropout():
    """GPT-2's config turns dropout on; a trainer's model (in train mode) must give the
    log-probs the engine and the reference (in eval mode) give."""
    model = build_model(ModelConfig(preset="tiny-gpt2", seed=0)).train()
    batch = fixed_batch()
    cols = [batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    with torch.no_grad():
        first, second = sequence_logprobs(model, *cols), sequence_logprobs(model, *cols)
        model.eval()
        assert torch.equal(first, second) and torch.equal(first, sequence_logprobs(model, *cols))


def test_fsdp2_and_zero2_zero3_losses_agree_for_five_steps():
    """Five steps of batches of 8, 4, 8, 6 and 8 rows (2, 1, 2, 2 and 2 micro-batches per
    rank: DeepSpeed must step at each step's last micro-batch, whatever the last count),
    under one learning-rate schedule (warmup, then cosine: each backend steps it once per
    optimizer step)."""
    pytest.importorskip("deepspeed")
    from asyncrl.hybrid.fsdp import lr_factor

    batch = fixed_batch()
    sizes = [8, 4, 8, 6, 8]
    model_cfg = {"preset": "tiny-llama", "seed": 0}
    train_cfg = {"lr": 3e-3, "micro_batch_size": 2, "warmup_steps": 2, "schedule": "cosine",
                 "total_steps": 6, "min_lr_ratio": 0.1}

    async def main():
        async with asyncrl.Controller() as ctl:
            losses, lrs, pids = {}, {}, []
            for kind in ("fsdp2", "zero2", "zero3"):
                group = await ctl.spawn(AnyTrainer, kind, model_cfg, train_cfg, nprocs=2,
                                        name=kind)
                pids += group_pids(group)
                steps = [(await group.step(batch.slice(0, n)))[0] for n in sizes]
                losses[kind], lrs[kind] = [s["loss"] for s in steps], [s["lr"] for s in steps]
                if kind == "zero3":  # state dict out and in: the next step starts from it
                    w = (await group.weights())[0]
                    assert all(await group.reload(w))
                    assert all(torch.equal(w[k], v) for k, v in (await group.weights())[0].items())
                await ctl.close_group(group)
            return losses, lrs, pids
    losses, lrs, pids = run(main(), timeout=280)
    assert_gone(pids)
    for kind in ("zero2", "zero3"):
        for got, want in zip(losses[kind], losses["fsdp2"], strict=True):
            assert abs(got - want) <= 1e-4 * abs(want), (kind, losses)
    assert losses["fsdp2"][-1] < losses["fsdp2"][0]
    want = [3e-3 * lr_factor(TrainConfig(**train_cfg), i) for i in range(5)]
    assert want[:3] == [0.0, 1.5e-3, 3e-3] and 3e-4 < want[4] < want[3] < 3e-3
    for kind in lrs:
        assert lrs[kind] == pytest.approx(want, abs=1e-12), (kind, lrs)


def test_lr_schedules_and_their_config_errors():
    from asyncrl.hybrid.fsdp import lr_factor

    cos = TrainConfig(warmup_steps=4, schedule="cosine", total_steps=14, min_lr_ratio=0.2)
    assert [lr_factor(cos, s) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert lr_factor(cos, 9) == pytest.approx(0.6)  # halfway: 0.2 + 0.8 * 0.5
    assert lr_factor(cos, 14) == lr_factor(cos, 100) == pytest.approx(0.2)  # the floor
    lin = TrainConfig(schedule="linear", total_steps=10)
    assert [lr_factor(lin, s) for s in (0, 5, 10, 20)] == [1.0, 0.5, 0.0, 0.0]
    assert lr_factor(TrainConfig(warmup_steps=2), 1_000) == 1.0
    with pytest.raises(ValueError, match="total_steps, which must exceed warmup_steps"):
        TrainConfig(schedule="cosine", warmup_steps=5, total_steps=5)
    with pytest.raises(ValueError, match="schedule is 'constant', 'cosine' or 'linear'"):
        TrainConfig(schedule="step")
    with pytest.raises(ValueError, match="min_lr_ratio in"):
        TrainConfig(min_lr_ratio=1.5)


@pytest.mark.parametrize("kind", ["fsdp2", "zero2"])
def test_a_resumed_trainer_continues_its_lr_schedule(kind, tmp_path):
    from asyncrl.hybrid.fsdp import lr_factor

    if kind != "fsdp2":
        pytest.importorskip("deepspeed")

    batch = fixed_batch()
    model_cfg = {"preset": "tiny-llama", "seed": 0}
    train_cfg = {"lr": 1e-3, "micro_batch_size": 8, "warmup_steps": 4}

    async def main():
        async with asyncrl.Controller() as ctl:
            first, again, other = await asyncio.gather(  # started together: quicker
                ctl.spawn(AnyTrainer, kind, model_cfg, train_cfg, name="first"),
                ctl.spawn(AnyTrainer, kind, model_cfg, train_cfg, name="again"),
                # a resumed run with another lr: the config's lr wins, on both backends
                ctl.spawn(AnyTrainer, kind, model_cfg, {**train_cfg, "lr": 2e-3}, name="other"))
            before = [(await first.step(batch))[0]["lr"] for _ in range(3)]
            await first.save(str(tmp_path / "ckpt"))
            await again.load(str(tmp_path / "ckpt"))
            after = [(await again.step(batch))[0]["lr"] for _ in range(2)]
            await other.load(str(tmp_path / "ckpt"))
            changed = (await other.step(batch))[0]["lr"]
            pids = group_pids(first) + group_pids(again) + group_pids(other)
            # a checkpoint from before schedules: resumed at its optimizer step count
            await first.save_as_before_schedules(str(tmp_path / "old"))
            await other.load(str(tmp_path / "old"))
            old = (await other.step(batch))[0]["lr"]
            return before, after, changed, old, pids
    before, after, changed, old, pids = run(main(), timeout=280)
    assert_gone(pids)
    cfg = TrainConfig(**train_cfg)
    assert before + after == pytest.approx([1e-3 * lr_factor(cfg, i) for i in range(5)])
    assert after == pytest.approx([7.5e-4, 1e-3])  # the 4th and 5th steps, not a new warmup
    assert changed == pytest.approx(1.5e-3)  # step 4 of 2e-3's warmup
    assert old == pytest.approx(1.5e-3)


def test_vllm_adapter_against_a_fake_that_follows_vllm_api():
    import subprocess
    import sys

    import fake_vllm

    from asyncrl.hybrid.vllm_engine import VLLMEngine

    fake_vllm.LLM.calls.clear()
    engine = VLLMEngine("tiny-llama", SamplingConfig(max_new_tokens=6, stop_token_ids=(2,)),
                        llm_cls=fake_vllm.LLM, sampling_params_cls=fake_vllm.SamplingParams)
    init = fake_vllm.LLM.calls[0][1]
    assert init["distributed_executor_backend"] == "external_launcher"
    assert init["enable_sleep_mode"] is True
    assert init["logprobs_mode"] == "processed_logprobs" and init["skip_tokenizer_init"]
    out = engine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    mine = Sampler(build_model(ModelConfig()), SamplingConfig(max_new_tokens=6,
                                                              stop_token_ids=(2,)))
    want = mine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    for key in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
        assert torch.equal(out[key], want[key]), key
    assert (out["logprobs"] - want["logprobs"]).abs().max().item() < 1e-6
    hot = SamplingConfig(max_new_tokens=6, stop_token_ids=(2,), temperature=0.7)
    hot_out = engine.generate(PROMPTS, seeds=[1, 2, 3, 4], config=hot)
    hot_want = Sampler(mine.model, hot).generate(PROMPTS, seeds=[1, 2, 3, 4])
    assert torch.equal(hot_out["response_ids"], hot_want["response_ids"])
    assert (hot_out["logprobs"] - hot_want["logprobs"]).abs().max().item() < 1e-6  # after T
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    other = build_model(ModelConfig(seed=9))  # new weights while asleep survive the wake-up
    assert engine.load_weights(other.named_parameters(), version=3) == \
        len(list(other.parameters()))
    engine.wake()
    changed = engine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    theirs = Sampler(other, SamplingConfig(max_new_tokens=6, stop_token_ids=(2,))).generate(
        PROMPTS, seeds=[1, 2, 3, 4])
    assert torch.equal(changed["response_ids"], theirs["response_ids"])
    assert not torch.equal(changed["response_ids"], out["response_ids"])
    mask = changed["response_mask"].bool()
    assert changed["versions"][mask].eq(3).all() and changed["versions"][~mask].eq(-1).all()
    assert [(c[0], c[1]) for c in fake_vllm.LLM.calls if c[0] != "init"] == [
        ("sleep", 1), ("wake_up", ["weights"]), ("collective_rpc", "asyncrl_load_weights"),
        ("reset_prefix_cache", None), ("wake_up", ["kv_cache"])]
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        VLLMEngine("tiny-llama", tensor_parallel_size=2, llm_cls=fake_vllm.LLM,
                   sampling_params_cls=fake_vllm.SamplingParams)
    # vLLM's log-probs after top-p are renormalised over the nucleus: not the trainer's
    with pytest.raises(ValueError, match="top_p=0.9 < 1 is not supported"):
        engine.generate([[1, 4]], seeds=[0], config=SamplingConfig(top_p=0.9))
    # vLLM stays out of every CPU import path
    probe = subprocess.run([sys.executable, "-c", "import sys, asyncrl, asyncrl.hybrid.roles, "
                            "asyncrl.hybrid.vllm_engine; print('vllm' in sys.modules)"],
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "False", probe.stderr


def test_fsdp2_bf16_computes_in_bf16_and_stays_close_to_fp32():
    batch = fixed_batch()
    model_cfg = {"preset": "tiny-llama", "seed": 0}

    async def main():
        async with asyncrl.Controller() as ctl:
            out, pids = {}, []
            for bf16 in (False, True):
                group = await ctl.spawn(Trainer, model_cfg,
                                        {"lr": 3e-3, "micro_batch_size": 4, "bf16": bf16},
                                        nprocs=2, name=f"bf16-{bf16}")
                pids += group_pids(group)
                out[bf16] = [(await group.step(batch))[0]["loss"] for _ in range(2)]
                weights = (await group.weights())[0]
                assert all(v.dtype == torch.float32 for v in weights.values())  # fp32 masters
                await ctl.close_group(group)
            return out, pids
    out, pids = run(main(), timeout=300)
    assert_gone(pids)
    assert out[True] != out[False]  # bf16 compute really happened
    for a, b in zip(out[True], out[False], strict=True):
        assert abs(a - b) <= 2e-2 * abs(b)


@pytest.mark.timeout(600)
def test_hybrid_policy_on_zero3_round_trip():
    pytest.importorskip("deepspeed")

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            policy = await ctl.spawn(Policy, {"preset": "tiny-llama"}, {"lr": 3e-3},
                                     {"max_new_tokens": 4}, backend="zero3", nprocs=2)
            pids = group_pids(policy)
            rollout = policy.generate(prompts_batch(4))
            engine_w = (await policy.weights("engine"))[0]
            train_w = (await policy.weights("train"))[0]
            await policy.train_step(rollout)
            await policy.generate(prompts_batch(4))
            engine_after = (await policy.weights("engine"))[0]
            train_after = (await policy.weights("train"))[0]
            return engine_w, train_w, engine_after, train_after, pids
    engine_w, train_w, engine_after, train_after, pids = run(main(), timeout=580)
    assert_gone(pids)
    assert all(torch.equal(engine_w[k], train_w[k]) for k in train_w)
    assert all(torch.equal(engine_after[k], train_after[k]) for k in train_after)
    assert any(not torch.equal(train_after[k], train_w[k]) for k in train_w)


def test_a_rollout_tags_loads_with_versions_and_keeps_the_newest():
    """Rollout.load_weights runs on a pool beside generations: a dict without a version would
    leave tokens tagged with the old one (refused), and an older load finishing after a
    newer one is dropped (the engine would have gone back a version)."""
    from asyncrl.hybrid.roles import Rollout

    rollout = Rollout.__new__(Rollout)
    rollout.__init__({"preset": "tiny-llama", "seed": 1})
    params = dict(rollout.engine.model.named_parameters())

    def weights(fill: float) -> dict:
        return {k: torch.full_like(p, fill) for k, p in params.items()}
    with pytest.raises(ValueError, match="give version= .* every token is tagged with it"):
        rollout.load_weights(weights(1.0))
    assert rollout.load_weights(weights(5.0), version=5)["sync/version"] == 5
    assert rollout.load_weights(weights(3.0), version=3) == {"sync/version": 5.0,
                                                             "sync/stale": 1.0}
    assert all(p.eq(5.0).all() for p in rollout.engine.model.parameters())
    assert rollout.engine.version == 5
