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
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from asyncrl.hybrid.lora import is_adapter, legacy_adapter_names, merged
from asyncrl.hybrid.models import ModelConfig, hf_config
from asyncrl.hybrid.zero import TAG

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
        if cfg.path is not None:
            given["path"] = os.path.abspath(cfg.path)
        extra = {} if cfg.path is None else {
            file.relative_to(cfg.path).as_posix(): file.read_bytes()
            for pattern in TOKENIZER_FILES for file in Path(cfg.path).glob(pattern)
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
    checkpoint of the run directory `path`."""
    from asyncrl.controller.checkpoint import latest

    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist; give a run directory (the --run-dir "
                                f"of asyncrl launch) or one of its checkpoints/step_* folders")
    found = latest(path)
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
        return _current_names(dict(get_fp32_state_dict_from_zero_checkpoint(str(train),
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


def export(path: Path, out: Path, group: str | None = None,
           dtype: str | None = None) -> dict[str, Any]:
    """Write the policy of checkpoint (or run directory) `path` as a Hugging Face model
    directory `out` (new or empty: nothing is overwritten) in `dtype` (default: the source
    checkpoint's, else the one it trained in); what was written."""
    # transformers imports DeepSpeed where it is installed, which guesses its accelerator
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    from transformers import AutoConfig, AutoModelForCausalLM

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
    weights = trained_weights(folder)
    lora = cfg.lora
    adapters: dict[str, torch.Tensor] = {}
    if lora is not None:  # what trained, for peft's file; merged in place, a layer at a time
        adapters = {k: v for k, v in weights.items() if is_adapter(k) or lora.trains_whole(k)}
        for name, value in merged(weights, lora, target):
            weights[name] = value  # (the unmerged one dropped: never two copies)
        for name in [k for k in weights if is_adapter(k)]:
            del weights[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=target,
                                                 trust_remote_code=cfg.trust_remote_code)
    missing = _needed(model) - set(weights)
    unexpected = set(weights) - set(model.state_dict())
    if missing or unexpected:
        raise ValueError(f"{folder}: the checkpoint's weights do not fit the model of "
                         f"{MODEL_FILE}: missing {sorted(missing)[:5]}, unexpected "
                         f"{sorted(unexpected)[:5]}")
    for name in list(weights):  # one tensor at a time: never two copies of the model
        value = weights.pop(name)
        weights[name] = value.to(target) if value.is_floating_point() else value
    model.load_state_dict(weights, strict=False, assign=True)
    del weights
    model.tie_weights()  # a tied name the checkpoint left out shares its twin's tensor
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        model.save_pretrained(tmp, max_shard_size="5GB")  # (verl's, the Hub's size)
        for file in (folder / HF_FOLDER).iterdir():  # the tokenizer's files, if any
            if file.is_dir():
                shutil.copytree(file, tmp / file.name)
            elif file.name != "config.json":
                shutil.copy2(file, tmp / file.name)
        if lora is not None:
            _save_adapter(tmp / ADAPTER_FOLDER, adapters, cfg)
        # safetensors writes its file owner-only: every file as config.json (the umask's)
        mode = (tmp / "config.json").stat().st_mode & 0o777
        for file in tmp.rglob("*"):
            file.chmod(mode if file.is_file() else mode | (mode & 0o444) >> 2)
        tmp.chmod(mode | (mode & 0o444) >> 2)  # mkdtemp's is owner-only: x where r
        os.replace(tmp, out)  # onto an empty folder, or none
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out), "checkpoint": str(checkpoint), "group": folder.name,
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(target).removeprefix("torch.")}


def _save_adapter(out: Path, adapters: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """A LoRA policy's adapters as peft saves them: `base_model.model.<layer>.lora_A.weight`
    and adapter_config.json (base_model_name_or_path: the checkpoint it started from)."""
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
        "base_model_name_or_path": os.path.abspath(cfg.path) if cfg.path else None}, indent=1))


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

