"""The hybrid engine: the same ranks train (FSDP2) and generate (the built-in engine).

    train mode ──to_generate()──▶ optimizer state (and ZeRO's fp32 master partitions)
                                  leaves the GPU; sharded parameters are all-gathered
                                  bucket by bucket (about 32 MiB: one collective each)
                                  and copied straight into the engine's own weights:
                                  never a second full copy; the engine wakes
    generate   ──to_train()────▶ the engine sleeps (no KV cache is kept between calls); on
                                  a GPU its weights and the gather buffers are freed;
                                  optimizer state comes back

Nothing is reloaded from disk. On a CPU-only host there is no device memory to free: the
optimizer state and the engine's weights stay where they are (warm memory, reused).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.hybrid.models import ModelConfig, build_model, default_device
from asyncrl.hybrid.sampler import Sampler, SamplingConfig

# one collective into one flat tensor (renamed all_gather_single in newer torch releases)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
BUCKET_BYTES = 32 << 20  # parameters gathered together, up to about this many bytes


ENGINES = ("builtin", "vllm")


def make_engine(name: str, model_cfg: ModelConfig, sampling: SamplingConfig | None,
                options: dict[str, Any] | None = None) -> Any:
    """A generation engine: the built-in Sampler, or vLLM (GPU machines, a local checkpoint;
    `options`: VLLMEngine's keywords, e.g. gpu_memory_utilization)."""
    if name == "builtin":
        if options:
            raise ValueError(f"engine_options {sorted(options)} are for engine='vllm'; the "
                             f"built-in engine takes its settings from sampling=")
        return Sampler(build_model(model_cfg).to(default_device()), sampling)
    if name == "vllm":
        if model_cfg.path is None:
            raise ValueError(f"engine='vllm' loads a local checkpoint: give model={{'path': "
                             f"DIR}}; the preset {model_cfg.preset!r} is for the built-in engine")
        if model_cfg.overrides:  # the trainer would build another model than vLLM runs
            raise ValueError(f"engine='vllm' runs the checkpoint's own config.json: the model "
                             f"overrides {sorted(model_cfg.overrides)} would reach the trainer "
                             f"only; save the checkpoint with them, or pass vLLM's "
                             f"hf_overrides in engine_options too and drop them here")
        from asyncrl.hybrid.vllm_engine import VLLMEngine

        return VLLMEngine(model_cfg.path, sampling, seed=model_cfg.seed, **(options or {}))
    raise ValueError(f"engine is one of {ENGINES}, got {name!r}")


def _full(param: Any) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def _row_sharded(p: Any) -> bool:
    """A DTensor sharded by rows over a 1-D mesh (FSDP without TP) on the CPU or a GPU."""
    from torch.distributed.tensor import Shard

    placements = getattr(p, "placements", None)
    return placements is not None and len(placements) == 1 and placements[0] == Shard(0) \
        and p.dim() >= 1


class _Bucket:
    """Row-sharded parameters gathered by one collective. Each rank's shard takes
    ceil(rows / ranks) rows in the buffer (rank r holds rows [r*per, (r+1)*per), as
    torch.chunk splits them), so every rank contributes the same width."""

    def __init__(self, mesh: Any, dtype: torch.dtype, device: torch.device):
        self.device = device
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.items: list[tuple[Any, torch.Tensor, int, int]] = []  # param, target, at, n
        self.width = 0
        self.nbytes = 0
        self.dtype = dtype

    def add(self, param: Any, target: torch.Tensor) -> None:
        per = -(-param.shape[0] // self.world)
        n = per * (param.numel() // max(1, param.shape[0]))
        self.items.append((param, target, self.width, n))
        self.width += n
        self.nbytes += param.numel() * param.element_size()


class HybridEngine:
    def __init__(self, backend: Any, model_cfg: ModelConfig,
                 sampling: SamplingConfig | None = None, bucket_bytes: int = BUCKET_BYTES,
                 engine: str = "builtin", engine_options: dict[str, Any] | None = None):
        self.backend = backend
        self._zero = hasattr(backend, "gathered")  # DeepSpeed ZeRO: parameters gathered in place
        self.bucket_bytes = bucket_bytes
        if engine == "vllm":  # the trainer fills vLLM before every generation: vLLM need not
            # read the checkpoint (random weights), nor keep a host copy of them asleep
            engine_options = {"load_format": "dummy", **(engine_options or {})}
        self.engine = make_engine(engine, model_cfg, sampling, engine_options)
        self._sleep_level = 2 if self.engine.owns_weights else 1
        self.engine.sleep(self._sleep_level)
        self.mode = "train"
        self.peak_gather_bytes = 0  # the largest gathered tensor alive at once, last switch
        self.offloaded_bytes = 0  # fp32 masters (ZeRO) sent to the host, last switch
        self._filled_once = False  # an engine filled by name: checked complete the first time
        self.released = False  # the engine's weights are freed (GPU, train mode)
        self._shapes: list[tuple[torch.nn.Parameter, torch.Size]] = []  # theirs, meanwhile
        self._plan: list[Any] | None = None
        self._local: torch.Tensor | None = None  # reused gather buffers: warm memory
        self._out: torch.Tensor | None = None
        self._release()  # built in train mode: the engine holds nothing until generating

    @torch.no_grad()
    def to_generate(self) -> None:
        if self.mode == "generate":
            return
        if self._plan is None and not self.engine.owns_weights:
            self._plan = self._make_plan()
        try:
            # first: their memory makes room for the engine's weights
            self._move_optimizer("cpu")
            self.offloaded_bytes = self.backend.offload_masters()
            if self.engine.owns_weights and torch.cuda.is_available():
                torch.cuda.empty_cache()  # vLLM allocates from its own pool, not torch's cache
            self._fill_engine()
        except BaseException:  # still training: the engine's memory freed again (GPU), the
            self._release()  # optimizer back where it steps
            if self.engine.owns_weights:  # vLLM: the first load woke its weights
                self.engine.sleep(self._sleep_level)
            self._restore_training()
            raise
        self.engine.wake()
        self.mode = "generate"

    def _fill_engine(self) -> None:
        """The training shards gathered, bucket by bucket, into the engine's weights."""
        if self.engine.owns_weights:
            self._fill_by_name()
            return
        assert self._plan is not None
        if self.released:
            for p, shape in self._shapes:
                p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
            self.released = False
        self.peak_gather_bytes = 0
        for item in self._plan:
            if isinstance(item, _Bucket):
                self._gather_bucket(item)
            else:
                name, param, target = item
                with self._whole(param) as full:
                    target.copy_(full)
                    self.peak_gather_bytes = max(self.peak_gather_bytes,
                                                 full.numel() * full.element_size())
                del full  # one whole parameter alive at a time

    def _fill_by_name(self) -> None:
        """An engine that owns its weights' memory (vLLM, which fuses projections) takes
        them by name: each parameter gathered whole, handed over in buckets, dropped."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = self.peak_gather_bytes = 0
        for name, param in self.backend.model.named_parameters():
            with self._whole(param) as whole:  # ZeRO's is freed after: kept as a copy
                full = whole.clone() if self._zero else whole
            bucket.append((name, full))
            size += full.numel() * full.element_size()
            self.peak_gather_bytes = max(self.peak_gather_bytes, size)
            if size >= self.bucket_bytes:
                self.engine.load_weights(bucket)
                bucket, size = [], 0
        if bucket:
            self.engine.load_weights(bucket)
        if not self._filled_once:  # from dummy weights: a name vLLM did not map stays random
            missing = self.engine.not_loaded()
            if missing:
                raise RuntimeError(f"the trainer's weights left {len(missing)} of vLLM's "
                                   f"parameters unfilled ({', '.join(missing[:4])}): vLLM "
                                   f"would generate from random weights; the trainer's model "
                                   f"and the checkpoint vLLM runs must be the same architecture")
            self._filled_once = True

    @contextmanager
    def _whole(self, param: Any) -> Iterator[torch.Tensor]:
        """`param` whole for the time of the block: DeepSpeed ZeRO gathers it in place for
        a moment; FSDP2 (+ TP) gathers a DTensor into a new tensor."""
        if self._zero:
            with self.backend.gathered([param]):
                yield param.detach()
        else:
            yield _full(param.detach())

    def _make_plan(self) -> list[Any]:
        """Buckets of row-sharded parameters (FSDP alone), and the rest one by one. The
        sharded parameters are the same objects for the whole run, so this is done once."""
        targets = dict(self.engine.model.named_parameters())
        plan: list[Any] = []
        bucket: _Bucket | None = None
        for name, param in self.backend.model.named_parameters():
            if not _row_sharded(param):
                plan.append((name, param, targets[name]))
                continue
            if bucket is None or bucket.nbytes >= self.bucket_bytes or \
                    bucket.dtype != param.dtype or bucket.device != param.device:
                bucket = _Bucket(param.device_mesh, param.dtype,  # type: ignore[attr-defined]
                                 param.device)
                plan.append(bucket)
            bucket.add(param, targets[name])
        return plan

    def _gather_bucket(self, bucket: _Bucket) -> None:
        """One all_gather for the bucket's parameters into warm, reused buffers, then each
        rank's real rows copied straight into the engine's weights."""
        world, width = bucket.world, bucket.width
        if self._local is None or self._local.numel() < width or \
                self._local.dtype != bucket.dtype or self._local.device != bucket.device:
            self._local = self._out = None  # freed before the new ones: never both alive
            assert self._plan is not None  # sized for the widest bucket like it: made once
            widest = max(b.width for b in self._plan if isinstance(b, _Bucket) and
                         b.dtype == bucket.dtype and b.device == bucket.device)
            self._local = torch.zeros(widest, dtype=bucket.dtype, device=bucket.device)
            self._out = torch.empty(widest * world, dtype=bucket.dtype, device=bucket.device)
        assert self._out is not None
        local, out = self._local[:width], self._out[:width * world]
        for param, _, at, _n in bucket.items:
            shard = param.detach().to_local().reshape(-1)
            local[at:at + shard.numel()] = shard
        _all_gather(out, local, group=bucket.group)
        self.peak_gather_bytes = max(self.peak_gather_bytes, out.numel() * out.element_size())
        per_rank = out.view(world, width)
        for param, target, at, _n in bucket.items:
            rows = param.shape[0]
            per, row = -(-rows // world), param.numel() // max(1, rows)
            flat = target.view(-1)
            for r in range(world):
                real = max(0, min(per, rows - r * per)) * row
                flat[r * per * row:r * per * row + real].copy_(per_rank[r, at:at + real])

    def to_train(self) -> None:
        if self.mode == "train":
            return
        self.engine.sleep(self._sleep_level)
        self._release()
        self._restore_training()
        self.mode = "train"

    def _restore_training(self) -> None:
        self.backend.reload_masters()
        self._move_optimizer(next(self.backend.model.parameters()).device)

    def _frees_memory(self) -> bool:
        """Whether the engine's weights are freed here (vLLM frees its own as it sleeps)."""
        return not self.engine.owns_weights and \
            next(self.engine.model.parameters()).device.type == "cuda"

    def _release(self) -> None:
        """On a GPU, free what the idle engine holds (its weights, the gather buffers) for
        training; the next switch to generation allocates them again."""
        if not self._frees_memory():
            return
        if not self.released:
            self._shapes = [(p, p.shape) for p in self.engine.model.parameters()]
        for p, _ in self._shapes:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.released = True
        self._local = self._out = None

    @property
    def buffer_bytes(self) -> int:
        """What the gather buffers hold now."""
        return sum(t.numel() * t.element_size() for t in (self._local, self._out)
                   if t is not None)

    def _move_optimizer(self, device: Any) -> None:
        """Optimizer state to `device` (off the GPU while generating; a no-op on CPU). Step
        counters (0-d) stay where the optimizer keeps them."""
        moved = False
        for state in self.backend.opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() and \
                        value.device != torch.device(device):
                    state[key] = value.to(device, non_blocking=True)
                    moved = True
        if moved and torch.device(device).type == "cpu" and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # host copies are only valid after it

    @property
    def continues_turns(self) -> bool:
        """Whether the engine runs multi-turn rollouts in its own loop (asyncrl.hybrid.turns)."""
        return bool(getattr(self.engine, "continues_turns", False))

    def generate(self, prompts: list[list[int]], seeds: list[int], config: Any = None,
                 **turns: Any) -> Any:
        if self.mode != "generate":
            raise RuntimeError("the hybrid engine is in train mode: call to_generate() first")
        return self.engine.generate(prompts, seeds, config, **turns)
