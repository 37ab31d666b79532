"""Training with PyTorch FSDP2 (`fully_shard`): gloo on CPU, NCCL on GPU.

Parallelisms are applied in order by small functions, as torchtitan does:
`apply_fsdp(model, dp_mesh)` shards each decoder layer, then the root. The backend's
interface (the one DeepSpeed shares): `logprobs(batch)` / `values(batch)`,
`train_step(batch, loss_fn)`, `state_dict()` / `load_state_dict()`, `save(folder)` /
`load(folder)` (weights and optimizer, for checkpoints).

A backend trains a causal LM (head "lm": forward gives token log-probs and entropies) or a
value model (head "value": critics, reward models; forward gives one value per token).

A batch is a TensorBatch with prompt_ids, prompt_mask (left-padded), response_ids and
response_mask (a prefix of each row), as the generation engines produce.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.comm.batch import TensorBatch
from asyncrl.hybrid.ckpt_kind import check_written_by
from asyncrl.hybrid.lora import adapter_modules, is_adapter, legacy_adapter_names
from asyncrl.hybrid.micro import in_batch_order, micro_batches
from asyncrl.hybrid.models import (
    ModelConfig,
    ValueModel,
    build_model,
    build_value_model,
    sampled_at,
    sequence_logprobs,
    sequence_values,
)
from asyncrl.hybrid.optim import (
    adamw,
    agree_keys,
    clip_grad_norm,
    lr_scheduler,
    rank_means,
    resume_schedule,
)
from asyncrl.hybrid.settings import check_kinds
from asyncrl.hybrid.turns import sampled_mask

# (forward outputs of a micro-batch, the micro-batch) -> (loss, scalar stats to report). The
# loss is weighted by the micro-batch's share of the rank's rows, the ranks averaged: a plain
# mean counts a DP chunk's padding rows and weighs rows of unequal ranks unequally (per row:
# `real_row_mean` is exact; per token: count the tokens of every rank, as asyncrl.rl's share)
LossFn = Callable[[dict[str, torch.Tensor], TensorBatch], tuple[torch.Tensor, dict[str, float]]]

log = logging.getLogger("asyncrl")


@dataclass(kw_only=True)
class TrainConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    micro_batch_size: int = 4
    # micro-batches by tokens instead (verl's use_dynamic_bsz, ppo_max_token_len_per_gpu):
    # rows sorted by length and cut so that rows x used columns stays within this many tokens
    # (a longer sequence alone); micro_batch_size is then unused
    max_tokens_per_micro_batch: int | None = None
    grad_clip: float | None = 1.0  # None or 0: no clipping
    bf16: bool | None = None  # compute in bf16 (weights and reductions in fp32); None: on
    # the GPUs that support it, off on CPU (where bf16 matmuls are slow)
    # the learning rate over optimizer steps: `warmup_steps` of linear warmup, then constant,
    # or a cosine or linear decay to min_lr_ratio * lr at `total_steps`
    warmup_steps: int = 0
    schedule: str = "constant"  # "constant", "cosine" or "linear"
    total_steps: int = 0  # optimizer steps of the whole run (needed by cosine and linear)
    min_lr_ratio: float = 0.0
    # recompute each decoder layer's activations in the backward instead of keeping them:
    # far less memory for long sequences, about a third more compute (verl's
    # enable_gradient_checkpointing)
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        check_kinds(self, "TrainConfig")
        if self.micro_batch_size < 1:
            raise ValueError(f"TrainConfig.micro_batch_size must be >= 1, got "
                             f"{self.micro_batch_size}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"TrainConfig.max_tokens_per_micro_batch must be >= 1 or None, got "
                             f"{self.max_tokens_per_micro_batch}")
        if self.lr < 0:  # 0 is allowed: a run that must not learn (a baseline)
            raise ValueError(f"TrainConfig.lr must be >= 0, got {self.lr}")
        if self.grad_clip is not None and self.grad_clip < 0:  # a negative norm would
            # scale every gradient by a negative factor: gradient ascent, without a word
            raise ValueError(f"TrainConfig.grad_clip is the largest gradient norm kept (> 0), "
                             f"or 0 for no clipping; got {self.grad_clip}")
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0 (AdamW's decoupled "
                             f"decay; 0: none), got {self.weight_decay}")
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"TrainConfig.schedule is 'constant', 'cosine' or 'linear', got "
                             f"{self.schedule!r}")
        if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig: warmup_steps must be >= 0 and min_lr_ratio in "
                             f"[0, 1], got {self.warmup_steps} and {self.min_lr_ratio}")
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"TrainConfig.schedule={self.schedule!r} decays until total_steps, "
                             f"which must exceed warmup_steps ({self.warmup_steps}); got "
                             f"total_steps={self.total_steps} (the run's optimizer steps: "
                             f"steps x epochs x mini_batches)")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a HF causal LM (Llama-style `model.layers`, GPT-2 `h`)."""
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    layers = getattr(inner, "layers", None) or getattr(inner, "h", None)
    if layers is None:
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")
    return list(layers)


def apply_tp(model: torch.nn.Module, tp_mesh: Any) -> None:
    """Megatron-style tensor parallelism inside each decoder layer (Llama-style models):
    q/k/v and gate/up split by output columns, o and down by input rows. Embeddings and the
    head stay replicated. Attention reshapes with -1 heads, so each rank runs its heads.
    Per-head norms (Qwen3's q_norm/k_norm) see each rank's heads: their weights replicated
    over tp, gradients summed over it (as a norm over a sharded sequence dimension: the
    heads' dimension). Any other weight inside attention or the MLP is refused: left out
    of the plan, each tp rank would train its own copy of it on its own heads."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    for layer in decoder_layers(model):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or not hasattr(attn, "q_proj") or not hasattr(mlp, "gate_proj"):
            raise TypeError(f"tensor parallelism needs a Llama-style model (q/k/v/o_proj, "
                            f"gate/up/down_proj); {type(model).__name__} is not one")
        config: Any = model.config  # type: ignore[union-attr]
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", heads)
        if heads % tp_mesh.size() or kv % tp_mesh.size():
            raise ValueError(f"tp={tp_mesh.size()} must divide the attention heads ({heads}) "
                             f"and the key/value heads ({kv})")
        plan: dict[str, Any] = {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        for norm in ("q_norm", "k_norm"):
            weight = getattr(getattr(attn, norm, None), "weight", None)
            if weight is not None and weight.numel() == head_dim:  # (heads, head_dim) in
                plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2,
                                                             use_local_output=True)
        _check_planned(model, layer, plan)
        parallelize_module(layer, tp_mesh, plan)


def _check_planned(model: torch.nn.Module, layer: torch.nn.Module, plan: dict[str, Any]
                   ) -> None:
    for name, _ in layer.named_parameters():
        part, _, rest = name.partition(".")
        if part in ("self_attn", "mlp") and f"{part}.{rest.split('.')[0]}" not in plan:
            raise ValueError(
                f"tensor parallelism cannot split {type(model).__name__}'s {name!r} (only "
                f"q/k/v/o_proj, gate/up/down_proj and per-head q_norm/k_norm): each tp rank "
                f"would train its own copy of it; train this model with tp=1")


def use_bf16(cfg: TrainConfig) -> bool:
    if cfg.bf16 is not None:
        return cfg.bf16
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def apply_fsdp(model: torch.nn.Module, dp_mesh: Any, bf16: bool = False) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        _shard_adapters_apart(layer, dp_mesh, bf16)
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
    _shard_adapters_apart(model, dp_mesh, bf16)  # any outside the decoder layers
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def _shard_adapters_apart(module: torch.nn.Module, dp_mesh: Any, bf16: bool) -> None:
    """LoRA's factors inside `module` as a unit of their own (one for all of them: one
    gather) where they are fp32 beside bf16 weights (FSDP2 wants one dtype per unit) or
    the layers compute in bf16: the adapters compute in fp32 all the same, as the engine's
    fp32 adapters do beside its bf16 weights (and peft's)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    factors: list[torch.nn.Module] = [m for m in adapter_modules(module)
                                      if not isinstance(m, FSDPModule)]
    theirs = {p.dtype for m in factors for p in m.parameters()}
    others = {p.dtype for n, p in module.named_parameters() if not is_adapter(n)}
    if factors and (bf16 or others - theirs):
        fully_shard(factors, mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(
            reduce_dtype=torch.float32 if bf16 else None))


ALL_ROWS = "all_rows"  # meta: (real rows of every dp rank, this rank's rows, dp ranks)


def count_rows(batch: TensorBatch, group: Any) -> TensorBatch:
    """Mark a rank's batch with the real rows of every data-parallel rank (one all-reduce),
    so that `real_row_mean` is the mean over all of them however they are split."""
    t = torch.tensor([float(batch.real_rows)], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    batch.meta[ALL_ROWS] = (float(t[0]), len(batch), dist.get_world_size(group))
    return batch


def real_row_mean(values: torch.Tensor, batch: TensorBatch) -> torch.Tensor:
    """The mean of `values` (one a row) over the real rows, not a DP chunk's padding rows.
    On a micro-batch of a counted batch (`count_rows`: a train step's), the part of the
    mean over every rank's real rows that the backend's weighting (rows of the micro-batch /
    rows of the rank, averaged over the ranks) turns into that mean: exact when chunks or
    micro-batches hold unequal real rows (a custom LossFn's per-row means too)."""
    real = batch.real_rows
    mean = values[:real].sum() / max(real, 1)
    if ALL_ROWS not in batch.meta:
        return mean
    total, rows, dp = batch.meta[ALL_ROWS]
    return mean * (dp * rows * real / (max(total, 1.0) * len(batch)))


def sequence_mean_nll(logprobs: torch.Tensor, batch: TensorBatch) -> torch.Tensor:
    """`real_row_mean` of each row's mean NLL of its sampled tokens (observations left out)."""
    mask = sampled_mask(batch).to(logprobs.dtype)
    return real_row_mean(-(logprobs * mask).sum(1) / mask.sum(1).clamp(min=1), batch)


def nll_loss(out: dict[str, torch.Tensor], batch: TensorBatch
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """The default loss (supervised fine-tuning on the responses)."""
    return sequence_mean_nll(out["logprobs"], batch), {}


def _columns(b: TensorBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (b.tensor("prompt_ids"), b.tensor("prompt_mask"), b.tensor("response_ids"),
            b.tensor("response_mask"))


HEADS = {"lm": build_model, "value": build_value_model}


def trainable(model_cfg: ModelConfig, train_cfg: TrainConfig, head: str) -> torch.nn.Module:
    """The model a backend trains, in train mode, its layers checkpointed if asked: the
    non-reentrant kind, whose recomputation runs the layer's hooks again (FSDP2 and ZeRO-3
    gather its parameters for it as for the forward)."""
    model = HEADS[check_head(head)](model_cfg).train()
    if train_cfg.gradient_checkpointing:
        lm: Any = model.model if isinstance(model, ValueModel) else model  # the HF model
        kwargs = {"use_reentrant": False}
        if hasattr(lm, "activation_checkpointing_enable"):  # newer transformers: the old warns
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def trained_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every parameter, or a LoRA model's adapters (and a value
    model's head) alone."""
    return [p for p in model.parameters() if p.requires_grad]


def masters_warning(model: torch.nn.Module) -> str | None:
    """What FSDP2 would train without an fp32 copy (it steps the parameters in their own
    dtype, where DeepSpeed keeps fp32 masters): a bf16 or fp16 model's, not LoRA's
    adapters (fp32 already)."""
    low = sorted({str(p.dtype).removeprefix("torch.") for p in trained_parameters(model)
                  if p.dtype in (torch.bfloat16, torch.float16)})
    if not low:
        return None
    return (f"asyncrl: FSDP2 trains this model's {'/'.join(low)} parameters as they are, "
            f"with AdamW's state in {'/'.join(low)} and no fp32 master copy: updates below "
            f"the weights' precision are lost. For mixed precision (bf16 compute, fp32 "
            f"weights, as verl trains), give the trainer's ModelConfig dtype='float32' and "
            f"TrainConfig(bf16=True)")


def check_head(head: str) -> str:
    if head not in HEADS:
        raise ValueError(f"head is 'lm' (a causal LM) or 'value' (a scalar head: critics, "
                         f"reward models), got {head!r}")
    return head


class TrainBackend:
    """What FSDP2 and ZeRO share: forward passes of a batch, micro-batch by micro-batch,
    through `forward_module` (the wrapped model whose forward runs the sharding hooks), and
    the accumulation of a step's loss and statistics."""

    cfg: TrainConfig
    head: str
    forward_module: torch.nn.Module
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    stats_group: Any = None  # the group a step's statistics are averaged over (None: world)
    loads = 0  # times weights were loaded (load, load_state_dict): frozen ones may have changed

    def offload_masters(self) -> int:
        """What training alone needs besides the weights and the torch optimizer's state,
        to host memory while the hybrid engine generates; the bytes moved. FSDP2 has none:
        its parameters are its fp32 masters, and generation gathers them."""
        return 0

    def reload_masters(self) -> None:
        """`offload_masters()`'s tensors back where training uses them."""

    def _on_device(self, b: TensorBatch) -> TensorBatch:
        """The batch's tensors on the model's device: batches arrive on the CPU (rollouts,
        the data plane's host staging), and the loss meets them with the model's outputs."""
        device = next(self.forward_module.parameters()).device
        if all(v.device == device for _, v in b.items() if isinstance(v, torch.Tensor)):
            return b
        return TensorBatch({k: v.to(device) if isinstance(v, torch.Tensor) else v
                            for k, v in b.items()}, b.meta)

    def _forward(self, b: TensorBatch, entropy: bool | str = False) -> dict[str, torch.Tensor]:
        b = self._on_device(b)
        if self.head == "value":
            return {"values": sequence_values(self.forward_module, *_columns(b))}
        temperature = sampled_at(b)
        if entropy:
            logp, ent = sequence_logprobs(self.forward_module, *_columns(b),
                                          temperature=temperature, entropy=entropy)
            return {"logprobs": logp, "entropy": ent}
        return {"logprobs": sequence_logprobs(self.forward_module, *_columns(b),
                                              temperature=temperature)}

    def micro_batches(self, batch: TensorBatch) -> tuple[list[TensorBatch], torch.Tensor | None]:
        """This rank's micro-batches and the row order they hold (see `micro.micro_batches`)."""
        return micro_batches(batch, self.cfg.micro_batch_size,
                             self.cfg.max_tokens_per_micro_batch)

    def train_micro_batches(self, batch: TensorBatch) -> list[TensorBatch]:
        """A train step's micro-batches, each knowing the rows of every rank (`count_rows`)."""
        return self.micro_batches(count_rows(batch, self.stats_group))[0]

    @torch.no_grad()
    def logprobs(self, batch: TensorBatch) -> torch.Tensor:
        return self._inference(batch, "logprobs")

    @torch.no_grad()
    def values(self, batch: TensorBatch) -> torch.Tensor:
        return self._inference(batch, "values")

    def _inference(self, batch: TensorBatch, key: str) -> torch.Tensor:
        micros, order = self.micro_batches(batch)
        # in eval mode, as the engine and the reference: dropout an override turned back on,
        # MoE router jitter or expert sampling made every call's differ (DeepSpeed's engine
        # has a `training` of its own, always True: its module's is the one that counts)
        was = self.model.training
        self.model.eval()
        try:
            out = in_batch_order([self._forward(m)[key] for m in micros], order, batch)
        except BaseException:
            self._recover()
            raise
        finally:
            self.model.train(was)
        self._inference_done()
        return out

    def _inference_done(self) -> None:
        """After forward passes with no backward (the sharding hooks may leave parameters
        gathered until a backward)."""

    def _after_failure(self) -> None:
        """After a forward or backward that raised midway."""

    def _recover(self) -> None:
        """`_after_failure`, whose own failure (a CUDA error) must not hide the step's."""
        try:
            self._after_failure()
        except Exception:  # noqa: BLE001 - the step's error is the one raised
            log.exception("asyncrl: resetting the trainer after a failed step failed too")

    def _accumulate(self, batch: TensorBatch, loss_fn: LossFn, entropy: bool | str,
                    backward: Callable[[torch.Tensor], None],
                    micros: list[TensorBatch] | None = None) -> dict[str, float]:
        """Forward and backward each micro-batch (weighted by its share of the rows); the
        loss and statistics, averaged over the micro-batches and the data-parallel ranks."""
        sums: dict[str, float] = {}
        micros = micros if micros is not None else self.train_micro_batches(batch)
        keys: list[set[str]] = []  # each micro-batch's statistics
        for i, micro in enumerate(micros):
            weight = len(micro) / len(batch)
            micro = self._on_device(micro)
            loss, stats = loss_fn(self._forward(micro, entropy), micro)
            keys.append({"loss", *stats})
            if i in (0, len(micros) - 1):  # before any backward, and before the last (ZeRO
                self._agree_stats(keys)  # steps inside it): differing keys refused
            backward(loss * weight)
            for k, v in {"loss": loss.detach().item(), **stats}.items():
                sums[k] = sums.get(k, 0.0) + float(v) * weight
        return rank_means(sums, self.stats_group)  # (keys agreed before the last backward)

    def _agree_stats(self, keys: list[set[str]]) -> None:
        """The ranks agree on the statistics' keys and on whether a micro-batch's differ from
        the first's (a mean would then be of some micro-batches only)."""
        other = next((i for i, k in enumerate(keys) if k != keys[0]), None)
        agree_keys([*keys[0], *(["<other keys in a later micro-batch>"] if other else [])],
                   self.stats_group)
        if other:  # on every rank (they agreed on it)
            raise ValueError(f"the loss's statistics have other keys in micro-batch {other} "
                             f"({sorted(keys[other])}) than in the first ({sorted(keys[0])}):"
                             f" a LossFn's stats must have the same keys in every micro-batch")

    def _empty_step(self, batch: TensorBatch) -> dict[str, float] | None:
        """A train step's result where no rank has a real row (`batch` counted by
        `count_rows`): nothing to learn from, so neither the optimizer nor the schedule
        steps (both backends alike); None where there is."""
        if batch.meta[ALL_ROWS][0] > 0:
            return None
        return {"grad_norm": 0.0, "lr": self.opt.param_groups[0]["lr"], "grad_nonfinite": 0.0}

    def _checked_keys(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`load_state_dict`'s state with the model's own keys, no more, no fewer (torch's
        full-state-dict load fills a missing one with the current, random, weight); a tied
        parameter given by one of its names (an HF checkpoint of tied embeddings has no
        lm_head.weight) stands for the others."""
        names: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        state = dict(state)
        for tied in names.values():
            given = next((n for n in tied if n in state), None)
            if given is not None:
                state.update({n: state[given] for n in tied if n not in state})
        own = set(self.model.state_dict(keep_vars=True))
        missing, unexpected = sorted(own - set(state)), sorted(set(state) - own)
        if missing or unexpected:
            raise ValueError(
                f"load_state_dict: the state dict lacks {len(missing)} of the model's keys "
                f"{missing[:5]} and has {len(unexpected)} it does not know {unexpected[:5]}; "
                f"give every key of this backend's state_dict() (the same model's), no others")
        return state


class FSDPBackend(TrainBackend):
    def _inference_done(self) -> None:
        # FSDP2 keeps the root's parameters unsharded after its forward, for the backward
        # that follows; with none coming they would stay whole (memory), and the hybrid
        # engine's plan and sync_pack would take those temporaries for the parameters
        self.model.reshard()  # type: ignore[operator]  # an FSDPModule after fully_shard

    def _after_failure(self) -> None:
        # FSDP2's post-backward never ran: its per-iteration state was left mid-flight (the
        # next backward reduced no gradient at all), and parameters unsharded, plain tensors
        # the optimizer does not know, holding gradients its zero_grad cannot reach (taken
        # by the hybrid engine's plan for the parameters, too). The gradients are dropped
        # while those tensors are registered, then FSDP's state reset (resharding them).
        from torch.distributed.fsdp import FSDPModule

        self.model.zero_grad(set_to_none=True)
        reset = getattr(self.model, "reset_iter_state", None)  # (torch 2.13 has it)
        if reset is not None:
            reset()
            return
        for m in self.model.modules():  # older torch: resharded at least
            if isinstance(m, FSDPModule):
                m.reshard()

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Any,
                 head: str = "lm"):
        self.cfg, self.head = train_cfg, check_head(head)
        sizes = dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True))
        other = {a: n for a, n in sizes.items() if a not in ("dp", "tp") and n > 1}
        if other or "dp" not in sizes:  # another axis's ranks trained duplicates; with no
            # 'dp' FSDP sharded over every rank while a DP call gave all of them the batch
            tp = {"tp": sizes["tp"]} if "tp" in sizes else {}
            raise ValueError(
                f"backend='fsdp2' shards over a 'dp' axis and splits layers over a 'tp' one, "
                f"no other; the group's mesh {sizes} has {other or 'no dp axis'}: spawn with "
                f"mesh={ {'dp': math.prod(sizes.values()) // tp.get('tp', 1), **tp} }")
        self.mesh = mesh
        self.model = trainable(model_cfg, train_cfg, head)
        why = masters_warning(self.model)
        if why and dist.get_rank() == 0:
            log.warning(why)
        dp_mesh = mesh["dp"]
        if sizes.get("tp", 1) > 1:
            if model_cfg.lora is not None:  # ColwiseParallel would split A by its rows too
                raise ValueError("LoRA with tensor parallelism (tp > 1) is not supported: "
                                 "use tp=1 (FSDP shards the frozen model and the adapters)")
            apply_tp(self.model, mesh["tp"])
        apply_fsdp(self.model, dp_mesh, use_bf16(train_cfg))
        self.dp_group = self.stats_group = dp_mesh.get_group()
        self.forward_module = self.model
        self.opt = adamw(trained_parameters(self.model), train_cfg)
        self.sched = lr_scheduler(self.opt, train_cfg)

    def train_step(self, batch: TensorBatch, loss_fn: LossFn = nll_loss,
                   entropy: bool | str = False) -> dict[str, float]:
        """One optimizer step over this rank's rows, in micro-batches with gradient
        accumulation; FSDP averages the gradients over the data-parallel ranks. `loss_fn`
        runs per micro-batch (`LossFn`: take its means over rows with `real_row_mean`)."""
        self.opt.zero_grad(set_to_none=True)  # a step that failed midway left some behind
        micros = self.train_micro_batches(batch)
        if (empty := self._empty_step(batch)) is not None:
            return empty
        try:
            stats = self._accumulate(batch, loss_fn, entropy, lambda loss: loss.backward(),
                                     micros)
        except BaseException:
            self._recover()
            raise
        norm = clip_grad_norm(self.model.parameters(), self.cfg.grad_clip)
        lr = self.opt.param_groups[0]["lr"]
        finite = math.isfinite(norm)
        if finite:  # a NaN or inf gradient would make every weight NaN for good: skipped
            self.opt.step()  # (as verl does; every rank sees the same global norm)
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return {**stats, "grad_norm": float(norm), "lr": lr,
                "grad_nonfinite": 0.0 if finite else 1.0}

    def save(self, folder: Any) -> None:
        """Weights and optimizer state, each rank its shards (torch.distributed.checkpoint:
        a later load may use another layout)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if not self.opt.state:  # get_state_dict makes the state by a step at lr 0: one
            get_state_dict(self.model, self.opt)  # not taken (AdamW's bias correction counts)
            for state in self.opt.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"].zero_()
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "sched": self._sched_state()},
                 checkpoint_id=str(folder))

    def load(self, folder: Any) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        check_written_by(folder, "fsdp2")
        saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        # a checkpoint from before weight decay left norms and biases alone has one parameter
        # group: loaded into a twin optimizer of one, whose moments this one takes over
        last = f"optim.param_groups.{len(self.opt.param_groups) - 1}."
        opt = self.opt if any(k.startswith(last) for k in saved) else torch.optim.AdamW(
            trained_parameters(self.model), fused=self.opt.defaults.get("fused"))
        model_sd, optim_sd = get_state_dict(self.model, opt)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        old = legacy_adapter_names(k.removeprefix("model.") for k in saved
                                   if k.startswith("model."))
        if old:
            raise ValueError(f"{folder} holds LoRA adapters under the names asyncrl gave "
                             f"them before 2026-12-04 ({old[0]}; now {old[0]}.weight, as "
                             f"peft names them), which do not load into this model: "
                             f"`asyncrl export` still reads it (the merged model, and the "
                             f"adapters in peft's format) to start a new run from")
        if "sched.steps" in saved:  # checkpoints from before schedules have no position
            state["sched"] = self._sched_state()
        self.loads += 1
        dcp.load(state, checkpoint_id=str(folder))  # in place
        set_state_dict(self.model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        if opt is not self.opt:  # its state is per parameter, whatever the groups
            self.opt.state.update(opt.state)
        steps = int(state["sched"]["steps"]) if "sched" in state else max(
            (int(s["step"]) for s in self.opt.state.values() if "step" in s), default=0)
        resume_schedule(self.sched, self.opt, self.cfg, steps)

    def _sched_state(self) -> dict[str, torch.Tensor]:
        """The schedule's position (optimizer steps taken), as a tensor DCP loads in place."""
        return {"steps": torch.tensor(self.sched.last_epoch, dtype=torch.int64)}

    @torch.no_grad()
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on every rank, on the CPU, one whole on the device at a
        time (torch's full state dict kept them all there: the model beside its shards);
        tied weights gathered once, under each name."""
        from torch.distributed.tensor import DTensor

        out, done = {}, {}  # (copied on the CPU too: no alias of a live buffer)
        for k, v in self.model.state_dict(keep_vars=True).items():
            if id(v) not in done:
                whole = v.full_tensor() if isinstance(v, DTensor) else v
                done[id(v)] = whole.to("cpu", copy=True)
                del whole  # (before the next is gathered)
            out[k] = done[id(v)]
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full: dict[str, Any] = self._checked_keys(state)
        self.loads += 1
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True))
