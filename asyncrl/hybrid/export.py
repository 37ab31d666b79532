"""A trained policy as a Hugging Face model directory: config.json, model.safetensors and the
tokenizer files of the model it started from; what transformers, vLLM and SGLang load.

    asyncrl export RUN_DIR OUT [--group actor] [--dtype bfloat16]

reads a run's newest checkpoint (or the step_* folder given) in this one process, with no
group running, as verl's model merger does: an FSDP2 checkpoint with
torch.distributed.checkpoint (whatever its layout: dp, tp), a ZeRO-2/3 one with DeepSpeed's
zero_to_fp32. The weights are those training steps (its fp32 masters under ZeRO), in
`dtype`, else the source checkpoint's dtype, else the one it trained in. A Policy (an Actor)
writes what else an export needs into each checkpoint: its ModelConfig (MODEL_FILE), the
model's config and its source's tokenizer files (HF_FOLDER), so that neither the source
directory nor the flow file is needed again.

A LoRA policy is written merged (W + (alpha / rank) B A: a plain model), and its adapters
beside it in peft's format (ADAPTER_FOLDER: adapter_config.json, adapter_model.safetensors),
which peft and vLLM's LoRA serving load onto the model it started from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from asyncrl.actors.worker import sync_dir, sync_tree
from asyncrl.hybrid.lora import is_adapter, legacy_adapter_names, merge_dtype, merged
from asyncrl.hybrid.models import DROPOUT, ModelConfig, hf_config, model_folder
from asyncrl.hybrid.zero import TAG, globless

MODEL_FILE = "model.json"  # the group's ModelConfig, in its checkpoint folder
HF_FOLDER = "hf"  # beside it: the model's config.json and its tokenizer files
ADAPTER_FOLDER = "lora_adapter"  # in an export of a LoRA policy: its adapters, peft's format
EXPORT_DTYPES = ("float16", "bfloat16", "float32", "float64")  # what --dtype may name
POLICY_FILE = "actor.pt"  # what a Policy's checkpoint holds besides its trainer's state
# a source checkpoint's files that travel with the weights (tokenizers, chat templates)
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                   "merges.txt", "chat_template.*", "preprocessor_config.json",
                   "generation_config.json", "tekken.json", "*.tiktoken", "*.model",
                   # named templates (tool use), a folder of transformers' own
                   "additional_chat_templates/*",
                   "*.py")  # a model with code of its own (trust_remote_code): its code


@dataclasses.dataclass
class ModelFiles:
    """What an export needs besides the weights, for a Policy's checkpoint folder: the
    ModelConfig (MODEL_FILE) and, in HF_FOLDER, the model's config as given and its source's
    tokenizer files (so the export needs neither the source directory nor the flow file).
    Read once, as the Policy starts: its checkpoints need the source no longer either (a
    scratch folder cleaned, a "latest" link moved to another model mid-run)."""

    given: dict[str, Any]
    config: Any  # transformers' PretrainedConfig, dropout and all
    extra: dict[str, bytes]  # its tokenizer, chat template and generation settings

    @staticmethod
    def read(cfg: ModelConfig) -> ModelFiles:
        given = dataclasses.asdict(cfg)
        source = None if cfg.path is None else model_folder(cfg.path)
        if source is not None:
            given["path"] = str(source)
        extra = {} if source is None else {
            file.relative_to(source).as_posix(): file.read_bytes()
            for pattern in TOKENIZER_FILES for file in source.glob(pattern)
            if file.is_file()}
        return ModelFiles(given, hf_config(cfg, dropout_off=False), extra)

    def save(self, folder: Path) -> None:
        (folder / MODEL_FILE).write_text(json.dumps(self.given, indent=1))
        hf = folder / HF_FOLDER
        self.config.save_pretrained(hf)
        for name, data in self.extra.items():
            (hf / name).parent.mkdir(exist_ok=True)
            (hf / name).write_bytes(data)


def save_model_files(folder: Path, cfg: ModelConfig) -> None:
    """ModelFiles of `cfg`, read now, into `folder`."""
    ModelFiles.read(cfg).save(folder)


def checkpoint_folder(path: Path) -> Path:
    """`path` itself when it is a checkpoint (step_* with meta.json), else the newest complete
    checkpoint of the run directory `path` (or of the run whose checkpoints folder it is)."""
    from asyncrl.controller.checkpoint import CHECKPOINTS, latest

    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    if path.is_file():
        raise ValueError(f"{path} is a file; give a run directory (the --run-dir of asyncrl "
                         f"launch) or one of its checkpoints/step_* folders")
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist; give a run directory (the --run-dir "
                                f"of asyncrl launch) or one of its checkpoints/step_* folders")
    found = latest(path)
    if found is None and path.name == CHECKPOINTS:  # the run's folder of checkpoints
        found = latest(path.parent)
    if found is None:
        raise FileNotFoundError(f"{path} holds no complete checkpoint (checkpoints/step_*/meta"
                                f".json): a run writes one after its last step and every "
                                f"--checkpoint-every N steps")
    return found


def policy_groups(checkpoint: Path) -> list[str]:
    return sorted(p.parent.name for p in checkpoint.glob(f"*/{POLICY_FILE}"))


def pick_group(checkpoint: Path, group: str | None) -> Path:
    """The folder of the policy group `group` (None: the only one there is)."""
    policies = policy_groups(checkpoint)
    if group is None:
        if len(policies) != 1:
            raise ValueError(f"{checkpoint} holds {len(policies)} policy groups "
                             f"({policies or 'none'}): name one with --group")
        group = policies[0]
    folder = checkpoint / group
    if group not in policies:
        held = sorted(p.name for p in checkpoint.iterdir() if p.is_dir())
        what = "holds no policy (a critic, reward or reference group?)" if folder.is_dir() \
            else "is not in it"
        raise ValueError(f"group {group!r} {what}; the groups in {checkpoint}: {held}, of "
                         f"which policies (Policy, Actor): {policies}")
    if not (folder / MODEL_FILE).is_file() or not (folder / HF_FOLDER / "config.json").is_file():
        raise ValueError(f"{folder} has no {MODEL_FILE} or {HF_FOLDER}/config.json "
                         f"(checkpoints written before asyncrl export existed do not "
                         f"describe their model); resume the run for one step with this "
                         f"version to write a checkpoint that does")
    return folder


def trained_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The full weights in a Policy group's checkpoint folder, by the model's names."""
    train = folder / "train"
    if (train / TAG).is_dir():  # DeepSpeed: <tag>/ with each rank's partitions
        try:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError as e:
            raise ValueError(f"{folder} was written by DeepSpeed ZeRO, whose files only "
                             f"DeepSpeed reads: pip install 'asyncrl[deepspeed]' ({e})") from e
        with globless(train) as plain:  # (it globs the path it is given)
            return _current_names(dict(get_fp32_state_dict_from_zero_checkpoint(plain,
                                                                                  tag=TAG)))
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(train)).read_metadata().state_dict_metadata
    model = {key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in saved.items() if key.startswith("model.")
             and isinstance(meta, dcp.metadata.TensorStorageMetadata)}
    if not model:
        raise ValueError(f"{train} holds no model weights (an FSDP2 checkpoint has "
                         f"model.* entries)")
    with warnings.catch_warnings():  # one process on purpose, which DCP warns of
        warnings.filterwarnings("ignore", message=".*in a single process")
        dcp.load({"model": model}, checkpoint_id=str(train), no_dist=True)  # read in place
    return _current_names(model)


def _current_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An earlier LoRA run's adapters (`<layer>.lora_A`, FSDP2's or ZeRO's checkpoint) by
    today's names, peft's (`<layer>.lora_A.weight`)."""
    for name in legacy_adapter_names(list(weights)):
        weights[f"{name}.weight"] = weights.pop(name)
    return weights


class DestinationError(ValueError, OSError):
    """OUT cannot be written: an OSError (what it is) and a ValueError (what the CLI says in
    a line)."""


def export(path: Path, out: Path, group: str | None = None,
           dtype: str | None = None) -> dict[str, Any]:
    """Write the policy of checkpoint (or run directory) `path` as a Hugging Face model
    directory `out` (new or empty: nothing is overwritten) in `dtype` (default: the source
    checkpoint's, else the one it trained in); what was written, and `notes` to tell."""
    # transformers imports DeepSpeed where it is installed, which guesses its accelerator
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    from safetensors import SafetensorError
    from transformers import AutoConfig

    out = Path(out).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder: export writes a new "
                              f"one (nothing is overwritten); give another path")
    checkpoint = checkpoint_folder(path)
    folder = pick_group(checkpoint, group)
    cfg = ModelConfig(**json.loads((folder / MODEL_FILE).read_text()))
    config = AutoConfig.from_pretrained(folder / HF_FOLDER, local_files_only=True,
                                        trust_remote_code=cfg.trust_remote_code)
    target = _dtype(dtype, config, cfg)
    # made before minutes of reading: an OUT that cannot be written fails at once
    created, tmp = _destination(out)
    try:
        model, adapters = _trained_model(folder, cfg, config, target)
        try:
            _write(tmp, model, folder, cfg, adapters)
            sync_tree(tmp)  # on disk before its final name: a crash leaves no cut-short OUT
            os.replace(tmp, out)  # onto an empty folder, or none
            sync_dir(out.parent)
        # a full disk, a folder made read-only meanwhile (safetensors' writes fail so too)
        except (OSError, SafetensorError) as e:
            if not _writing(e, tmp):  # (not the checkpoint's files, read)
                raise
            raise _destination_error(out, e) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise
    return {"out": str(out), "checkpoint": str(checkpoint), "group": folder.name,
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(target).removeprefix("torch."), "notes": _notes(cfg)}


def _destination(out: Path) -> tuple[list[Path], Path]:
    """The folders made for `out` (its missing parents, deepest first) and the hidden
    temporary folder beside it that the export is written into."""
    created = [p for p in out.parents if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return created, Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    except OSError as e:
        _remove_empty(created)
        raise _destination_error(out, e) from e


def _destination_error(out: Path, e: Exception) -> DestinationError:
    """`e`: an OSError, or safetensors' SafetensorError (its words alone, no errno)."""
    # "File exists" of a parent that is a file reads as if OUT existed: name the file
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    file = getattr(e, "filename2", None) or getattr(e, "filename", None) or out.parent
    why = f"{blocking} is a file, not a folder" if blocking is not None else \
        f"{getattr(e, 'strerror', None) or e}: {file}"
    return DestinationError(f"cannot write the export {out}: {why}; give an OUT whose folder "
                            f"can be written (and has room for the model)")


def _writing(e: Exception, tmp: Path) -> bool:
    """Whether `e` is of writing the export: of a file in `tmp`, or of no file (a write's
    ENOSPC, a folder's fsync); a SafetensorError of its I/O (not one of the tensors)."""
    if not isinstance(e, OSError):
        return "I/O error" in str(e)
    return not isinstance(e.filename, str) or Path(e.filename).resolve().is_relative_to(tmp)


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders an export made (deepest first), down to one not empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _trained_model(folder: Path, cfg: ModelConfig, config: Any,
                   target: torch.dtype) -> tuple[Any, dict[str, torch.Tensor]]:
    """The model of Policy checkpoint `folder` in the export's dtypes, and a LoRA policy's
    adapters (what trained, for peft's file)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=target,
                                                 trust_remote_code=cfg.trust_remote_code)
    dtypes = _export_dtypes(model, target)
    weights = trained_weights(folder)
    lora = cfg.lora
    adapters: dict[str, torch.Tensor] = {}
    if lora is not None:  # merged in place, a layer at a time, rounded once into its dtype
        adapters = {k: v for k, v in weights.items() if is_adapter(k) or lora.trains_whole(k)}
        for name, value in merged(weights, lora, merge_dtype(target)):  # (fp64 kept)
            weights[name] = value.to(dtypes.get(name, target))  # (never two copies)
        for name in [k for k in weights if is_adapter(k)]:
            del weights[name]
    missing = _needed(model) - set(weights)
    unexpected = set(weights) - set(model.state_dict())
    if missing or unexpected:
        raise ValueError(f"{folder}: the checkpoint's weights do not fit the model of "
                         f"{MODEL_FILE}: missing {sorted(missing)[:5]}, unexpected "
                         f"{sorted(unexpected)[:5]}")
    for name, value in weights.items():  # one tensor at a time: never two copies of the model
        if value.is_floating_point():
            weights[name] = value.to(dtypes[name])
    model.load_state_dict(weights, strict=False, assign=True)  # (each tensor's dtype kept)
    del weights
    model.tie_weights()  # a tied name the checkpoint left out shares its twin's tensor
    return model, adapters


def _export_dtypes(model: Any, target: torch.dtype) -> dict[str, torch.dtype]:
    """Each state-dict name's dtype in the export, as from_pretrained(dtype=target) gives it
    (what the policy trained with): fp32 where transformers' dtype plan keeps a module so
    (_keep_in_fp32_modules_strict: a MoE router; rounded to bf16, it routes otherwise),
    matched as its loader matches; else the dtype `model` (built in `target`) has it in."""
    plan_of = getattr(model, "_get_dtype_plan", None)  # (transformers 5)
    plan = plan_of(target) if plan_of is not None else {}
    # the loader's match: each glob, its * as .*, searched anywhere in the name
    patterns = [(re.compile(glob.replace("*", ".*")), kept) for glob, kept in plan.items()]
    return {name: next((kept for pattern, kept in patterns if pattern.search(name)),
                       tensor.dtype)
            for name, tensor in model.state_dict().items()}


def _write(tmp: Path, model: Any, folder: Path, cfg: ModelConfig,
           adapters: dict[str, torch.Tensor]) -> None:
    """The export's files into `tmp`: the model, its tokenizer's files, a LoRA policy's
    adapters; readable as config.json is."""
    model.save_pretrained(tmp, max_shard_size="5GB")  # (verl's, the Hub's size)
    for file in (folder / HF_FOLDER).iterdir():  # the tokenizer's files, if any
        if file.is_dir():
            shutil.copytree(file, tmp / file.name)
        elif file.name != "config.json":
            shutil.copy2(file, tmp / file.name)
    if cfg.lora is not None:
        _save_adapter(tmp / ADAPTER_FOLDER, adapters, cfg)
    # safetensors writes its file owner-only: every file as config.json (the umask's)
    mode = (tmp / "config.json").stat().st_mode & 0o777
    for file in tmp.rglob("*"):
        file.chmod(mode if file.is_file() else mode | (mode & 0o444) >> 2)
    tmp.chmod(mode | (mode & 0o444) >> 2)  # mkdtemp's is owner-only: x where r


def _changed_source(cfg: ModelConfig) -> list[str]:
    """The overrides that make the policy another model than its source directory's: not
    those of how it computes (attn_implementation, use_cache, output_*) or trains (dropout,
    off in evaluation), which leave its weights' function as it was."""
    return sorted(k for k in cfg.overrides if k not in ("attn_implementation", "use_cache")
                  and not k.startswith("output_") and not DROPOUT.search(k))


def _notes(cfg: ModelConfig) -> list[str]:
    """What the user of an export must know beyond what was written."""
    changed = {k: cfg.overrides[k] for k in _changed_source(cfg)}
    if cfg.lora is None or cfg.path is None or not changed:
        return []
    return [f"{ADAPTER_FOLDER}/adapter_config.json names no base model "
            f"(base_model_name_or_path): the policy's overrides {changed} change the model "
            f"of {cfg.path}, which peft would load without them; to use the adapters, load "
            f"AutoModelForCausalLM.from_pretrained({cfg.path!r}, **{changed}) and give it to "
            f"peft's PeftModel.from_pretrained"]


def _save_adapter(out: Path, adapters: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """A LoRA policy's adapters as peft saves them: `base_model.model.<layer>.lora_A.weight`
    and adapter_config.json (base_model_name_or_path: the checkpoint it started from, None
    when overrides changed that model: peft would load it without them, another model)."""
    from safetensors.torch import save_file

    lora = cfg.lora
    assert lora is not None
    out.mkdir()
    # in the dtype they trained in (fp32 adapters: peft saves them so on a bf16 base; the
    # merged model beside them is rounded once, to the export's dtype)
    save_file({f"base_model.model.{k}": v.contiguous() for k, v in adapters.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    layers = sorted({k.rsplit(".", 3)[-3] for k in adapters if is_adapter(k)})
    # the saved modules by their whole paths: peft matches a name by its end ("norm" would
    # take every layer's input_layernorm too, and find no weights for them)
    saved = sorted({k.rsplit(".", 1)[0] for k in adapters if not is_adapter(k)})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
        "lora_alpha": lora.alpha, "target_modules": layers, "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "modules_to_save": saved or None,
        "base_model_name_or_path": os.path.abspath(cfg.path)
        if cfg.path and not _changed_source(cfg) else None}, indent=1))


def _dtype(asked: str | None, config: Any, cfg: ModelConfig) -> torch.dtype:
    """The export's dtype: the one asked for, else the source checkpoint's (its config), else
    the one the model trained in."""
    # transformers 5 names it dtype (torch_dtype warns there), earlier releases torch_dtype
    source = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    name = asked or (str(source).removeprefix("torch.") if source else cfg.dtype)
    # float8 and the like are floating too, but transformers fails deep inside on them
    target = getattr(torch, name, None)  # (an alias, "half", as a model's dtype takes it)
    if not isinstance(target, torch.dtype) or str(target).removeprefix("torch.") not in \
            EXPORT_DTYPES:
        raise ValueError(f"dtype {name!r} is not a floating torch dtype an export writes "
                         f"(float32, bfloat16, float16, float64)")
    return target


def _needed(model: torch.nn.Module) -> set[str]:
    """The state-dict names a checkpoint must hold: one of each set of tied names."""
    seen: set[int] = set()
    needed = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            needed.add(name)
    return needed

