"""What a training step leaves behind for the next: a checkpoint saved before the first
step, a step that failed midway, bf16 gradients summed over micro-batches by ZeRO, and a
hybrid engine's switch back to training that failed."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch
from helpers import assert_gone, group_pids, run
from test_backends import AnyTrainer
from test_hybrid import fixed_batch

import asyncrl
from asyncrl import TensorBatch
from asyncrl.hybrid.fsdp import nll_loss


class _FailsBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("the backward failed")


def _nan_loss(out, micro):
    loss, stats = nll_loss(out, micro)
    return loss * float("nan"), stats


class StepTrainer(AnyTrainer):
    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def failing_step(self, batch: TensorBatch) -> dict:
        """A step whose loss fails at its second micro-batch (the first's backward done)."""
        seen = []

        def loss_fn(out, micro):
            seen.append(len(micro))
            if len(seen) == 2:
                raise RuntimeError("the loss failed at micro-batch 2")
            return nll_loss(out, micro)
        return self.backend.train_step(batch, loss_fn)

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def failing_backward_step(self, batch: TensorBatch) -> dict:
        """A step of one micro-batch whose backward fails (an OOM there, say)."""
        def loss_fn(out, micro):
            loss, stats = nll_loss(out, micro)
            return _FailsBackward.apply(loss), stats
        return self.backend.train_step(batch, loss_fn)

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def failing_layer_backward_step(self, batch: TensorBatch) -> dict:
        """A step whose backward fails inside the last decoder layer (an OOM there): the
        root's parameters (head, final norm) have their gradients, the layers not yet."""
        from asyncrl.hybrid.fsdp import decoder_layers

        def fail_backward(module, args, out):
            if isinstance(out, tuple):
                return (_FailsBackward.apply(out[0]), *out[1:])
            return _FailsBackward.apply(out)
        hook = decoder_layers(self.backend.model)[-1].register_forward_hook(fail_backward)
        try:
            return self.backend.train_step(batch)
        finally:
            hook.remove()

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def poisoned_step(self, batch: TensorBatch) -> dict:
        return self.backend.train_step(batch, _nan_loss)

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def unchecked_poisoned_step(self, batch: TensorBatch) -> dict:
        """A poisoned step as a DeepSpeed that does not skip it takes it: applied (ZeRO-2's
        bf16 config without check_grad_overflow, ZeRO-3's step without is_invalid_grad_norm:
        this process's, for good)."""
        import deepspeed.runtime.zero.stage3 as stage3

        self.backend._skips_nonfinite = False
        if self.backend.stage == 3:
            stage3.is_invalid_grad_norm = lambda norm: False
        else:
            self.backend.engine.optimizer.check_grad_overflow = False
        return self.backend.train_step(batch, _nan_loss)

    @asyncrl.register
    def check_with_nan_padding(self) -> int:
        """ZeRO-3's last rank's partitions end in padding DeepSpeed never writes: NaN there
        is no NaN weight. How many padding elements this rank has."""
        from asyncrl.hybrid.zero import _real_part

        padding = 0
        for p in self.backend.model.parameters():
            part = p.ds_tensor.data.reshape(-1)
            part[len(_real_part(p)):] = float("nan")
            padding += len(part) - len(_real_part(p))
        self.backend._check_weights_finite()
        return padding

    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def grad_accum_dtype(self) -> str:
        return str(self.backend.engine.optimizer.gradient_accumulation_dtype)


@pytest.mark.parametrize("kind", ["fsdp2", "zero2"])
def test_a_save_before_the_first_step_and_a_failed_step_change_no_later_step(kind, tmp_path):
    """Saving before any step made the optimizer's state by a step at lr 0 (counted: AdamW's
    next update was another), and a step that failed midway left its first micro-batch's
    gradients to be added to the next step's: each trainer must step as one that did
    neither (ZeRO, whose buffers keep them, refuses the next step instead)."""
    if kind != "fsdp2":
        pytest.importorskip("deepspeed")
    batch = fixed_batch()
    model_cfg = {"preset": "tiny-llama", "seed": 0}
    train_cfg = {"lr": 1e-2, "micro_batch_size": 4}

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            plain, saved = await asyncio.gather(*(
                ctl.spawn(StepTrainer, kind, model_cfg, train_cfg, name=name)
                for name in ("plain", "saved")))
            await saved.save(str(tmp_path / "before"))
            await asyncio.gather(plain.step(batch), saved.step(batch))
            after_save = [(await g.weights())[0] for g in (plain, saved)]
            with pytest.raises(asyncrl.RemoteError, match="the loss failed at micro-batch 2"):
                await saved.failing_step(batch)
            if kind != "fsdp2":  # DeepSpeed keeps the first micro-batch's gradients: refused
                with pytest.raises(asyncrl.RemoteError, match="ZeRO train_step refused: the "
                                   "step before failed after some of its micro-batches'"):
                    await saved.step(batch)
                return after_save, None, group_pids(plain) + group_pids(saved)
            # a backward failed inside a layer: FSDP2's post-backward never ran, its state
            # was left mid-iteration (the next backward reduced no gradient) and the root's
            # unsharded parameters kept gradients the optimizer's zero_grad missed
            with pytest.raises(asyncrl.RemoteError, match="the backward failed"):
                await saved.failing_layer_backward_step(batch)
            await asyncio.gather(plain.step(batch), saved.step(batch))
            after_failure = [(await g.weights())[0] for g in (plain, saved)]
            return after_save, after_failure, group_pids(plain) + group_pids(saved)
    after_save, after_failure, pids = run(main(), timeout=240)
    assert_gone(pids)
    for when, (want, got) in (("after the save", after_save), ("after the failure",
                                                                after_failure or after_save)):
        assert all(torch.equal(got[k], v) for k, v in want.items()), (when, [
            k for k, v in want.items() if not torch.equal(got[k], v)][:3])


def test_a_skipped_step_advances_both_backends_schedules_and_a_failed_backward_is_kept():
    """A non-finite gradient skips the step in both backends, bf16 ZeRO-2's too (DeepSpeed
    applied it where its bf16 config's check_grad_overflow is off, or missing: every weight
    NaN for good; a DeepSpeed without the option, or whose ZeRO-3 step does not check the
    norm, has the step refused after it); FSDP2 stepped the schedule and DeepSpeed did not,
    so their warmups drifted apart. And a ZeRO step whose last (here its only) micro-batch's
    backward failed left what it had reduced in DeepSpeed's buffers, for the next step to
    add (only a failure before the last was caught)."""
    pytest.importorskip("deepspeed")
    batch = fixed_batch()
    train_cfg = {"lr": 1e-2, "micro_batch_size": 4, "warmup_steps": 4, "grad_clip": None}
    kinds = {"fsdp2": ("fsdp2", {}), "zero2": ("zero2", {}),
             "zero2-bf16": ("zero2", {"bf16": True}), "zero3-bf16": ("zero3", {"bf16": True})}

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            groups = await asyncio.gather(*(
                ctl.spawn(StepTrainer, kind, {"preset": "tiny-llama", "seed": 0},
                          {**train_cfg, **extra}, name=name, nprocs=1 + 2 * (kind == "zero3"))
                for name, (kind, extra) in kinds.items()))  # (ZeRO-3: 3 ranks, padded)
            pids = [p for g in groups for p in group_pids(g)]
            before = [(await g.weights())[0] for g in groups]
            skipped = [(await g.poisoned_step(batch))[0] for g in groups]
            kept = [(await g.weights())[0] for g in groups]
            after = [(await g.step(batch))[0] for g in groups]
            padding = await groups[3].check_with_nan_padding()
            assert padding[:2] == [0, 0] and padding[2] > 0  # (the last rank's only)
            for group, lacks in zip(groups[2:], ("bf16 config has no check_grad_overflow",
                                                 "ZeRO-3 step checks no gradient norm"),
                                    strict=True):
                with pytest.raises(asyncrl.RemoteError, match=r"DeepSpeed \S+ applied a step "
                                   r"whose gradient was NaN or inf \(its " + lacks):
                    await group.unchecked_poisoned_step(batch)
            with pytest.raises(asyncrl.RemoteError, match="the backward failed"):
                await groups[1].failing_backward_step(batch.take([0, 1, 2, 3]))
            with pytest.raises(asyncrl.RemoteError, match="ZeRO train_step refused"):
                await groups[1].step(batch)
            return before, skipped, kept, after, pids
    before, skipped, kept, after, pids = run(main(), timeout=400)
    assert_gone(pids)
    assert [s["grad_nonfinite"] for s in skipped] == [1.0] * len(kinds)
    assert [s["lr"] for s in skipped] == [0.0] * len(kinds)  # warmup's first step
    assert [s["lr"] for s in after] == [pytest.approx(1e-2 / 4)] * len(kinds)
    for name, want, got in zip(kinds, before, kept, strict=True):  # no step, no NaN weight
        assert all(torch.equal(got[k], v) and v.isfinite().all() for k, v in want.items()), name


@pytest.mark.parametrize("kind", ["zero2", "zero3"])
def test_bf16_zero_sums_micro_batch_gradients_in_fp32(kind):
    """DeepSpeed sums a bf16 model's gradients over micro-batches in bf16 unless told
    otherwise; FSDP2 (and asyncrl's ZeRO) in fp32."""
    pytest.importorskip("deepspeed")

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            group = await ctl.spawn(StepTrainer, kind, {"preset": "tiny-llama", "seed": 0},
                                    {"bf16": True, "micro_batch_size": 4}, name=kind)
            stats = (await group.step(fixed_batch()))[0]  # two micro-batches
            return stats, await group.grad_accum_dtype(), group_pids(group)
    stats, dtype, pids = run(main(), timeout=580)
    assert_gone(pids)
    assert dtype == "torch.float32" and stats["grad_norm"] > 0


@pytest.mark.parametrize(("mesh", "has", "fix"), [
    ({"tp": 2}, "no dp axis", "{'dp': 1, 'tp': 2}"),  # FSDP sharded over the TP ranks
    ({"dp": 1, "sp": 2}, "{'sp': 2}", "{'dp': 2}"),  # two replicas trained the same rows
    ({"data": 4}, "{'data': 4}", "{'dp': 4}"),  # sharded over 4, a DP call saw dp=1: 4x compute
    ({"dp": 2, "tp": 2, "cp": 2}, "{'cp': 2}", "{'dp': 4, 'tp': 2}")])
def test_an_fsdp2_mesh_other_than_dp_and_tp_is_refused_naming_the_fix(mesh, has, fix):
    from types import SimpleNamespace

    from asyncrl.hybrid.fsdp import TrainConfig
    from asyncrl.hybrid.models import ModelConfig
    from asyncrl.hybrid.roles import make_backend

    worker = SimpleNamespace(mesh=mesh, device_mesh=SimpleNamespace(
        mesh_dim_names=tuple(mesh), shape=tuple(mesh.values())))
    with pytest.raises(ValueError, match=re.escape(
            f"backend='fsdp2' shards over a 'dp' axis and splits layers over a 'tp' one, no "
            f"other; the group's mesh {mesh} has {has}: spawn with mesh={fix}")):
        make_backend(worker, "fsdp2", ModelConfig(), TrainConfig())


def test_a_bf16_model_trained_by_fsdp2_without_fp32_masters_is_said():
    """FSDP2 steps a bf16 model's weights and AdamW's state in bf16 (DeepSpeed keeps fp32
    masters for the same config), losing small updates, and nothing said so."""
    from asyncrl.hybrid.fsdp import TrainConfig, masters_warning, trainable
    from asyncrl.hybrid.models import ModelConfig

    bf16 = trainable(ModelConfig(dtype="bfloat16"), TrainConfig(), "lm")
    assert masters_warning(bf16) is not None
    assert "bfloat16 parameters as they are" in masters_warning(bf16)
    assert "dtype='float32' and TrainConfig(bf16=True)" in masters_warning(bf16)
    assert masters_warning(trainable(ModelConfig(), TrainConfig(), "lm")) is None
    lora = ModelConfig(dtype="bfloat16", lora={"rank": 4, "target_modules": ["q_proj"]})
    assert masters_warning(trainable(lora, TrainConfig(), "lm")) is None  # fp32 adapters


def test_train_settings_refuse_backwards_training_and_name_misspelt_keys():
    """A negative grad_clip scaled every gradient by a negative factor (gradient ascent,
    without a word); a misspelt key was Python's bare TypeError."""

    import numpy as np

    from asyncrl.hybrid.fsdp import TrainConfig
    from asyncrl.hybrid.settings import from_dict
    from asyncrl.rl.config import RLConfig

    with pytest.raises(ValueError, match="grad_clip is the largest gradient norm kept"):
        TrainConfig(grad_clip=-1.0)
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        TrainConfig(weight_decay=-0.1)
    assert TrainConfig(grad_clip=0).grad_clip == 0  # no clipping
    assert TrainConfig(grad_clip=None, lr=np.float32(1e-3), micro_batch_size=np.int64(2))
    # a NaN learning rate or clip made every weight NaN at the first step; "no" turned
    # mixed precision on; 2.5 micro-batches failed deep in torch
    for bad, said in (({"lr": float("nan")}, "lr must be a finite number, got nan"),
                      ({"grad_clip": float("inf")}, "grad_clip must be a finite number (or "
                                                    "None), got inf"),
                      ({"bf16": "no"}, "bf16 must be True or False (or None), got 'no'"),
                      ({"micro_batch_size": 2.5}, "micro_batch_size must be a whole number")):
        with pytest.raises(ValueError, match=re.escape(f"TrainConfig.{said}")):
            TrainConfig(**bad)
    with pytest.raises(TypeError, match=r"Actor rl=: 'value_clp' \(did you mean 'value_clip'\?\) "
                                        r"is not a setting; the settings are \[.*'value_clip'"):
        from_dict(RLConfig, {"value_clp": 0.3}, "Actor rl=")
    assert from_dict(TrainConfig, {"lr": 0.5}, "train=").lr == 0.5
    # a config object where the dict goes failed with "'TrainConfig' object is not iterable"
    with pytest.raises(TypeError, match=r"train= takes a dict of TrainConfig's settings .* "
                                        r"got a TrainConfig; pass the dict, or "
                                        r"dataclasses.asdict\(\) of it"):
        from_dict(TrainConfig, TrainConfig(), "train=")


def test_a_switch_back_to_training_that_failed_is_finished_by_the_next():
    """The flag saying the optimizer's state and masters were offloaded was cleared before
    they came back: a failure there (an OOM in a fragmented GPU) left the next to_train to
    return at once, training with its AdamW state on the host."""
    from types import SimpleNamespace

    from asyncrl.hybrid.engine import HybridEngine
    from asyncrl.hybrid.models import ModelConfig, build_model

    model = build_model(ModelConfig())
    opt = torch.optim.AdamW(model.parameters())
    reloads = []

    def reload_masters():
        reloads.append(1)
        if len(reloads) == 1:
            raise RuntimeError("CUDA out of memory")
    backend = SimpleNamespace(model=model, opt=opt, offload_masters=lambda: 0,
                              reload_masters=reload_masters)
    hybrid = HybridEngine(backend, ModelConfig())
    hybrid.to_generate()
    with pytest.raises(RuntimeError, match="out of memory"):
        hybrid.to_train()
    hybrid.to_train()
    assert len(reloads) == 2 and hybrid.mode == "train"
