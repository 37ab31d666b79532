"""Model roles as workers, for DataFlows and drivers.

    Policy     train (FSDP2, optional TP) + generate (hybrid: the same ranks) + log-probs;
               with hybrid=False train only, its weights sent to a Rollout group (sync_pack)
    Rollout    generate only; receives weights (load_weights, also mid-generation)
    (either generator may run multi-turn rollouts with an environment: multi_turn=, see
    asyncrl.hybrid.turns)
    Reference  frozen: log-probs of given sequences (a LoRA model's without adapters; a LoRA
               Policy gives them itself: ref_logprobs)

Batches are TensorBatches with prompt_ids/prompt_mask (left-padded) and response_ids/
response_mask (prefix masks), as `generate` returns them; prompts come as a TensorBatch with
a list column "prompt" (token ids) and a column "seed". `generate` passes the prompt batch's
columns through (an "answer" the reward needs travels with its sample).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from asyncrl.actors.protocols import DP_AXIS, Dispatch
from asyncrl.actors.rank_main import collective_timeout
from asyncrl.actors.register import register
from asyncrl.actors.worker import Worker
from asyncrl.comm.batch import TensorBatch
from asyncrl.hybrid.engine import BUCKET_BYTES, HybridEngine, agree, check_engine, make_engine
from asyncrl.hybrid.export import POLICY_FILE, ModelFiles
from asyncrl.hybrid.fsdp import FSDPBackend, TrainConfig, use_bf16
from asyncrl.hybrid.gather import attempt
from asyncrl.hybrid.lora import adapters_off
from asyncrl.hybrid.micro import in_batch_order, micro_batches
from asyncrl.hybrid.models import (
    ModelConfig,
    build_model,
    default_device,
    model_file,
    sampled_at,
    sequence_logprobs,
)
from asyncrl.hybrid.sampler import GENERATED, PROMPT_WIDTH, SamplingConfig, with_overrides
from asyncrl.hybrid.settings import from_dict, own_arguments, whole_number
from asyncrl.hybrid.turns import MultiTurn, Turns, check_stops, multi_turn_config
from asyncrl.hybrid.weight_sync import (
    ALL_RANKS,
    GATHER_TO_ZERO,
    SyncSource,
    gathered,
    unpack,
    version_of,
)


def sampling_config(sampling: dict[str, Any] | None, model: ModelConfig) -> SamplingConfig:
    """A role's sampling settings; a checkpoint's model stops at its end-of-sequence tokens
    (its generation_config.json's, else its config's) beside the stop_token_ids given, as
    vLLM does (an end-of-turn token given alone let a response run on past the EOS, scored
    and trained on); stop_token_ids=[]: no stop at all."""
    given = dict(sampling or {})
    if model.path is not None:
        given["stop_token_ids"] = with_eos(given.get("stop_token_ids"), model.path)
    return from_dict(SamplingConfig, given, "sampling=")


def call_config(cfg: SamplingConfig, sampling: dict[str, Any] | None, model: ModelConfig
                ) -> SamplingConfig:
    """A role's `cfg` with one call's `sampling` changes; stop_token_ids given there keep
    the model's EOS ids beside them, as the role's do (they replaced them: a response ran on
    past its EOS)."""
    if isinstance(sampling, dict) and "stop_token_ids" in sampling and model.path is not None:
        sampling = {**sampling, "stop_token_ids": with_eos(sampling["stop_token_ids"],
                                                            model.path)}
    return with_overrides(cfg, sampling)


def with_eos(stops: Any, path: str) -> Any:
    """The stop_token_ids given with the EOS ids of the checkpoint at `path` added (none
    given: its EOS ids; [], or not a list: as given, refused later if not token ids)."""
    if stops is not None and not (isinstance(stops, list | tuple) and stops):
        return stops
    eos = eos_token_ids(path)
    return eos if stops is None else [*stops, *(t for t in eos if t not in stops)]


def eos_token_ids(path: str) -> list[int]:
    """The end-of-sequence ids a checkpoint (a directory or a cached Hub id) names (none:
    [])."""
    for name in ("generation_config.json", "config.json"):
        file = model_file(path, name)
        try:
            eos = json.loads(file.read_text()).get("eos_token_id") if file else None
        except (OSError, ValueError, AttributeError):
            continue  # not there, or not a config: the model's loading says what is wrong
        ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
        ids = [int(t) for t in ids if isinstance(t, int) and not isinstance(t, bool)]
        if ids:
            return ids
    return []


def _token_ids(prompt: Any) -> list[int] | None:
    """A prompt's token ids as Python ints: a list or tuple of whole numbers (numpy's or
    torch's integer scalars too) or a 1-D integer array or tensor; None for anything else."""
    if getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if not isinstance(prompt, list | tuple):
        return None
    ids = [t.item() if getattr(t, "ndim", None) == 0 and hasattr(t, "item") else t
           for t in prompt]
    return [int(t) for t in ids] if all(whole_number(t) for t in ids) else None


def _prompts(batch: TensorBatch) -> tuple[list[list[int]], list[int]]:
    for key in ("prompt", "seed"):
        if key not in batch:
            raise KeyError(f"generate needs a prompt batch with columns 'prompt' (token ids) "
                           f"and 'seed' (one per sample); it has {batch.keys()}")
    prompts = []
    for i, p in enumerate(batch["prompt"]):
        ids = _token_ids(p)
        if ids is None:
            raise TypeError(f"generate: prompt {i} of this rank's rows (a DP call's chunk) is "
                            f"{str(p)[:40]!r}, not a list of token ids (whole numbers); the "
                            f"engines take token ids: give the prompt source a tokenizer "
                            f"(PromptSource(..., tokenizer=DIR)) or tokenize the records first")
        prompts.append(ids)
    return prompts, [int(s) for s in batch["seed"]]


def no_generation(cfg: SamplingConfig, turns: Turns | None) -> TensorBatch:
    """A generation of no prompts: the columns, dtypes and response width of one, in the
    engines' order."""
    n, long = cfg.max_new_tokens, torch.long
    cols = {k: torch.zeros((0, 0 if k.startswith("prompt") else n),
                           dtype=torch.float32 if k == "logprobs" else long)
            for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
                      "logprobs", "versions")}
    if turns is not None:  # (Turns.generate's columns; env_timeouts with a process pool)
        cols["policy_mask"] = torch.zeros((0, n), dtype=long)
        more = ["turns", "env_truncated"] + (["env_timeouts"] if turns.pool is not None else [])
        cols.update({k: torch.zeros(0, dtype=long) for k in more})
    return TensorBatch(cols, {"temperature": cfg.temperature or 1.0})


def generate_with(engine: Any, turns: Turns | None, prompts: TensorBatch,
                  cfg: SamplingConfig) -> TensorBatch:
    """One generation of `prompts` by `engine` (a single turn, or `turns` of them), with the
    prompt batch's columns (`with_prompts`)."""
    try:
        ids, seeds = _prompts(prompts)
        if not ids:  # (a DP call's empty chunk: the engines refuse no prompts)
            out = no_generation(cfg, turns)
        elif turns is None:
            out = engine.generate(ids, seeds, cfg)
        else:
            out = turns.generate(engine, prompts, ids, seeds, cfg)
    except BaseException as e:  # (an environment that raised on one of this rank's rows, a
        agree(e, "generate")  # bad prompt in its chunk): the peers wait in with_prompts' one;
        raise  # (agree raised it already)
    return with_prompts(out, prompts, cfg.pad_token_id)


# a rollout given back as prompts (its rows generated again) holds its old generation's
# columns and the RL ones scored on it (asyncrl.rl.batch.ASSEMBLED): none is carried over
NOT_CARRIED = GENERATED | {"reward", "ref_logprobs", "values", "loss_mask",
                           "overlong_penalty", "timed_out", "crashed"}


def with_prompts(out: TensorBatch, prompts: TensorBatch, pad: int) -> TensorBatch:
    """Generation's columns beside the prompt batch's (its meta, padding marks included;
    the generation's own, its temperature, winning), the prompts left-padded to the widest
    of the group's ranks, so that the ranks' results concatenate (a collective: every rank
    of the group generates), and at least to the batch's PROMPT_WIDTH (so that separate
    calls' results concatenate too)."""
    ids, mask = out.tensor("prompt_ids"), out.tensor("prompt_mask")
    widest = agree(None, "generate", max(ids.shape[1], int(prompts.meta.get(PROMPT_WIDTH, 0))))
    more = widest - ids.shape[1]
    if more:  # the same columns in the same order: only these two grow
        wider = {"prompt_ids": torch.cat([ids.new_full((len(ids), more), pad), ids], 1),
                 "prompt_mask": torch.cat([mask.new_zeros((len(ids), more)), mask], 1)}
        out = TensorBatch({k: wider.get(k, v) for k, v in out.items()}, out.meta)
    extra = [k for k in prompts.keys() if k not in out and k not in NOT_CARRIED]
    both = out.union(prompts.select(extra)) if extra else out
    both.meta = {**prompts.meta, **out.meta}
    return both


def read_settings(role: str, model: dict[str, Any], sampling: dict[str, Any] | None,
                  multi_turn: dict[str, Any] | None, train: dict[str, Any] | None = None
                  ) -> tuple[ModelConfig, TrainConfig, SamplingConfig, MultiTurn | None]:
    """A role's settings dicts as it reads them (in __init__, and where its group is
    declared: check_settings), each checked; a Rollout's train= is unused."""
    model_cfg = from_dict(ModelConfig, model, f"{role} model=")
    sampling_cfg, turns = sampling_config(sampling, model_cfg), multi_turn_config(multi_turn)
    if turns is not None:
        check_stops(sampling_cfg)
    return model_cfg, from_dict(TrainConfig, train, f"{role} train="), sampling_cfg, turns


BACKENDS = ("fsdp2", "zero2", "zero3")


def check_backend(backend: Any) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend is one of {BACKENDS}, got {backend!r}")


def schedule_moved(backend: Any) -> Callable[[], bool]:
    """Whether the backend's optimizer has stepped since this call (its schedule steps with
    it), whatever returned or raised: ZeRO steps inside the last backward, so a train step
    failing after it (the statistics' all_reduce, the grad norm) leaves the weights moved, a
    new version (Policy, Actor and Critic count so)."""
    steps = backend.sched.last_epoch
    return lambda: bool(backend.sched.last_epoch != steps)


def make_backend(worker: Worker, backend: str, model_cfg: ModelConfig, train_cfg: TrainConfig,
                 head: str = "lm") -> Any:
    """The training backend named in a role's config: "fsdp2", "zero2" or "zero3"."""
    check_backend(backend)
    if backend == "fsdp2":
        return FSDPBackend(model_cfg, train_cfg, worker.device_mesh, head)
    wide = {axis: n for axis, n in worker.mesh.items() if axis != DP_AXIS and n > 1}
    if wide:  # else each tp rank would repeat the others' work, unsaid
        raise ValueError(f"backend={backend!r} (DeepSpeed ZeRO) shards over data-parallel "
                         f"ranks only; the group's mesh {worker.mesh} has {wide}: use "
                         f"backend='fsdp2' for tensor parallelism, or mesh={{'dp': "
                         f"{worker.world_size}}}")
    from asyncrl.hybrid.zero import ZeroBackend

    return ZeroBackend(model_cfg, train_cfg, stage=int(backend[-1]), head=head)


def check_policy_arguments(role: str, given: dict[str, Any]) -> None:
    """A Policy's (or Actor's) arguments as its __init__ reads them, where the group is
    declared: a mistake there failed every rank's __init__ after the groups had started."""
    model_cfg, _, sampling_cfg, _ = read_settings(
        role, given["model"], given["sampling"], given["multi_turn"], given["train"])
    check_backend(given["backend"])
    check_generates(given["hybrid"], given["multi_turn"])
    if given["hybrid"]:
        check_engine(given["engine"], given["engine_options"], model_cfg, sampling_cfg)


def check_generates(hybrid: bool, multi_turn: Any) -> None:
    if multi_turn is not None and not hybrid:
        raise ValueError("multi_turn= is for a Policy that generates: a hybrid=False one "
                         "only trains; give multi_turn= to its Rollout group")


def engine_config(model_cfg: ModelConfig, train_cfg: TrainConfig) -> ModelConfig:
    """The model an engine builds, computing as the trainer does: a bf16 trainer's log-probs
    from an fp32 engine would differ by ~1e-3 (the first PPO ratio not 1), at twice its
    memory."""
    if use_bf16(train_cfg) and model_cfg.dtype == "float32":
        return replace(model_cfg, dtype="bfloat16")
    return model_cfg


class Policy(Worker):
    # how long a step waits for rollouts to pull the last sync_pack (a subclass may change it)
    sync_release_timeout = 300.0

    def __init__(self, model: dict[str, Any], train: dict[str, Any] | None = None,
                 sampling: dict[str, Any] | None = None, bucket_bytes: int = BUCKET_BYTES,
                 backend: str = "fsdp2", hybrid: bool = True, engine: str = "builtin",
                 engine_options: dict[str, Any] | None = None,
                 multi_turn: dict[str, Any] | None = None, offload_optimizer: bool = True):
        model_cfg, train_cfg, sampling_cfg, turns = read_settings(
            type(self).__name__, model, sampling, multi_turn, train)
        check_generates(hybrid, turns)  # (before the trainer is built)
        self.backend = make_backend(self, backend, model_cfg, train_cfg)
        self.model_cfg = model_cfg
        # noted in checkpoints, for `asyncrl export`: read now, while the source is there
        self._model_files = ModelFiles.read(model_cfg) if self.rank == 0 else None
        self.hybrid = HybridEngine(self.backend, engine_config(model_cfg, train_cfg),
                                   sampling_cfg, bucket_bytes, engine, engine_options,
                                   offload_optimizer) if hybrid else None
        self.turns = Turns(turns) if turns is not None else None
        self.version = 0  # the policy version: updates applied (train_step, Actor.update)
        self.sync_source = SyncSource()
        self.bucket_bytes = bucket_bytes

    @classmethod
    def check_settings(cls, *args: Any, **kwargs: Any) -> None:
        """The arguments read as __init__ reads them, where the group is declared."""
        given = own_arguments(cls, Policy.__init__, args, kwargs)
        if given is not None:
            check_policy_arguments(cls.__name__, given)

    def to_train(self) -> None:
        if self.hybrid is not None:
            self.hybrid.to_train()

    def on_close(self) -> None:
        if self.turns is not None:  # its environment's processes, if any
            self.turns.close()

    def before_weights_change(self, timeout: float | None = None) -> float:
        """Wait until rollouts pulled the last sync_pack (on CPUs views of the live weights;
        on a GPU a copy, and the wait keeps one at a time); the seconds waited (default:
        sync_release_timeout). A collective: rank 0 alone holds packs, and its timeout fails
        its peers too (they waited in the step's first all_gather until the collective
        timeout, and the group's collectives were out of step after it)."""
        waited = [0.0]
        # within the collective timeout: the peers wait in agree's all_reduce meanwhile
        limit = min(self.sync_release_timeout if timeout is None else timeout,
                    0.8 * collective_timeout())

        def wait() -> None:
            waited[0] = self.sync_source.wait_released(limit)
        agree(attempt(wait), "waiting for the last sync_pack to be released")
        return waited[0]

    @register(dispatch=Dispatch.DP)
    def generate(self, prompts: TensorBatch, sampling: dict[str, Any] | None = None
                 ) -> TensorBatch:
        """Responses to `prompts`; `sampling` changes settings for this call only (e.g.
        {"temperature": 0} for greedy validation)."""
        if self.hybrid is None:
            raise RuntimeError(f"group {self.group_name!r} was built with hybrid=False: it only "
                               f"trains; generate on a Rollout group that receives its weights")
        cfg = call_config(self.hybrid.engine.config, sampling, self.model_cfg)
        self.hybrid.to_generate()
        self.hybrid.engine.version = self.version
        return generate_with(self.hybrid, self.turns, prompts, cfg)

    @register(dispatch=Dispatch.DP)
    def logprobs(self, batch: TensorBatch) -> TensorBatch:
        self.to_train()
        return TensorBatch({"logprobs": self.backend.logprobs(batch).cpu()})

    @register(dispatch=Dispatch.DP)
    def ref_logprobs(self, batch: TensorBatch) -> TensorBatch:
        """The frozen model's log-probs, this LoRA policy's adapters off: a reference with no
        Reference group (verl's reference in the actor), as Reference.logprobs gives them."""
        lora = self.model_cfg.lora
        if lora is None or lora.modules_to_save:  # their training is not undone
            raise ValueError(f"group {self.group_name!r}: ref_logprobs needs a LoRA model "
                             f"whose adapters alone train (model={{..., 'lora': {{'rank': "
                             f"16}}}}, no modules_to_save); this policy's reference is a "
                             f"Reference group (given the same model=, it builds the model "
                             f"without adapters)")
        self.to_train()
        with adapters_off(self.backend.model):
            return TensorBatch({"logprobs": self.backend.logprobs(batch).cpu()})

    @register(dispatch=Dispatch.DP)
    def train_step(self, batch: TensorBatch) -> dict:
        self.to_train()
        self.before_weights_change()
        moved = schedule_moved(self.backend)
        try:
            return self.backend.train_step(batch)
        finally:  # a step taken, failing after it too (ZeRO steps inside the last backward):
            if moved():  # no rows anywhere took none, and the weights are the version's
                self.version += 1

    @register(dispatch=GATHER_TO_ZERO)
    def sync_pack(self) -> TensorBatch | None:
        """The full weights, tagged with the policy version, packed for a Rollout group's
        `load_weights` (a collective: every rank gathers; rank 0's pack is the result). A
        LoRA model's trained parameters only (adapters, modules_to_save): the rollout holds
        the same frozen model."""
        self.to_train()
        start = time.perf_counter()
        if hasattr(self.backend, "gathered"):  # ZeRO: gathered one by one, kept on rank 0;
            # parameters only (not buffers: the engine has its own), tied ones once
            params = dict(self.backend.model.named_parameters())
            named: Any = [(n, v) for n, v in self.backend.state_dict(
                everywhere=False, trained=True).items() if n in params]
        else:  # FSDP2: the small ones in buckets, the large ones one by one
            named = gathered([(n, p) for n, p in self.backend.model.named_parameters()
                              if p.requires_grad], self.bucket_bytes)
        if self.rank != 0:  # its part in the gathers (collectives), each whole let go at
            for _ in named:  # once: nothing to send
                pass
            return None
        # (failing, it still reads `named` to its end: the other ranks' gathers go on)
        pack = self.sync_source.pack(named, self.version)
        pack.meta["pack_s"] = time.perf_counter() - start  # gathering and packing
        if self.model_cfg.lora is not None:  # the receiver's must be this frozen model
            pack.meta["frozen_model"] = self.model_cfg.frozen_model()
        else:  # every weight (none frozen by the user): the receiver's must all be filled
            pack.meta["whole"] = all(p.requires_grad for p in self.backend.model.parameters())
        return pack

    @register
    def weights(self, layout: str = "train") -> dict[str, torch.Tensor]:
        """Full weights as training holds them, or as the generation engine holds them."""
        if layout == "engine":
            if self.hybrid is None:
                raise ValueError(f"group {self.group_name!r} was built with hybrid=False: it "
                                 f"has no generation engine; use layout='train' (the weights "
                                 f"a Rollout group receives by sync_pack)")
            if self.hybrid.mode == "train":  # what the next generation runs on: the trained
                self.hybrid.to_generate()  # weights (the engine may hold an older switch's)
            return {k: v.detach().clone() for k, v in self.hybrid.engine.state_dict().items()}
        if layout != "train":
            raise ValueError(f"layout is 'train' or 'engine', got {layout!r}")
        return self.backend.state_dict()

    # -- checkpoints: weights, optimizer, schedule and version (a Policy that trains, an
    # Actor) -- without them a resumed or restarted one came back as freshly built -----------
    def save_state(self, folder: Path) -> None:
        self.to_train()
        self.backend.save(folder / "train")
        if self.rank == 0:
            torch.save({"version": self.version}, folder / POLICY_FILE)
            assert self._model_files is not None
            self._model_files.save(folder)

    def load_state(self, folder: Path) -> None:
        self.to_train()
        self.before_weights_change()  # a rollout may still be pulling a pack of the weights
        self.backend.load(folder / "train")
        self.version = int(torch.load(folder / POLICY_FILE, weights_only=True)["version"])

    @register
    def switch_report(self) -> dict:
        """Where the last switch stood: its mode, the largest tensor it gathered and the fp32
        master bytes it sent to the host (ZeRO)."""
        assert self.hybrid is not None, "a hybrid=False Policy does not switch"
        return {"mode": self.hybrid.mode, "peak_gather_bytes": self.hybrid.peak_gather_bytes,
                "offloaded_bytes": self.hybrid.offloaded_bytes}


def check_rollout_engine(engine: str, model_cfg: ModelConfig) -> None:
    """What a Rollout's engine cannot run (in __init__, and where its group is declared)."""
    if model_cfg.lora is not None and engine != "builtin":
        raise ValueError(f"a Rollout group with engine={engine!r} and a LoRA model is not "
                         f"supported yet (its weight syncs carry the adapters alone, "
                         f"which only the built-in engine applies); use engine='builtin', "
                         f"or a hybrid Policy, whose switch merges them for vLLM")


class Rollout(Worker):
    def __init__(self, model: dict[str, Any], sampling: dict[str, Any] | None = None,
                 engine: str = "builtin", engine_options: dict[str, Any] | None = None,
                 multi_turn: dict[str, Any] | None = None):
        self.model_cfg, _, sampling_cfg, turns = read_settings(type(self).__name__, model,
                                                               sampling, multi_turn)
        check_rollout_engine(engine, self.model_cfg)
        # vLLM as the default trainer computes (a Policy's engine follows its own trainer)
        engine_cfg = engine_config(self.model_cfg, TrainConfig()) if engine == "vllm" else \
            self.model_cfg
        self.engine = make_engine(engine, engine_cfg, sampling_cfg, engine_options)
        self.turns = Turns(turns) if turns is not None else None
        self._loading = threading.Lock()

    @classmethod
    def check_settings(cls, *args: Any, **kwargs: Any) -> None:
        """As Policy.check_settings: where the group is declared."""
        given = own_arguments(cls, Rollout.__init__, args, kwargs)
        if given is not None:
            model_cfg, _, sampling_cfg, _ = read_settings(
                cls.__name__, given["model"], given["sampling"], given["multi_turn"])
            check_engine(given["engine"], given["engine_options"], model_cfg, sampling_cfg)
            check_rollout_engine(given["engine"], model_cfg)

    def on_close(self) -> None:
        if self.turns is not None:  # its environment's processes, if any
            self.turns.close()

    @register(dispatch=Dispatch.DP)
    def generate(self, prompts: TensorBatch, sampling: dict[str, Any] | None = None
                 ) -> TensorBatch:
        """As Policy.generate."""
        return generate_with(self.engine, self.turns, prompts,
                             call_config(self.engine.config, sampling, self.model_cfg))

    @register(dispatch=ALL_RANKS, concurrent=True)
    def load_weights(self, weights: TensorBatch | dict[str, torch.Tensor],
                     version: int | None = None) -> dict[str, float]:
        """New weights: a Policy's `sync_pack()` (its version with it) or a dict. Runs beside
        a generation in flight, which continues with them from its next token."""
        start = time.perf_counter()
        if isinstance(weights, TensorBatch):
            version = version_of(weights) if version is None else version
        elif version is None:  # the tokens sampled from now on would carry the old one
            raise ValueError("Rollout.load_weights(dict): give version= (the policy version "
                             "of these weights): every token is tagged with it")
        with self._loading:  # concurrent loads on the pool: an older one never lands last
            if version < self.engine.version:
                return {"sync/version": float(self.engine.version), "sync/stale": 1.0}
            if isinstance(weights, TensorBatch):  # the pulled buffer becomes the weights
                frozen = weights.meta.get("frozen_model")  # (a LoRA trainer's: adapters)
                self._check_frozen_model(frozen)
                nbytes = int(weights.meta["nbytes"])
                count = self.engine.adopt_weights(unpack(weights), version,
                                                  whole=bool(weights.meta.get("whole")))
            else:
                nbytes = sum(t.numel() * t.element_size() for t in weights.values())
                count = self.engine.load_weights(weights.items(), version)
        out = {"sync/version": float(self.engine.version), "sync/tensors": float(count),
               "sync/bytes": float(nbytes), "sync/load_s": time.perf_counter() - start}
        if isinstance(weights, TensorBatch) and "pack_s" in weights.meta:
            out["sync/pack_s"] = float(weights.meta["pack_s"])
        return out

    def _check_frozen_model(self, theirs: dict[str, Any] | None) -> None:
        """A LoRA trainer sends adapters alone: they mean something only on its frozen model;
        a trainer without LoRA (None) sends plain weights, which no LoRA model takes (its
        adapters would be left out: an error that blamed tie_word_embeddings)."""
        ours = self.model_cfg.frozen_model() if self.model_cfg.lora is not None else None
        if ours != theirs:
            sent = f"LoRA adapters for the frozen model {theirs}" if theirs is not None else \
                "the weights of a model without LoRA"
            raise ValueError(f"the trainer sends {sent}, but this Rollout holds "
                             f"{ours or 'a model without LoRA'}: give both groups the same "
                             f"model={{...}} (preset or path, seed, overrides, lora)")

    # -- checkpoints: the weights received and their version (rank 0 writes, all read) --------
    def save_state(self, folder: Path) -> None:
        if self.rank == 0:
            with self._loading:  # (a load beside it: weights and version of one pack)
                torch.save({"weights": self.engine.state_dict(),
                            "version": self.engine.version}, folder / "rollout.pt")

    def load_state(self, folder: Path) -> None:
        state = torch.load(folder / "rollout.pt", map_location="cpu", weights_only=True)
        self.engine.load_state_dict(state["weights"], int(state["version"]))


def _reference_settings(model: dict[str, Any], micro_batch_size: int | None,
                        max_tokens_per_micro_batch: int | None, bf16: bool | None = None
                        ) -> tuple[ModelConfig, TrainConfig]:
    # a LoRA model's reference is its frozen model: the adapters start as no change
    if not isinstance(model, dict):
        raise TypeError(f"Reference model= is a dict (preset or path, ...), got "
                        f"{type(model).__name__}")
    cfg = from_dict(ModelConfig, {**model, "lora": None}, "Reference model=")
    train = scoring_sizes("Reference", micro_batch_size, max_tokens_per_micro_batch, bf16)
    return engine_config(cfg, train), train  # (computing as a bf16 trainer does: bf16 too)


def scoring_sizes(role: str, micro_batch_size: int | None,
                  max_tokens_per_micro_batch: int | None, bf16: bool | None = None
                  ) -> TrainConfig:
    """A scoring role's micro-batch sizes (Reference's, RewardModel's; micro_batch_size None:
    a rank's rows at once), checked as a TrainConfig checks training's, named as given."""
    try:
        return TrainConfig(micro_batch_size=1 if micro_batch_size is None else micro_batch_size,
                           max_tokens_per_micro_batch=max_tokens_per_micro_batch, bf16=bf16)
    except ValueError as e:
        raise ValueError(str(e).replace("TrainConfig.", f"{role} ")) from None


class Reference(Worker):
    """A frozen copy of a model; each rank scores its rows in micro-batches of
    `micro_batch_size` rows (4 by default, as training's; None: all at once, whose
    full-vocabulary log-probs a real model's batch may not fit in memory) or of
    `max_tokens_per_micro_batch` tokens (as TrainConfig's). `bf16` as a trainer's
    (`train={"bf16": ...}`; None: as a trainer's default, on the GPUs that support it): an
    fp32 model's log-probs beside a bf16 trainer's put the KL ~1e-4 a token above 0 before
    any update. A trainer given bf16=False wants its Reference given bf16=False too (it does
    not see the trainer's settings)."""

    def __init__(self, model: dict[str, Any], micro_batch_size: int | None = 4,
                 max_tokens_per_micro_batch: int | None = None, bf16: bool | None = None):
        cfg, self.sizes = _reference_settings(model, micro_batch_size,
                                              max_tokens_per_micro_batch, bf16)
        self.model = build_model(cfg).to(default_device())
        self.whole = micro_batch_size is None

    @classmethod
    def check_settings(cls, *args: Any, **kwargs: Any) -> None:
        """As Policy.check_settings: where the group is declared."""
        given = own_arguments(cls, Reference.__init__, args, kwargs)
        if given is not None:
            _reference_settings(given["model"], given["micro_batch_size"],
                                given["max_tokens_per_micro_batch"], given["bf16"])

    @register(dispatch=Dispatch.DP)
    @torch.no_grad()
    def logprobs(self, batch: TensorBatch) -> TensorBatch:
        # no parameters gathered from other ranks: each rank cuts its rows its own way
        micros, order = micro_batches(
            batch, max(len(batch), 1) if self.whole else self.sizes.micro_batch_size,
            self.sizes.max_tokens_per_micro_batch, agree=False)
        return TensorBatch({"logprobs": in_batch_order([sequence_logprobs(
            self.model, m.tensor("prompt_ids"), m.tensor("prompt_mask"),
            m.tensor("response_ids"), m.tensor("response_mask"),
            temperature=sampled_at(batch)).cpu() for m in micros], order, batch)})
