"""The training backends on CPU: FSDP2 (dp, and dp x tp), DeepSpeed ZeRO-2/3, their
agreement, micro-batches, gradient checkpointing, schedules and bf16."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from helpers import assert_gone, group_pids, run
from test_hybrid import fixed_batch

import asyncrl
from asyncrl import TensorBatch
from asyncrl.hybrid.fsdp import FSDPBackend, TrainConfig, real_row_mean, sequence_mean_nll
from asyncrl.hybrid.models import ModelConfig, build_model, sequence_logprobs
from asyncrl.hybrid.roles import make_backend


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


    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def summed_nll_step(self, batch: TensorBatch) -> dict:  # a custom loss's exact mean
        return self.backend.train_step(batch, lambda out, micro: (
            real_row_mean(_summed_nll(out["logprobs"], micro), micro), {}))

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def plain_summed_nll_step(self, batch: TensorBatch) -> dict:  # its mean over the real rows
        return self.backend.train_step(batch, lambda out, micro: (
            _summed_nll(out["logprobs"], micro)[:micro.real_rows].mean(), {}))


def _summed_nll(logprobs: torch.Tensor, batch: TensorBatch) -> torch.Tensor:
    """A custom loss's per-row values: each row's summed response NLL, times its weight."""
    mask = batch.tensor("response_mask").to(logprobs.dtype)
    return -(logprobs * mask).sum(1) * batch.tensor("weight")


def one_process_steps(ref: torch.nn.Module, batches: list[TensorBatch], loss_fn: Any,
                      lr: float) -> list[float]:
    """The steps a trainer takes (AdamW, no weight decay, gradients clipped to 1), here in
    this process, unsharded, one per whole batch; `loss_fn(logprobs, batch)`. Their losses."""
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for b in batches:
        cols = [b[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
        loss = loss_fn(sequence_logprobs(ref, *cols), b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"dp": 1, "tp": 2}], ids=["dp2", "dp1-tp2"])
def test_fsdp2_steps_match_one_process_on_the_whole_batch(mesh):
    batch = fixed_batch()
    model_cfg, train_cfg = {"preset": "tiny-llama", "seed": 0}, {"lr": 3e-3, "micro_batch_size": 2}

    # the same three steps in this process, unsharded, on the whole batch
    ref = build_model(ModelConfig(**model_cfg)).train()
    expected = one_process_steps(ref, [batch] * 3, sequence_mean_nll, 3e-3)

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


def test_a_custom_loss_meaned_by_real_row_mean_matches_one_process_on_the_whole_batch():
    """A LossFn's loss is weighted by its micro-batch's share of the rank's rows, the ranks
    averaged: with 7 rows on 2 ranks (rank 1's last micro-batch holds one real row and a
    padding row), a plain mean over a micro-batch's real rows gave that row 1/4 of the
    step, not 1/7; taken by `real_row_mean`, a custom per-row mean is the whole batch's
    (here a weighted NLL, whose rows' weights make the difference plain)."""
    batch = fixed_batch().slice(0, 7).union(TensorBatch({"weight": torch.arange(1.0, 8.0)}))
    model_cfg, train_cfg = {"preset": "tiny-llama", "seed": 0}, {"lr": 3e-3, "micro_batch_size": 2}
    ref = build_model(ModelConfig(**model_cfg)).train()
    expected = one_process_steps(ref, [batch] * 2, lambda lp, b: _summed_nll(lp, b).mean(), 3e-3)

    async def main():
        async with asyncrl.Controller() as ctl:
            exact, plain = await asyncio.gather(*(
                ctl.spawn(Trainer, model_cfg, train_cfg, nprocs=2, mesh={"dp": 2}, name=name)
                for name in ("exact", "plain")))
            losses = [(await exact.summed_nll_step(batch))[0]["loss"] for _ in range(2)]
            plain_loss = (await plain.plain_summed_nll_step(batch))[0]["loss"]
            return losses, (await exact.weights())[0], plain_loss, [
                *group_pids(exact), *group_pids(plain)]
    losses, weights, plain_loss, pids = run(main(), timeout=300)
    assert_gone(pids)
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (losses, expected)
    ref_sd = ref.state_dict()
    assert max((weights[k] - ref_sd[k]).abs().max().item() for k in ref_sd) < 1e-4
    assert abs(plain_loss - expected[0]) > 1e-2 * abs(expected[0])  # what the layout did


def test_tp_trains_per_head_norms_as_one_weight_and_refuses_weights_it_cannot_split(
        tmp_path):
    """Qwen3's q_norm/k_norm (over head_dim, after the heads are split) were left out of the
    tp plan: each tp rank trained its own copy on its own heads, and the copies drifted
    apart (0.05 after 3 steps). They are one weight now, its gradient summed over tp; a
    weight tp does not know how to split (OLMo2's full-width norms) is refused."""
    from transformers import AutoModelForCausalLM, Olmo2Config, Qwen3Config

    from asyncrl.hybrid.fsdp import apply_tp

    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    qwen = AutoModelForCausalLM.from_config(Qwen3Config(head_dim=16, **shape))
    with torch.no_grad():  # norms that are not all ones
        for layer in qwen.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    qwen.save_pretrained(tmp_path / "qwen3")
    olmo = AutoModelForCausalLM.from_config(Olmo2Config(**shape))
    with pytest.raises(ValueError, match=r"cannot split Olmo2ForCausalLM's 'self_attn\.q_norm"
                                         r"\.weight'.*tp=1"):
        apply_tp(olmo, type("Mesh", (), {"size": lambda self: 2})())

    batch, model_cfg = fixed_batch(), {"path": str(tmp_path / "qwen3")}
    ref = build_model(ModelConfig(**model_cfg)).train()
    one_process_steps(ref, [batch] * 3, sequence_mean_nll, 1e-2)

    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(Trainer, model_cfg, {"lr": 1e-2, "micro_batch_size": 8},
                                    nprocs=2, mesh={"dp": 1, "tp": 2})
            for _ in range(3):
                await group.step(batch)
            return await group.weights()
    ranks = run(main(), timeout=300)
    ref_sd = ref.state_dict()
    for name in ("model.layers.0.self_attn.q_norm.weight",
                 "model.layers.1.self_attn.k_norm.weight"):
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    for weights in ranks:
        assert max((weights[k] - ref_sd[k]).abs().max().item() for k in ref_sd) < 1e-3


class AnyTrainer(asyncrl.Worker):
    """FSDP2 or ZeRO-2/3 behind one interface."""

    def __init__(self, kind: str, model_cfg: dict, train_cfg: dict):
        self.backend = make_backend(self, kind, ModelConfig(**model_cfg), TrainConfig(**train_cfg))
        from asyncrl.hybrid.fsdp import decoder_layers

        self.mlp_runs = 0  # the layers' MLPs started: twice per forward when recomputed
        for layer in decoder_layers(self.backend.model):
            layer.mlp.register_forward_pre_hook(self._count)

    def _count(self, *_) -> None:
        self.mlp_runs += 1

    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def runs(self) -> int:
        return self.mlp_runs

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def step(self, batch: TensorBatch) -> dict:
        return self.backend.train_step(batch)

    @asyncrl.register
    def weights(self) -> dict:
        return self.backend.state_dict()

    @asyncrl.register(dispatch=asyncrl.Dispatch.DP)
    def logprobs(self, batch: TensorBatch) -> tuple[torch.Tensor, bool]:
        return self.backend.logprobs(batch), self.backend.model.training

    @asyncrl.register
    def weights_gathered(self) -> tuple[dict, dict, int]:
        """state_dict(); torch's full state dict; the most all-gathered tensors alive at once
        while state_dict() ran (each a whole parameter, on the GPU there)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode

        alive: list[StorageWeakRef] = []
        most = 0

        class Gathers(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                nonlocal most
                out = func(*args, **(kwargs or {}))
                if "all_gather" in str(func):
                    alive[:] = [*(r for r in alive if not r.expired()),
                                StorageWeakRef(out.untyped_storage())]
                    most = max(most, len(alive))
                return out

        with Gathers():
            ours = self.backend.state_dict()
        theirs = get_model_state_dict(self.backend.model,
                                      options=StateDictOptions(full_state_dict=True))
        return ours, {k: v.detach().cpu() for k, v in theirs.items()}, most

    @asyncrl.register
    def reload(self, weights: dict) -> bool:
        self.backend.load_state_dict(weights)
        return True

    @asyncrl.register(dispatch=asyncrl.Dispatch.RANK_ZERO)
    def weight_decay(self) -> list[float]:
        return [group["weight_decay"] for group in self.backend.opt.param_groups]

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


@pytest.mark.parametrize("kind", ["fsdp2", "zero2"])
def test_trainer_log_probs_are_taken_in_eval_mode_with_dropout_turned_back_on(kind):
    """An override may turn dropout back on (to train with it); the trainer's log-probs (the
    old policy's, the reference's, a critic's values) were taken in train mode all the same:
    each call's its own, not the engine's or the reference's (eval mode). MoE router jitter
    and expert sampling alike. The model goes back to train mode after."""
    from asyncrl.hybrid.models import sampled_at

    if kind != "fsdp2":
        pytest.importorskip("deepspeed")
    batch = fixed_batch()
    model_cfg = {"preset": "tiny-gpt2", "seed": 0,
                 "overrides": {"attn_pdrop": 0.5, "resid_pdrop": 0.5, "embd_pdrop": 0.5}}

    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(AnyTrainer, kind, model_cfg, {}, nprocs=2)
            pids = group_pids(group)
            return await group.logprobs(batch), await group.logprobs(batch), pids
    first, second, pids = run(main(), timeout=280)
    assert_gone(pids)
    assert all(training for _, training in first + second)
    first_lp, second_lp = (torch.cat([lp for lp, _ in calls]) for calls in (first, second))
    cols = [batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    with torch.no_grad():
        want = sequence_logprobs(build_model(ModelConfig(**model_cfg)).eval(), *cols,
                                 temperature=sampled_at(batch))
    assert torch.equal(first_lp, second_lp)
    assert (first_lp - want).abs().max().item() < 1e-5


@pytest.mark.parametrize(("preset", "mesh"), [("tiny-gpt2", {"dp": 2}),
                                              ("tiny-llama", {"dp": 1, "tp": 2})],
                         ids=["gpt2-tied-dp2", "llama-dp1-tp2"])
def test_fsdp2_state_dict_is_torchs_gathered_one_parameter_at_a_time(preset, mesh):
    """torch's full state dict gathered every parameter whole and kept them all on the
    device until the dict was built: on every rank the model beside its shards (56 GB more
    for 14B in fp32). Each one is on the CPU now before the next is gathered, on every
    rank; the dict is torch's, tied weights under each name."""
    async def main():
        async with asyncrl.Controller() as ctl:
            group = await ctl.spawn(AnyTrainer, "fsdp2", {"preset": preset, "seed": 0}, {},
                                    nprocs=2, mesh=mesh)
            return await group.weights_gathered(), group_pids(group)
    ranks, pids = run(main(), timeout=280)
    assert_gone(pids)
    for ours, theirs, most in ranks:
        # (one, and the last a moment longer: a gloo thread may still hold it)
        assert list(ours) == list(theirs) and most <= 3, (most, list(ours))
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    if preset == "tiny-gpt2":
        assert {"lm_head.weight", "transformer.wte.weight"} <= set(ranks[0][0])


@pytest.mark.parametrize("head", ["lm", "value"])
def test_gradient_checkpointing_recomputes_each_layer_for_the_same_gradients(head):
    """With `gradient_checkpointing`, every decoder layer runs again in the backward (its
    activations were not kept), and the outputs and gradients are those without it."""
    from asyncrl.hybrid.fsdp import decoder_layers, trainable
    from asyncrl.hybrid.models import sequence_values

    batch = fixed_batch()
    cols = [batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    runs = {}
    for on in (False, True):
        model = trainable(ModelConfig(seed=0), TrainConfig(gradient_checkpointing=on), head)
        if head == "value":  # a zero head passes no gradient to the backbone
            seeded = torch.Generator().manual_seed(1)
            torch.nn.init.normal_(model.value_head.weight, generator=seeded)
        # the layers' MLPs starting (a layer's own hooks stay outside its checkpoint, and a
        # recomputation stops once it has the last activation the backward needs)
        calls = []
        for layer in decoder_layers(model):
            layer.mlp.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        out = (sequence_logprobs if head == "lm" else sequence_values)(model, *cols)
        forward_calls = len(calls)
        out.sum().backward()
        runs[on] = (forward_calls, len(calls), out.detach(),
                    {n: p.grad for n, p in model.named_parameters()})
    layers = len(decoder_layers(model))
    assert runs[False][:2] == (layers, layers) and runs[True][:2] == (layers, 2 * layers)
    assert torch.equal(runs[True][2], runs[False][2])
    assert all(torch.equal(g, runs[False][3][n]) for n, g in runs[True][3].items())


def test_fsdp2_and_zero2_zero3_losses_agree_for_five_steps():
    """Five steps of batches of 8, 4, 8, 6 and 8 rows (2, 1, 2, 2 and 2 micro-batches per
    rank: DeepSpeed must step at each step's last micro-batch, whatever the last count),
    under one learning-rate schedule (warmup, then cosine: each backend steps it once per
    optimizer step). FSDP2 and ZeRO-3 again, recomputing their layers' activations
    (gradient_checkpointing): every layer runs again in each backward, with its shards
    gathered for it."""
    pytest.importorskip("deepspeed")
    from asyncrl.hybrid.optim import lr_factor

    batch = fixed_batch()
    sizes = [8, 4, 8, 6, 8]
    model_cfg = {"preset": "tiny-llama", "seed": 0}
    train_cfg = {"lr": 3e-3, "micro_batch_size": 2, "warmup_steps": 2, "schedule": "cosine",
                 "total_steps": 6, "min_lr_ratio": 0.1}

    async def main():
        async with asyncrl.Controller() as ctl:
            losses, lrs, runs, pids = {}, {}, {}, []
            for name in ("fsdp2", "fsdp2_ckpt", "zero2", "zero3", "zero3_ckpt"):
                kind, ckpt = name.removesuffix("_ckpt"), name.endswith("_ckpt")
                group = await ctl.spawn(AnyTrainer, kind, model_cfg,
                                        {**train_cfg, "gradient_checkpointing": ckpt},
                                        nprocs=2, name=name)
                pids += group_pids(group)
                steps = [(await group.step(batch.slice(0, n)))[0] for n in sizes]
                losses[name], lrs[name] = [s["loss"] for s in steps], [s["lr"] for s in steps]
                runs[name] = await group.runs()
                if name == "zero3":  # state dict out and in: the next step starts from it
                    w = (await group.weights())[0]
                    assert all(await group.reload(w))
                    assert all(torch.equal(w[k], v) for k, v in (await group.weights())[0].items())
                await ctl.close_group(group)
            return losses, lrs, runs, pids
    losses, lrs, runs, pids = run(main(), timeout=280)
    assert_gone(pids)
    # 9 micro-batches on rank 0 through 2 layers; recomputed in each backward when asked
    assert runs == {"fsdp2": 18, "fsdp2_ckpt": 36, "zero2": 18, "zero3": 18, "zero3_ckpt": 36}
    assert losses["fsdp2_ckpt"] == pytest.approx(losses["fsdp2"], rel=1e-6)
    for kind in ("zero2", "zero3", "zero3_ckpt"):
        for got, want in zip(losses[kind], losses["fsdp2"], strict=True):
            assert abs(got - want) <= 1e-4 * abs(want), (kind, losses)
    assert losses["fsdp2"][-1] < losses["fsdp2"][0]
    want = [3e-3 * lr_factor(TrainConfig(**train_cfg), i) for i in range(5)]
    assert want[:3] == [0.0, 1.5e-3, 3e-3] and 3e-4 < want[4] < want[3] < 3e-3
    for kind in lrs:
        assert lrs[kind] == pytest.approx(want, abs=1e-12), (kind, lrs)


def test_lr_schedules_and_their_config_errors():
    from asyncrl.hybrid.optim import lr_factor

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
    from asyncrl.hybrid.optim import lr_factor

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
                # a resumed run with another lr (and weight decay): the config's win, on both
                # backends (the optimizer's state dict brought the saved weight decay back)
                ctl.spawn(AnyTrainer, kind, model_cfg, {**train_cfg, "lr": 2e-3,
                                                        "weight_decay": 0.1}, name="other"))
            before = [(await first.step(batch))[0]["lr"] for _ in range(3)]
            # a folder whose name globs (DeepSpeed globs its path unescaped: it found nothing)
            await first.save(str(tmp_path / "ckpt[1]"))
            await again.load(str(tmp_path / "ckpt[1]"))
            after = [(await again.step(batch))[0]["lr"] for _ in range(2)]
            await other.load(str(tmp_path / "ckpt[1]"))
            changed = (await other.step(batch))[0]["lr"]
            decay = await other.weight_decay()
            pids = group_pids(first) + group_pids(again) + group_pids(other)
            # a checkpoint from before schedules: resumed at its optimizer step count
            await first.save_as_before_schedules(str(tmp_path / "old"))
            await other.load(str(tmp_path / "old"))
            old = (await other.step(batch))[0]["lr"]
            return before, after, changed, old, pids, decay
    before, after, changed, old, pids, decay = run(main(), timeout=280)
    assert_gone(pids)
    assert decay == [0.1, 0.0]  # (norms and biases: none)
    cfg = TrainConfig(**train_cfg)
    assert before + after == pytest.approx([1e-3 * lr_factor(cfg, i) for i in range(5)])
    assert after == pytest.approx([7.5e-4, 1e-3])  # the 4th and 5th steps, not a new warmup
    assert changed == pytest.approx(1.5e-3)  # step 4 of 2e-3's warmup
    assert old == pytest.approx(1.5e-3)


def test_fsdp2_bf16_computes_in_bf16_and_stays_close_to_fp32():
    batch = fixed_batch()
    model_cfg = {"preset": "tiny-llama", "seed": 0}

    async def main():
        async with asyncrl.Controller() as ctl:
            out, pids = {}, []
            groups = await asyncio.gather(*(  # started together: quicker
                ctl.spawn(Trainer, model_cfg, {"lr": 3e-3, "micro_batch_size": 4, "bf16": bf16},
                          nprocs=2, name=f"bf16-{bf16}") for bf16 in (False, True)))
            for bf16, group in zip((False, True), groups, strict=True):
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
