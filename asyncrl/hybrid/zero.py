"""Training with DeepSpeed ZeRO stage 2 or 3 (the `deepspeed` extra), behind the same
interface as `FSDPBackend`: `logprobs`/`values`, `train_step(batch, loss_fn)`, `state_dict` in
and out, `save`/`load` (DeepSpeed's own checkpoint format).

On a CPU-only host DeepSpeed runs with `DS_ACCELERATOR=cpu` over the rank's gloo group,
without the shared-memory all-reduce op it would compile first (only inference uses it). The model
is built normally and handed to `deepspeed.initialize` (built inside `zero.Init` an HF model
is mis-initialised), with a plain torch AdamW so the update is FSDP2's.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.actors.gpu_slots import require_own_gpu
from asyncrl.comm.batch import TensorBatch
from asyncrl.hybrid.ckpt_kind import ZERO_TAG, check_written_by
from asyncrl.hybrid.fsdp import (
    LossFn,
    TrainBackend,
    TrainConfig,
    check_head,
    nll_loss,
    trainable,
    trained_parameters,
    use_bf16,
)
from asyncrl.hybrid.models import ModelConfig
from asyncrl.hybrid.optim import adamw, lr_scheduler, resume_schedule


def _deepspeed() -> Any:
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError("the ZeRO backend needs DeepSpeed: pip install 'asyncrl[deepspeed]'") \
            from e
    if on_cpu:
        _no_shared_memory_all_reduce(deepspeed)
    return deepspeed


def _no_shared_memory_all_reduce(deepspeed: Any) -> None:
    """On CPU, DeepSpeed's communication backend builds its shared-memory all-reduce op
    with the C++ compiler when it starts, in every fresh environment (2.5 minutes on 2
    cores). Only its inference all-reduce uses that op, never training; marked
    unavailable, ZeRO starts at once (and that all-reduce falls back to torch.distributed)."""
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def _has_check_grad_overflow() -> bool:
    """Whether this DeepSpeed's bf16 config has `check_grad_overflow`: set, a ZeRO-2 step
    whose gradient is NaN or inf is skipped under bf16 as FSDP2 skips it. Older ones (from
    its PR #4512) apply it under bf16 ZeRO-2; its config refuses keys it does not know."""
    try:
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    except ImportError:
        return False
    return "check_grad_overflow" in getattr(DeepSpeedBF16Config, "model_fields", {})


def _real_part(p: torch.Tensor) -> torch.Tensor:
    """What this rank holds of parameter `p`: whole under ZeRO-2; under ZeRO-3 its partition
    without the padding the last rank's holds (DeepSpeed never writes it: any bits)."""
    part = getattr(p, "ds_tensor", None)
    if part is None:
        return p.detach()
    n = part.numel()
    start = n * dist.get_rank(group=getattr(p, "ds_process_group", None))
    return part.detach().reshape(-1)[:max(0, min(n, p.ds_numel - start))]  # type: ignore[attr-defined]


def _stage3_checks_norm() -> bool:
    """Whether this DeepSpeed's ZeRO-3 step skips a bf16 step whose gradient is NaN or inf.
    It has no option for it: its step skips one where it checks the norm with
    `is_invalid_grad_norm` (0.19.8 does), while older ones check only under fp16."""
    import deepspeed.runtime.zero.stage3 as stage3

    return hasattr(stage3, "is_invalid_grad_norm")


TAG = ZERO_TAG


@contextlib.contextmanager
def globless(folder: Any) -> Iterator[str]:
    """`folder` by a path without glob characters, while the context lasts: DeepSpeed globs
    its files under the folder it is given, unescaped (`runs/lr[1e-5]` matched nothing,
    `runs/exp*` other folders too). A symlink to it, where its path holds any."""
    path = os.path.abspath(folder)
    if not any(c in path for c in "*?["):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="asyncrl-") as tmp:
        os.symlink(path, os.path.join(tmp, "checkpoint"))
        yield os.path.join(tmp, "checkpoint")


def _saved_groups(folder: Any) -> int | None:
    """The optimizer parameter groups a DeepSpeed checkpoint holds (its model states name
    each group's parameters); None where it does not say."""
    from pathlib import Path

    for path in sorted((Path(folder) / TAG).glob("*model_states.pt"))[:1]:
        shapes = torch.load(path, map_location="cpu", weights_only=False).get("param_shapes")
        return len(shapes) if isinstance(shapes, list) else None
    return None


class ZeroBackend(TrainBackend):
    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, stage: int = 2,
                 head: str = "lm"):
        if stage not in (2, 3):
            raise ValueError(f"ZeRO stage must be 2 or 3, got {stage}")
        ds = _deepspeed()
        require_own_gpu("ZeRO needs a GPU per rank (DeepSpeed binds cuda:LOCAL_RANK)")
        self.cfg, self.stage, self.head = train_cfg, stage, check_head(head)
        model = trainable(model_cfg, train_cfg, head)
        opt = adamw(trained_parameters(model), train_cfg)
        option = _has_check_grad_overflow()  # whether this DeepSpeed skips a bf16 step
        self._skips_nonfinite = option if stage == 2 else _stage3_checks_norm()  # with NaN
        bf16: dict[str, Any] = {"enabled": use_bf16(train_cfg)}
        if option:  # (0.19.8's default, said outright: not every version's)
            bf16["check_grad_overflow"] = True
        config = {"train_micro_batch_size_per_gpu": train_cfg.micro_batch_size,
                  "gradient_accumulation_steps": 1,  # None: no clipping (DeepSpeed's 0)
                  "gradient_clipping": train_cfg.grad_clip or 0.0,
                  "zero_optimization": {"stage": stage},
                  "bf16": bf16,
                  # gradients averaged in fp32, as FSDP2 reduces them (bf16 would by default)
                  "communication_data_type": "fp32",
                  "fp16": {"enabled": False}, "steps_per_print": 1 << 30}
        if use_bf16(train_cfg):  # micro-batches' gradients summed in fp32, as FSDP2 sums
            config["data_types"] = {"grad_accum_dtype": "fp32"}  # them (bf16 by default)
        # DeepSpeed steps the schedule with the optimizer and keeps it in its checkpoints
        self.engine, _, _, self.sched = ds.initialize(model=model, optimizer=opt, config=config,
                                                      lr_scheduler=lr_scheduler(opt, train_cfg))
        self.model = self.engine.module
        self.forward_module = self.engine
        # the torch optimizer ZeRO wraps (its state is what the hybrid engine moves)
        self.opt = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        self._ds = ds
        self._bit16 = use_bf16(train_cfg)  # weights in bf16, beside the fp32 masters
        self._masters_away = False  # offloaded (offload_masters): DeepSpeed unlinked them
        self._failed_midway = ""  # a step whose backward ran for some micro-batches, not all
        self._host_masters: list[torch.Tensor] = []  # ZeRO-3's, while generating: pinned
        # and made once (a fresh pageable copy each switch is slow to fill, and synchronous)

    def train_step(self, batch: TensorBatch, loss_fn: LossFn = nll_loss,
                   entropy: bool | str = False) -> dict[str, float]:
        if self._failed_midway:  # DeepSpeed keeps what it accumulated, in its own buffers:
            # stepping on would add it to this step's gradients
            raise RuntimeError(
                f"ZeRO train_step refused: the step before failed after some of its "
                f"micro-batches' backward ({self._failed_midway}), and DeepSpeed keeps their "
                f"gradients; respawn the group (a flow's rewind does) or use FSDP2, which "
                f"drops them")
        micros = self.train_micro_batches(batch)
        if (empty := self._empty_step(batch)) is not None:
            return empty
        gas = len(micros)
        if self.engine.gradient_accumulation_steps() != gas:  # this step's micro-batch count
            self.engine.set_train_batch_size(
                self.cfg.micro_batch_size * gas * dist.get_world_size())

        began = done = 0  # micro-batches whose backward began, and those whose step returned

        def backward(loss: torch.Tensor) -> None:
            nonlocal began, done
            began += 1
            # the boundary said outright: DeepSpeed's own micro-step counter runs on across
            # steps, and steps at the wrong micro-batch once their count changes
            self.engine.set_gradient_accumulation_boundary(began == gas)
            self.engine.backward(loss * gas)  # DeepSpeed divides by the accumulation steps
            self.engine.step()  # steps the optimizer and the schedule at the boundary only
            done += 1
            if began == gas and self.engine.skipped_steps > skipped:  # a non-finite gradient:
                self.sched.step()  # DeepSpeed skipped the step and its schedule; FSDP2 skips
                # the step alone

        lr = self.opt.param_groups[0]["lr"]
        skipped = self.engine.skipped_steps
        try:
            stats = self._accumulate(batch, loss_fn, entropy, backward, micros)
        except BaseException as e:
            # gradients reduced into DeepSpeed's buffers and not stepped: a backward that
            # raised (the last micro-batch's too, or the only one's), or one not reached
            if began > done or 0 < done < gas:
                self._failed_midway = f"{type(e).__name__}: {e}"
            raise
        if not self._skips_nonfinite and self.engine.skipped_steps == skipped:
            self._check_weights_finite()
        norm = float(self.engine.get_global_grad_norm() or 0.0)
        return {**stats, "grad_norm": norm, "lr": lr,
                "grad_nonfinite": 0.0 if math.isfinite(norm) else 1.0}

    def _check_weights_finite(self) -> None:
        """After a step that a DeepSpeed which does not skip non-finite ones applied: refused
        if it made a weight NaN or inf (the grad norm need not say: DeepSpeed's helpers
        report a NaN norm as -1). ZeRO-2's weights are whole on every rank: all agree;
        ZeRO-3's are checked in this rank's partitions, and the ranks agree by a MIN."""
        weights = [_real_part(p) for p in self.model.parameters() if p.requires_grad]
        finite = torch.stack([torch.isfinite(p).all() for p in weights]).all()
        if self.stage == 3:  # every rank raises alike: the NaN may be in another's partition
            flag = finite.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.engine.data_parallel_group)
            finite = flag.bool()
        if finite:
            return
        lacks = "its bf16 config has no check_grad_overflow" if self.stage == 2 else \
            "its ZeRO-3 step checks no gradient norm (is_invalid_grad_norm)"
        raise RuntimeError(
            f"DeepSpeed {self._ds.__version__} applied a step whose gradient was NaN or inf "
            f"({lacks} to skip it, as FSDP2 does): the weights are NaN or inf now. Install "
            f"a newer DeepSpeed (0.19.8 skips such steps) or use backend='fsdp2', and "
            f"respawn the group from a checkpoint")

    def save(self, folder: Any) -> None:
        """Weights and optimizer state in DeepSpeed's checkpoint format (same layout to load)."""
        self.engine.save_checkpoint(str(folder), tag=TAG, save_latest=False)

    def load(self, folder: Any) -> None:
        # the schedule's state comes back among the "client" states: checkpoints from before
        # schedules hold None there, which DeepSpeed would hand to load_state_dict
        check_written_by(folder, f"zero{self.stage}")
        self.loads += 1
        try:
            with globless(folder) as plain:
                path, client = self.engine.load_checkpoint(plain, tag=TAG,
                                                           load_lr_scheduler_states=False)
        except (RuntimeError, ValueError) as e:  # DeepSpeed's own words miss the cause
            groups = _saved_groups(folder)
            if groups is None or groups == len(self.opt.param_groups):
                raise
            raise ValueError(
                f"{folder} holds {groups} optimizer parameter group(s) and this trainer has "
                f"{len(self.opt.param_groups)}: checkpoints from before weight decay left norms "
                f"and biases alone (2026-12-05) hold one, which DeepSpeed cannot load into "
                f"two (FSDP2 can); start a new run from its model (`asyncrl export`, then "
                f"model={{'path': ...}})") from e
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {folder}")
        saved = client.get("lr_scheduler")
        # its position restored (else its optimizer steps), with this config's lr, as FSDP2
        steps = int(saved["last_epoch"]) if saved else int(self.engine.global_steps)
        resume_schedule(self.sched, self.opt, self.cfg, steps)

    def offload_masters(self) -> int:
        """ZeRO's fp32 master partitions to host memory while the hybrid engine generates,
        and under ZeRO-3 its gradient partitions and buckets too (ZeRO-2 frees its own after
        each step). The bit16 weights stay: generation gathers them; the torch optimizer's
        state moves as FSDP2's does. The fp32 master bytes moved."""
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

        masters = self._masters()
        self._masters_away = True
        if self.stage == 2:
            include = [State.hp_params, State.lp_grads]
        else:  # DeepSpeed moves ZeRO-3's masters only for its own FusedAdam (it asserts the
            # class); the move is the same for a torch AdamW. First: the cache is emptied after
            self._offload_zero3(masters)
            include = [State.lp_grads, State.contiguous_grad_buffer]  # scratch: made again
        self.engine.offload_states(include=include, pin_memory=torch.cuda.is_available())
        return sum(t.numel() * t.element_size() for t in masters)

    def _offload_zero3(self, masters: list[torch.Tensor]) -> None:
        if not masters or not masters[0].is_cuda:  # (a CPU-only host: they stay)
            return
        if [h.shape for h in self._host_masters] != [t.shape for t in masters]:
            self._host_masters = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                  for t in masters]  # (held for the run: 4 bytes a
            # parameter of this rank's share, page-locked)
        for t, host in zip(masters, self._host_masters, strict=True):
            host.copy_(t, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the host copies are whole only after it
        for t, host in zip(masters, self._host_masters, strict=True):
            t.data = host  # the device memory goes

    def reload_masters(self) -> None:
        self.engine.reload_states()
        self._masters_away = False
        if self.stage == 3:
            device = next(self.model.parameters()).device
            for t in self._masters():
                if t.device != device:  # from the pinned copies, in stream order: the next
                    # offload writes them only after these copies ran
                    t.data = t.data.to(device, non_blocking=True)

    def _masters(self) -> list[torch.Tensor]:
        """The fp32 partitions the optimizer steps (this rank's share of the weights), those
        that are not the weights themselves: ZeRO-3 training in fp32 steps its partitions of
        the weights, which stay (generation gathers them)."""
        opt = self.engine.optimizer
        if self.stage == 2:
            return list(opt.single_partition_of_fp32_groups)
        weights = {t.data_ptr() for t in opt.fp16_partitioned_groups_flat}
        return [t for t in opt.fp32_partitioned_groups_flat if t.data_ptr() not in weights]

    def gathered(self, params: list[Any]) -> Any:
        """A context in which these parameters are whole on every rank (ZeRO-3 partitions
        them; under ZeRO-2 they already are). A collective: every rank, the same order."""
        return self._ds.zero.GatheredParameters(params, modifier_rank=None,
                                                enabled=self.stage == 3)

    def state_dict(self, everywhere: bool = True, trained: bool = False,
                   masters: bool | None = None) -> dict[str, torch.Tensor]:
        """Full weights on the CPU, on every rank (or on rank 0 only: the others take part in
        the gathers and keep nothing); `trained`: without the frozen parameters (a LoRA
        model's: its adapters and buffers go). Under ZeRO-3 one parameter is whole at a time.
        `masters`: the trained parameters' fp32 masters, as FSDP2's state dict gives them,
        not the bf16 weights DeepSpeed computes with (None: unless `trained`, a weight sync's
        view, whose engine computes in bf16 too). Frozen ones are the module's, as buffers."""
        keep = everywhere or dist.get_rank() == 0
        fp32 = self._bit16 and (not trained if masters is None else masters)
        out: dict[str, torch.Tensor] = {}
        done: dict[int, torch.Tensor] = {}  # tied weights: gathered once, under each name
        with self._masters_here(fp32):
            for name, value in self.model.state_dict(keep_vars=True).items():
                param = isinstance(value, torch.nn.Parameter)
                if trained and param and not value.requires_grad:
                    continue  # (a LoRA model's frozen weights; buffers still go)
                if id(value) not in done and fp32 and param and value.requires_grad:
                    whole = self._ds.utils.safe_get_full_fp32_param(value)  # (a collective)
                    # (kept or not: a rank that keeps nothing holds no whole fp32 copy)
                    done[id(value)] = whole.detach().to("cpu", copy=True) if keep else \
                        torch.empty(0)
                elif id(value) not in done:
                    with self.gathered([value] if param else []):
                        done[id(value)] = value.detach().to("cpu", copy=True) if keep else value
                if keep:
                    out[name] = done[id(value)]
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """New weights in the model and in ZeRO's fp32 partitions the optimizer steps: the
        masters take the state's own values (bf16 weights would round them)."""
        state = self._checked_keys(state)
        self.loads += 1
        params = list(self.model.parameters())
        with self._ds.zero.GatheredParameters(params, modifier_rank=0, enabled=self.stage == 3):
            self.model.load_state_dict(state)
        with self._masters_here(self._bit16):
            self.engine.optimizer._restore_from_bit16_weights()
            if self._bit16:
                for name, param in self.model.named_parameters():
                    if param.requires_grad:
                        self._ds.utils.safe_set_full_fp32_param(param, state[name])

    @contextlib.contextmanager
    def _masters_here(self, needed: bool = True) -> Iterator[None]:
        """Where the masters are needed whole while offloaded (the hybrid engine generating):
        back for the while (DeepSpeed unlinks them from the parameters when it moves them)."""
        away = needed and self._masters_away
        if away:
            self.reload_masters()
        try:
            yield
        finally:
            if away:
                self.offload_masters()
