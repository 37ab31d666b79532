"""What both training backends check and keep: a state dict with keys missing, bf16 ZeRO's
fp32 masters in and out, a loss's statistics with other keys on other ranks, a step with
no rows, and weight decay on the matrices alone."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_gone, group_pids, run
from test_backends import AnyTrainer
from test_hybrid import fixed_batch

import asyncrl
from asyncrl import TensorBatch
from asyncrl.hybrid.fsdp import nll_loss

MODEL = {"preset": "tiny-llama", "seed": 0}


class CheckTrainer(AnyTrainer):
    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def rank_stats_step(self, batch: TensorBatch, extra: bool | str) -> dict:
        """A loss whose statistics' keys depend on the rank's data (here its rank), or with
        extra="micro", on the micro-batch (a "d" in the second micro-batch on every rank)."""
        micros = []

        def loss_fn(out, micro):
            loss, _ = nll_loss(out, micro)
            micros.append(micro)
            if extra == "micro":
                return loss, {"a": 1.0, **({"d": 2.0} if len(micros) == 2 else {})}
            stats = {"a": 1.0} if self.rank == 0 else {"b": 3.0}
            return loss, {**stats, "c": 0.0} if extra and self.rank == 1 else stats
        return self.backend.train_step(batch, loss_fn)

    @asyncrl.register
    def weights_offloaded(self, weights: dict) -> dict:
        """Weights loaded, and the state dict taken, while the masters are offloaded (as the
        hybrid engine does while generating: DeepSpeed unlinks them from the parameters)."""
        self.backend.offload_masters()
        try:
            self.backend.load_state_dict(weights)
            return self.backend.state_dict()
        finally:
            self.backend.reload_masters()

    @asyncrl.register
    def empty_step(self, batch: TensorBatch) -> tuple[list, dict, list]:
        """A step of no rows: the schedule's position and lr before, the step's result,
        and after."""
        sched, opt = self.backend.sched, self.backend.opt
        before = [sched.last_epoch, opt.param_groups[0]["lr"]]
        stats = self.backend.train_step(batch)
        return before, stats, [sched.last_epoch, opt.param_groups[0]["lr"]]

    @asyncrl.register
    def zero_gradient_step(self, batch: TensorBatch) -> dict:
        """A step whose gradients are all zero: only weight decay moves a weight."""
        def loss_fn(out, micro):
            return out["logprobs"].sum() * 0.0, {}
        return self.backend.train_step(batch, loss_fn)


class OneGroupTrainer(CheckTrainer):
    """A trainer as built before weight decay left norms and biases alone: one AdamW group."""

    def __init__(self, kind: str, *args):
        import importlib

        def one_group(params, cfg):
            return torch.optim.AdamW(list(params), lr=cfg.lr, weight_decay=cfg.weight_decay)
        module = importlib.import_module(f"asyncrl.hybrid.{'fsdp' if kind == 'fsdp2' else 'zero'}")
        module.adamw = one_group  # (this rank's process only)
        super().__init__(kind, *args)


async def _spawn(ctl, kind: str, train: dict, nprocs: int = 1, cls=CheckTrainer, name=None):
    return await ctl.spawn(cls, kind, MODEL, {"micro_batch_size": 8, **train},
                           nprocs=nprocs, name=name or kind)


def test_fsdp2_refuses_a_state_dict_with_keys_missing_or_unknown():
    """torch's full-state-dict load filled a missing key with the current weight: a state
    dict without the final norm loaded "fine", that norm left as it was."""
    async def main():
        async with asyncrl.Controller() as ctl:
            group = await _spawn(ctl, "fsdp2", {})
            weights = (await group.weights())[0]
            del weights["model.norm.weight"]
            with pytest.raises(asyncrl.RemoteError, match=(
                    r"lacks 1 of the model's keys \['model\.norm\.weight'\] and has 0 it does "
                    r"not know \[\]; give every key of this backend's state_dict\(\)")):
                await group.reload(weights)
            weights["model.norm.weight"] = torch.ones(1)
            weights["model.extra"] = torch.ones(1)
            del weights["lm_head.weight"]
            with pytest.raises(asyncrl.RemoteError, match=(
                    r"lacks 1 of the model's keys \['lm_head\.weight'\] and has 1 it does "
                    r"not know \['model\.extra'\]")):
                await group.reload(weights)
            # a tied parameter given by one name (an HF checkpoint of tied embeddings has no
            # lm_head.weight) stands for the other
            tied = await ctl.spawn(CheckTrainer, "fsdp2", {**MODEL, "overrides": {
                "tie_word_embeddings": True}}, {"micro_batch_size": 8}, name="tied")
            own = (await tied.weights())[0]
            given = {k: v + 1 for k, v in own.items() if k != "lm_head.weight"}
            await tied.reload(given)
            back = (await tied.weights())[0]
            assert torch.equal(back["lm_head.weight"], given["model.embed_tokens.weight"])
            return group_pids(group) + group_pids(tied)
    assert_gone(run(main(), timeout=200))


@pytest.mark.parametrize("kind", ["zero2", "zero3"])
def test_bf16_zero_state_dict_holds_the_fp32_masters_it_was_given(kind):
    """With bf16, DeepSpeed's module holds bf16 weights: state_dict() gave them (FSDP2 gives
    its fp32 masters), and load_state_dict() rounded the fp32 masters to them."""
    pytest.importorskip("deepspeed")

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            group = await _spawn(ctl, kind, {"bf16": True})
            weights = (await group.weights())[0]
            seeded = torch.Generator().manual_seed(0)
            given = {k: v.float() + 1e-3 * torch.randn(v.shape, generator=seeded)
                     for k, v in weights.items()}
            await group.reload(given)
            back = (await group.weights())[0]
            offloaded = (await group.weights_offloaded(given))[0]
            step = (await group.step(fixed_batch()))[0]
            return given, back, offloaded, step, group_pids(group)
    given, back, offloaded, step, pids = run(main(), timeout=580)
    assert_gone(pids)
    assert [k for k, v in given.items() if not torch.equal(offloaded[k], v)] == []
    assert any(not torch.equal(v.bfloat16().float(), v) for v in given.values())
    assert [k for k, v in given.items() if not torch.equal(back[k].float(), v)] == []
    assert {k: v.dtype for k, v in back.items()} == {k: torch.float32 for k in given}
    assert step["grad_norm"] > 0


@pytest.mark.parametrize("kind", ["fsdp2", "zero2"])
def test_statistics_with_other_keys_on_other_ranks_are_refused_on_every_rank(kind):
    """The statistics were summed as one vector in each rank's own key order: rank 0's "a"
    was reported as the mean of its "a" and rank 1's "b"; with more keys on one rank, gloo
    failed on the vectors' sizes (NCCL would hang). Refused before any backward: ZeRO, which
    steps inside the last one, had stepped when the check came after it. A key that only a
    later micro-batch has (its mean was of that micro-batch's share alone, 2.0 reported as
    1.0) is refused before the last backward: ZeRO had stepped; it now keeps the first
    micro-batch's gradients and refuses to step on (FSDP2 drops them)."""
    if kind != "fsdp2":
        pytest.importorskip("deepspeed")

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            group = await _spawn(ctl, kind, {"micro_batch_size": 2}, nprocs=2)
            before = (await group.weights())[0]
            errors = []
            for extra in (False, True, "micro"):
                with pytest.raises(asyncrl.RemoteError) as raised:
                    await group.rank_stats_step(fixed_batch(), extra)
                errors.append(str(raised.value))
            unchanged = all(torch.equal(v, before[k])
                            for k, v in (await group.weights())[0].items())
            try:  # the group goes on
                after = await group.step(fixed_batch())
            except asyncrl.RemoteError as e:
                after = str(e)
            return errors, unchanged, after, group_pids(group)
    errors, unchanged, after, pids = run(main(), timeout=400)
    assert unchanged
    assert_gone(pids)
    assert "rank 0: ['a', 'loss'], rank 1: ['b', 'loss']" in errors[0]
    assert "rank 0: ['a', 'loss'], rank 1: ['b', 'c', 'loss']" in errors[1]
    for error in errors[:2]:
        assert "a LossFn's stats must have the same keys on every rank" in error
    assert ("other keys in micro-batch 1 (['a', 'd', 'loss']) than in the first (['a', "
            "'loss']): a LossFn's stats must have the same keys in every micro-batch"
            ) in errors[2]
    if kind == "fsdp2":
        assert len({s["loss"] for s in after}) == 1 and after[0]["grad_norm"] > 0
    else:
        assert "the step before failed after some of its micro-batches' backward" in after


@pytest.mark.parametrize("kind", ["fsdp2", "zero2"])
def test_a_step_without_rows_steps_neither_optimizer_nor_schedule(kind):
    """FSDP2 stepped its optimizer and schedule on an empty batch (the lr warmed up), ZeRO
    neither, reporting the step before's gradient norm: now both return at once."""
    if kind != "fsdp2":
        pytest.importorskip("deepspeed")
    batch = fixed_batch()

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            group = await _spawn(ctl, kind, {"lr": 1e-2, "warmup_steps": 4})
            first = (await group.step(batch))[0]
            weights = (await group.weights())[0]
            empty = (await group.empty_step(batch.slice(0, 0)))[0]
            kept = (await group.weights())[0]
            return first, weights, empty, kept, group_pids(group)
    first, weights, empty, kept, pids = run(main(), timeout=300)
    assert_gone(pids)
    assert first["grad_norm"] > 0
    before, stats, after = empty
    assert before == after == [1, pytest.approx(2.5e-3)]  # warmup's second step, not third
    assert stats == {"grad_norm": 0.0, "lr": pytest.approx(2.5e-3), "grad_nonfinite": 0.0}
    assert all(torch.equal(kept[k], v) for k, v in weights.items())


@pytest.mark.parametrize("kind", ["fsdp2", "zero2"])
def test_weight_decay_leaves_norms_and_biases_alone(kind):
    """One AdamW group decayed every parameter: an RMSNorm's gain drifted toward 0. A step
    with zero gradients moves weights by the decay alone: the matrices shrink, the norms'
    gains stay exactly 1."""
    if kind != "fsdp2":
        pytest.importorskip("deepspeed")

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            group = await _spawn(ctl, kind, {"lr": 1e-2, "weight_decay": 0.1})
            before = (await group.weights())[0]
            await group.zero_gradient_step(fixed_batch())
            decay = await group.weight_decay()
            return before, (await group.weights())[0], decay, group_pids(group)
    before, after, decay, pids = run(main(), timeout=300)
    assert_gone(pids)
    norms = [k for k, v in before.items() if v.ndim == 1]
    assert norms and [k for k in norms if not torch.equal(after[k], torch.ones_like(after[k]))
                      ] == []
    for k, v in before.items():
        if v.ndim >= 2:
            torch.testing.assert_close(after[k], v * (1 - 1e-2 * 0.1), rtol=1e-6, atol=0)
    assert decay == [0.1, 0.0]  # the matrices' group, the others'


@pytest.mark.parametrize("kind", ["fsdp2", "zero2"])
def test_a_checkpoint_of_one_optimizer_group_resumes_on_fsdp2_and_is_named_on_zero(
        kind, tmp_path):
    """A checkpoint saved before weight decay left norms and biases alone holds one AdamW
    group: FSDP2's load failed on a missing key of the second, DeepSpeed's spoke of parameter
    alignment. FSDP2 loads it (the moments per parameter); ZeRO says what it is."""
    if kind != "fsdp2":
        pytest.importorskip("deepspeed")
    batch, train = fixed_batch(), {"lr": 1e-2, "weight_decay": 0.1}

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            old = await _spawn(ctl, kind, train, cls=OneGroupTrainer, name="old")
            new = await _spawn(ctl, kind, train, name="new")
            pids = group_pids(old) + group_pids(new)
            await old.step(batch)
            await old.save(str(tmp_path / "ckpt"))
            if kind != "fsdp2":
                with pytest.raises(asyncrl.RemoteError, match=(
                        r"holds 1 optimizer parameter group\(s\) and this trainer has 2: "
                        r"checkpoints from before weight decay left norms and biases alone .* "
                        r"start a new run from its model \(`asyncrl export`")):
                    await new.load(str(tmp_path / "ckpt"))
                return None, pids
            await new.load(str(tmp_path / "ckpt"))
            for group in (old, new):
                await group.step(batch)
            return [(await g.weights())[0] for g in (old, new)] + [await new.weight_decay()], pids
    out, pids = run(main(), timeout=300)
    assert_gone(pids)
    if out is None:
        return
    old, new, decay = out
    assert decay == [0.1, 0.0]
    for k, v in old.items():  # the matrices stepped alike: the same moments, the same decay
        if v.ndim >= 2:
            torch.testing.assert_close(new[k], v, rtol=1e-6, atol=1e-7)


def test_a_trainer_with_nothing_to_train_is_refused():
    """An optimizer over no parameters stepped nothing, unsaid (torch takes an empty group)."""
    from asyncrl.hybrid.fsdp import TrainConfig
    from asyncrl.hybrid.optim import adamw

    with pytest.raises(ValueError, match="no parameters to train"):
        adamw([], TrainConfig())
    assert len(adamw([torch.nn.Parameter(torch.ones(2, 2))], TrainConfig()).param_groups) == 1
