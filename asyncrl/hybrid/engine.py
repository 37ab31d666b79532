"""The hybrid engine: the same ranks train (FSDP2) and generate (the built-in engine).

    train mode ──to_generate()──▶ optimizer state (and ZeRO's fp32 master partitions)
                                  leaves the GPU; sharded parameters are all-gathered
                                  bucket by bucket (about 32 MiB: one collective each)
                                  and copied straight into the engine's own weights:
                                  never a second full copy; the engine wakes (the ranks
                                  agree before the gathers and after the wake: a failure
                                  on one is undone on all, none left in a collective)
    generate   ──to_train()────▶ the engine sleeps (no KV cache is kept between calls); on
                                  a GPU its weights and the gather buffers are freed;
                                  optimizer state comes back

A LoRA model's frozen weights are gathered once on a CPU host: later switches gather the
adapters alone (and the frozen weights again after the trainer loaded new ones). On a GPU the
engine's weights are freed while training, so each switch gathers them all; an engine filled
by name (vLLM) takes the merged weights at each switch.

Nothing is reloaded from disk. On a CPU-only host there is no device memory to free: the
optimizer state and the engine's weights stay where they are (warm memory, reused).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.hybrid.gather import Gatherer, attempt, plan_gather, whole_each
from asyncrl.hybrid.lora import is_adapter, lora_layers, merge
from asyncrl.hybrid.models import ModelConfig, build_model, default_device, model_file, model_folder
from asyncrl.hybrid.sampler import Sampler, SamplingConfig

BUCKET_BYTES = 32 << 20  # parameters gathered together, up to about this many bytes


ENGINES = ("builtin", "vllm")


def check_engine(name: Any, options: Any, model_cfg: ModelConfig | None = None,
                 sampling: SamplingConfig | None = None) -> None:
    """An engine's name and options, and the model and sampling it would run, as
    make_engine takes them (also where a group is declared: a mistake failed every rank
    after the groups had started). vLLM is not imported: its own checks come later."""
    if name not in ENGINES:
        raise ValueError(f"engine is one of {ENGINES}, got {name!r}")
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"engine_options is a dict of the engine's keywords, got "
                        f"{type(options).__name__}")
    if name == "builtin" and options:
        raise ValueError(f"engine_options {sorted(options)} are for engine='vllm'; the "
                         f"built-in engine takes its settings from sampling=")
    if name == "vllm":
        from asyncrl.hybrid.vllm_engine import check_options, check_sampling

        check_options(options or {})
        if sampling is not None:
            check_sampling(sampling)
        if model_cfg is not None:
            _check_vllm_model(model_cfg)


def _check_vllm_model(model_cfg: ModelConfig) -> None:
    if model_cfg.path is None:
        raise ValueError(f"engine='vllm' loads a local checkpoint: give model={{'path': "
                         f"DIR}}; the preset {model_cfg.preset!r} is for the built-in engine")
    if model_cfg.overrides:  # the trainer would build another model than vLLM runs
        raise ValueError(f"engine='vllm' runs the checkpoint's own config.json: the model "
                         f"overrides {sorted(model_cfg.overrides)} would reach the trainer "
                         f"only; save the checkpoint with them, or give them to vLLM "
                         f"in their place: engine_options={{'hf_overrides': "
                         f"{model_cfg.overrides!r}}} (a tied checkpoint untied so has no "
                         f"lm_head.weight for vLLM to load: add 'load_format': 'dummy')")


def _check_covers(path: str | None, model: torch.nn.Module) -> None:
    """The trainer's weights must cover the checkpoint a hybrid's vLLM runs: vLLM fills a
    fused parameter (qkv_proj) from any one of its parts and says it filled it, so a part
    the trainer lacks would stay random (its dummy load), unsaid."""
    names = checkpoint_tensors(path) if path else None
    if names is None:
        return
    mine = {n for n, _ in model.named_parameters(remove_duplicate=False)  # (a tied head too)
            if not is_adapter(n)}
    missing = sorted(n for n in names - mine if n.endswith((".weight", ".bias")))
    if missing:
        raise ValueError(f"the trainer's model has no weight for {len(missing)} of the "
                         f"checkpoint's tensors ({', '.join(missing[:4])}): vLLM, filled "
                         f"from the trainer, would keep random values there; the trainer's "
                         f"model and the checkpoint vLLM runs must be the same architecture")


def checkpoint_tensors(path: str) -> set[str] | None:
    """The tensor names of a safetensors checkpoint, a directory or a cached Hub id (None:
    another format, or none)."""
    index = model_file(path, "model.safetensors.index.json")
    if index is not None:
        return set(json.loads(index.read_text())["weight_map"])
    single = model_file(path, "model.safetensors")
    if single is None:
        return None
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return set(f.keys())


def agree(failed: BaseException | None, what: str, value: int = 0) -> int:
    """Every rank of the group learns whether `what` failed on any (a collective); each
    raises then: its own error, or one that says another rank's is the call's. Else the
    largest `value` any rank gave (a width the ranks must share, say)."""
    said = torch.tensor([failed is not None, value], dtype=torch.int64)  # (gloo: on CPU)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(said, op=dist.ReduceOp.MAX)
    if failed is not None:
        raise failed
    if said[0]:
        raise RuntimeError(f"{what} failed on another rank of this group (its error is the "
                           f"call's); this rank dropped its part")
    return int(said[1])


def make_engine(name: str, model_cfg: ModelConfig, sampling: SamplingConfig | None,
                options: dict[str, Any] | None = None) -> Any:
    """A generation engine: the built-in Sampler, or vLLM (GPU machines, a local checkpoint;
    `options`: VLLMEngine's keywords, e.g. gpu_memory_utilization)."""
    check_engine(name, options, model_cfg, sampling)
    if name == "builtin":
        return Sampler(build_model(model_cfg).to(default_device()), sampling)
    if name == "vllm":
        from asyncrl.hybrid.vllm_engine import VLLMEngine

        # vLLM computes as the trainer does (the built-in engine's dtype is the model's too):
        # a bf16 vLLM beside an fp32 trainer starts every PPO ratio ~1e-2 off 1
        options = {"dtype": model_cfg.dtype, "seed": model_cfg.seed,
                   **({"trust_remote_code": True} if model_cfg.trust_remote_code else {}),
                   **(options or {})}
        assert model_cfg.path is not None  # (check_engine: a preset is refused)
        # a Hub id by its cached folder: vLLM given the id would ask the Hub for it
        return VLLMEngine(str(model_folder(model_cfg.path)), sampling, **options)
    raise AssertionError(name)  # (check_engine knows every name)


class HybridEngine:
    def __init__(self, backend: Any, model_cfg: ModelConfig,
                 sampling: SamplingConfig | None = None, bucket_bytes: int = BUCKET_BYTES,
                 engine: str = "builtin", engine_options: dict[str, Any] | None = None,
                 offload_optimizer: bool = True):
        if not isinstance(offload_optimizer, bool):
            raise TypeError(f"offload_optimizer is True (the optimizer's state leaves the GPU "
                            f"while generating) or False (it stays: faster switches, more "
                            f"memory), got {offload_optimizer!r}")
        self.backend = backend
        self.offload_optimizer = offload_optimizer
        self._zero = hasattr(backend, "gathered")  # DeepSpeed ZeRO: parameters gathered in place
        self.bucket_bytes = bucket_bytes
        if engine == "vllm":  # the trainer fills vLLM before every generation: vLLM need not
            # read the checkpoint (random weights), nor keep a host copy of them asleep
            engine_options = {"load_format": "dummy", **(engine_options or {})}
            _check_covers(model_cfg.path, backend.model)
        self.engine = make_engine(engine, model_cfg, sampling, engine_options)
        # an engine filled by name takes new weights before each generation: none kept asleep
        # (level 2), unless its option says level 1 (a model holding tensors beside them)
        self._sleep_level = getattr(self.engine, "sleep_level", 2) if self.engine.owns_weights \
            else 1
        self.engine.sleep(self._sleep_level)
        self.mode = "train"
        self.peak_gather_bytes = 0  # the largest gathered tensor alive at once, last switch
        self.offloaded_bytes = 0  # fp32 masters (ZeRO) sent to the host, last switch
        self._offloaded = False  # whether the last switch to generation moved them (the
        # flag may change between switches: the way back undoes what was done)
        self._filled_once = False  # an engine filled by name: checked complete the first time
        # the trainer's load count (TrainBackend.loads) when the engine last took its frozen
        # parameters (LoRA): while it stands, they are not gathered again
        self._frozen_at: int | None = None
        self.released = False  # the engine's weights are freed (GPU, train mode)
        # where they are freed: their data in a few blocks (one dtype each), whose memory
        # goes and comes back by one call each (the parameters stay views of them)
        self._blocks = _into_blocks(self.engine.model) if self._frees_memory() else []
        self._frozen_plan: list[Any] | None = None  # gather plans, made once
        self._trained_plan: list[Any] = []
        self._gatherer = Gatherer(self._wholes)  # its buffers reused: warm memory
        self._release()  # built in train mode: the engine holds nothing until generating

    @torch.no_grad()
    def to_generate(self) -> None:
        if self.mode == "generate":
            return
        if self._frozen_plan is None and not self.engine.owns_weights:
            self._make_plans()
        try:
            # this rank's own part first, then the gathers (collectives), then the wake: every
            # rank learns of a failure on any (agree) before the next collective, so none is
            # left waiting in it (until the collective timeout) while the others go on
            agree(attempt(self._prepare), "preparing the switch to generation")
            agree(attempt(self._fill_and_wake), "filling the engine")
        except BaseException:  # still training: the engine asleep again, whatever its kind
            # (a rank whose own fill went through woke it; vLLM's first load woke its weights),
            # its memory freed again (GPU), the optimizer back where it steps (or at the next
            # to_train, which also sleeps an engine left awake, if this fails too)
            self._frozen_at = None  # (every rank: whether its own fill went through or not,
            try:  # the next switch gathers the frozen weights again, in step)
                self.engine.sleep(self._sleep_level)
            finally:
                self._release()
                self._restore_training()
            raise
        self.mode = "generate"

    def _prepare(self) -> None:
        """The optimizer's memory makes room for the engine's; the engine's weights get
        their memory back (GPU)."""
        self.offloaded_bytes = 0
        if self.offload_optimizer and not self._offloaded:  # (away still: a restore failed)
            self._offloaded = True
            self._move_optimizer("cpu")
            self.offloaded_bytes = self.backend.offload_masters()
        if self.engine.owns_weights and torch.cuda.is_available():
            torch.cuda.empty_cache()  # vLLM allocates from its own pool, not torch's cache
        if self.released:
            for block in self._blocks:
                block.untyped_storage().resize_(block.numel() * block.element_size())
            self.released = False
        if not self.engine.owns_weights:  # out of memory for them here, agreed: not in the
            self._gatherer.reserve(self._fill_plan())  # midst of the gathers

    def _fill_and_wake(self) -> None:
        self._fill_engine()
        if self.engine.owns_weights and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the fill's buffers: vLLM's KV cache is not torch's
        self.engine.wake()  # (vLLM: allocates its KV cache, which may not fit)

    def _fill_engine(self) -> None:
        """The training shards gathered, bucket by bucket, into the engine's weights."""
        if self.engine.owns_weights:
            self._fill_by_name()
            return
        self._gatherer.run(self._fill_plan())  # (ZeRO: groups gathered in place, a
        self.peak_gather_bytes = self._gatherer.peak_bytes  # collective each)
        self._frozen_at = getattr(self.backend, "loads", 0)

    def _fill_plan(self) -> list[Any]:
        """The trained parameters, and the frozen ones unless the engine holds them already
        (since the backend's last load of weights: a backend that never reloads counts 0)."""
        assert self._frozen_plan is not None
        if self._frozen_at == getattr(self.backend, "loads", 0):
            return self._trained_plan
        return self._frozen_plan + self._trained_plan

    def _fill_by_name(self) -> None:
        """An engine that owns its weights' memory (vLLM, which fuses projections) takes
        them by name: each parameter gathered whole, handed over in buckets, dropped. A LoRA
        layer's weight goes merged with its adapters (the engine has none)."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = self.peak_gather_bytes = 0
        layers = lora_layers(self.backend.model)
        failed: BaseException | None = None

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            nonlocal failed  # past a failed load the gathers go on (collectives: the peers
            if failed is None:  # are in them), nothing more is loaded; raised after them
                failed = attempt(lambda: self.engine.load_weights(pairs))

        for name, param in self.backend.model.named_parameters():
            if is_adapter(name):
                continue
            with self._whole(param) as whole:  # ZeRO's is freed after: kept as a copy
                value = whole.clone() if self._zero else whole
            layer = layers.get(name.removesuffix(".weight"))
            if layer is not None and name.endswith(".weight"):
                with self._whole(layer.lora_A.weight) as a, self._whole(layer.lora_B.weight) as b:
                    value = merge(value, a, b, layer.scaling)
            bucket.append((name, value))
            size += value.numel() * value.element_size()
            self.peak_gather_bytes = max(self.peak_gather_bytes, size)
            if size >= self.bucket_bytes:
                load(bucket)
                bucket, size = [], 0
        if bucket:
            load(bucket)
        if failed is not None:
            raise failed
        if not self._filled_once:  # from dummy weights: a name vLLM did not map stays random
            missing = self.engine.not_loaded()
            if missing:
                raise RuntimeError(f"the trainer's weights left {len(missing)} of vLLM's "
                                   f"parameters unfilled ({', '.join(missing[:4])}): vLLM "
                                   f"would generate from random weights; the trainer's model "
                                   f"and the checkpoint vLLM runs must be the same architecture")
            self._filled_once = True

    @contextmanager
    def _wholes(self, params: list[Any]) -> Iterator[list[torch.Tensor]]:
        """`params` whole for the time of the block: DeepSpeed ZeRO gathers them in place
        for a moment (one coalesced collective); FSDP2 (+ TP) gathers each DTensor into a new
        tensor."""
        if self._zero:
            with self.backend.gathered(params):
                yield [p.detach() for p in params]
        else:
            with whole_each(params) as wholes:
                yield wholes

    @contextmanager
    def _whole(self, param: Any) -> Iterator[torch.Tensor]:
        with self._wholes([param]) as (whole,):
            yield whole

    def _make_plans(self) -> None:
        """The gather plans of the frozen parameters (LoRA's: gathered once) and of the
        trained ones. The sharded parameters are the same objects for the whole run."""
        targets = dict(self.engine.model.named_parameters())
        named = list(self.backend.model.named_parameters())
        self._frozen_plan = plan_gather(((p, targets[n]) for n, p in named
                                         if not p.requires_grad), self.bucket_bytes, self._zero)
        self._trained_plan = plan_gather(((p, targets[n]) for n, p in named
                                          if p.requires_grad), self.bucket_bytes, self._zero)

    def to_train(self) -> None:
        """Back to training; every rank agrees (one small all_reduce, at every call: a rank
        left with something to undo cannot skip it while the others do) before the training
        collectives that follow, which a rank failing here alone would leave its peers in.
        A collective: call it on every rank (never from a RANK_ZERO or concurrent method)."""
        agree(attempt(self._back_to_training), "switching back to training")

    def _back_to_training(self) -> None:
        was, self.mode = self.mode, "train"  # on every rank alike, whatever fails below: what
        # failed is done again at the next call (an engine still awake slept, its memory
        # freed, the optimizer brought back); the next switch fills and wakes the engine anew
        try:
            if was == "generate" or not self.engine.asleep:
                self.engine.sleep(self._sleep_level)
        finally:
            if not self.released:
                self._release()
            self._restore_training()  # (nothing to do unless the optimizer is away)

    def _restore_training(self) -> None:
        if not self._offloaded:
            return
        # cleared once both are back: after a failure here (an OOM in a fragmented GPU) the
        # next to_train does them again (each skips what is back already)
        self.backend.reload_masters()
        self._move_optimizer(next(self.backend.model.parameters()).device)
        self._offloaded = False

    def _frees_memory(self) -> bool:
        """Whether the engine's weights are freed here (vLLM frees its own as it sleeps)."""
        return not self.engine.owns_weights and \
            next(self.engine.model.parameters()).device.type == "cuda"

    def _release(self) -> None:
        """On a GPU, free what the idle engine holds (its weights, the gather buffers) for
        training; the next switch to generation allocates them again. Meanwhile its
        parameters keep their shapes over no memory: nothing may read them (the engine
        sleeps, and refuses to generate)."""
        if not self._blocks:
            return
        for block in self._blocks:  # (as FSDP2 frees its unsharded parameters)
            block.untyped_storage().resize_(0)
        self.released = True
        self._frozen_at = None
        self._gatherer.free()

    @property
    def buffer_bytes(self) -> int:
        """What the gather buffers hold now."""
        return self._gatherer.buffer_bytes

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
    def vocab_size(self) -> int | None:
        """The engine's vocabulary (the built-in one's; None where an engine does not say):
        multi-turn observations are checked against it."""
        return getattr(self.engine, "vocab_size", None)

    @property
    def max_model_len(self) -> int | None:
        """The engine's context limit (vLLM's; None where an engine has none): multi-turn
        rows are kept within it."""
        return getattr(self.engine, "max_model_len", None)

    @property
    def continues_turns(self) -> bool:
        """Whether the engine runs multi-turn rollouts in its own loop (asyncrl.hybrid.turns)."""
        return bool(getattr(self.engine, "continues_turns", False))

    def generate(self, prompts: list[list[int]], seeds: list[int], config: Any = None,
                 **turns: Any) -> Any:
        if self.mode != "generate":
            raise RuntimeError("the hybrid engine is in train mode: call to_generate() first")
        return self.engine.generate(prompts, seeds, config, **turns)


ALIGN = 16  # bytes: each weight's offset in its block (vectorised kernels read it)
BLOCK_BYTES = 256 << 20  # an engine's weights freed and allocated in blocks up to this size
# (one call each, not one per parameter; not one block for all: a fragmented allocator cache
# finds room for such blocks where it might not for a model-sized one)


def _into_blocks(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters made views of blocks of one dtype and device each. Their
    values are not kept: the first switch to generation fills them all."""
    layout: list[tuple[Any, torch.Size, int, int]] = []  # param, shape, block, offset
    kinds: list[tuple[torch.dtype, torch.device]] = []  # each block's
    sizes: list[int] = []  # each block's elements
    filling: dict[tuple[torch.dtype, torch.device], int] = {}  # the open block of a kind
    for p in model.parameters():
        kind, b, at = (p.dtype, p.device), filling.get((p.dtype, p.device)), 0
        if b is not None:
            at = sizes[b] + -sizes[b] % max(1, ALIGN // p.element_size())
        if b is None or (at + p.numel()) * p.element_size() > BLOCK_BYTES:
            b, at = len(sizes), 0
            filling[kind] = b
            kinds.append(kind)
            sizes.append(0)
        layout.append((p, p.shape, b, at))
        sizes[b] = at + p.numel()
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # before the blocks: not both
    blocks = [torch.empty(n, dtype=dtype, device=device)
              for n, (dtype, device) in zip(sizes, kinds, strict=True)]
    for p, shape, b, at in layout:
        p.data = blocks[b][at:at + shape.numel()].view(shape)
    return blocks
