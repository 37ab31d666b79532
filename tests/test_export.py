"""`asyncrl export`: a trained policy's checkpoint as a Hugging Face model directory that
transformers loads, weight for weight (FSDP2 and ZeRO-3 checkpoints), and the messages for
paths and groups that are not one."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from helpers import WORDS, assert_gone, cli, group_pids, run, word_tokenizer

import asyncrl
from asyncrl.hybrid.export import export, save_model_files
from asyncrl.hybrid.models import ModelConfig, build_model, tiny_gpt2
from asyncrl.hybrid.roles import Policy
from asyncrl.hybrid.sampler import Sampler, SamplingConfig


def local_model(folder):
    """A tiny GPT-2 in bf16 (tied embeddings, dropout 0.1 as GPT-2 has it) with a word
    tokenizer and a chat template, as a user's local checkpoint directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_gpt2()).to(torch.bfloat16).save_pretrained(folder)
    return word_tokenizer(folder)


def rollout_batch(model_cfg: dict):
    return Sampler(build_model(ModelConfig(**model_cfg)), SamplingConfig(max_new_tokens=5)
                   ).generate([[1, 4 + i, 5 + i] for i in range(8)], seeds=list(range(8)))


def trained_checkpoint(run_dir, model_cfg: dict, before_save=None, **spawn) -> dict:
    """A 2-rank Policy "actor" after one step, checkpointed as run_dir's step 0 (meta.json
    marks it complete, as a run's save does); its full weights then. `before_save()` runs
    between the step and the save."""
    batch = rollout_batch(model_cfg)
    step = run_dir / "checkpoints" / "step_000000"

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            policy = await ctl.spawn(Policy, model_cfg, {"lr": 1e-2, "micro_batch_size": 4},
                                     nprocs=2, name="actor", hybrid=False, **spawn)
            pids = group_pids(policy)
            await policy.train_step(batch)
            if before_save is not None:
                before_save()
            await policy.save_checkpoint(str(step))
            return (await policy.weights("train"))[0], pids
    weights, pids = run(main(), timeout=580)
    assert_gone(pids)
    (step / "meta.json").write_text(json.dumps({"step": 0}))
    return weights


def test_a_trained_fsdp2_policy_exports_as_the_model_it_started_from(tmp_path):
    """A bf16 checkpoint trained in fp32 comes back in bf16, its config as given (training
    turns dropout off), embeddings tied, with its tokenizer: from the run's checkpoint
    alone, the source directory gone (already gone when the checkpoint was written: each
    save read the source's config and tokenizer again, and failed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = local_model(tmp_path / "source")
    # a named template (tool use) in transformers' folder of them: it was left behind
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    before = AutoModelForCausalLM.from_pretrained(source, local_files_only=True).state_dict()
    trained = trained_checkpoint(tmp_path / "run", {"path": str(source)},
                                 before_save=lambda: shutil.rmtree(source))
    out = cli("export", str(tmp_path / "run"), str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    assert "group 'actor'" in out.stdout and "in bfloat16" in out.stdout

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True,
                                                 dtype="auto")
    exported = model.state_dict()
    assert set(exported) == set(trained) and model.dtype == torch.bfloat16
    assert all(torch.equal(exported[k], trained[k].to(torch.bfloat16)) for k in trained)
    assert any(not torch.equal(before[k], exported[k]) for k in trained)  # it did train
    assert model.config.resid_pdrop == 0.1 and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert tok("w3 w7").input_ids == [WORDS.index("w3"), WORDS.index("w7")]
    assert tok.eos_token == "</s>" and tok.chat_template
    assert (tmp_path / "hf" / "additional_chat_templates" / "tool_use.jinja").read_text() == \
        "{{ tools }}"
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []
    assert oct((tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777) == \
        oct((tmp_path / "hf" / "config.json").stat().st_mode & 0o777)


@pytest.mark.timeout(600)
def test_a_zero3_policy_exports_its_weights_in_the_dtype_asked_for(tmp_path):
    pytest.importorskip("deepspeed")
    from transformers import AutoModelForCausalLM

    # a run folder whose name globs: DeepSpeed's reader globs its path, and found nothing
    trained = trained_checkpoint(tmp_path / "run[1]", {"preset": "tiny-llama", "seed": 5},
                                 backend="zero3")
    (tmp_path / "hf").mkdir()  # an empty folder is fine
    done = export(tmp_path / "run[1]" / "checkpoints" / "step_000000", tmp_path / "hf",
                  dtype="bfloat16")
    assert done["group"] == "actor" and done["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True,
                                                 dtype="auto")
    exported = model.state_dict()
    assert model.dtype == torch.bfloat16 and set(exported) == set(trained)
    # every rank's partition of the fp32 masters, put together (not the initial weights)
    assert all(torch.equal(exported[k], trained[k].to(torch.bfloat16)) for k in trained)
    initial = build_model(ModelConfig(preset="tiny-llama", seed=5)).state_dict()
    assert any(not torch.equal(initial[k], trained[k]) for k in trained)


def test_a_tensor_parallel_policy_exports_whole_tensors(tmp_path):
    """dp=1, tp=2: each rank saved its column or row shards (DTensors); the export reads
    them back whole, as the model's own names and shapes."""
    from transformers import AutoModelForCausalLM

    trained = trained_checkpoint(tmp_path / "run", {"preset": "tiny-llama", "seed": 2},
                                 mesh={"dp": 1, "tp": 2})
    done = export(tmp_path / "run", tmp_path / "hf")
    assert done["dtype"] == "float32"  # a preset: the dtype it trained in
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert set(exported) == set(trained)
    assert all(torch.equal(exported[k], trained[k]) for k in trained)


def policy_folder(checkpoint, group: str, model: bool = True) -> None:
    folder = checkpoint / group
    folder.mkdir(parents=True)
    torch.save({"version": 1}, folder / "actor.pt")
    if model:
        save_model_files(folder, ModelConfig(preset="tiny-llama"))


def saved_policy(run_dir, cfg: ModelConfig, weights: dict) -> None:
    """run_dir's complete checkpoint step 0 of a Policy "actor" of `cfg` holding `weights`,
    as a run writes it (FSDP2's files), without a run."""
    import torch.distributed.checkpoint as dcp

    step = run_dir / "checkpoints" / "step_000000"
    (step / "actor").mkdir(parents=True)
    torch.save({"version": 1}, step / "actor" / "actor.pt")
    save_model_files(step / "actor", cfg)
    with warnings.catch_warnings():  # one process on purpose, which DCP warns of
        warnings.filterwarnings("ignore", message=".*in a single process")
        dcp.save({"model": weights}, checkpoint_id=str(step / "actor" / "train"), no_dist=True)
    (step / "meta.json").write_text(json.dumps({"step": 0}))


def test_export_says_what_is_wrong_with_its_paths_and_groups(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; give a run directory"):
        export(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        export(tmp_path, tmp_path / "out")

    step = tmp_path / "run" / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    policy_folder(step, "actor")
    policy_folder(step, "student", model=False)
    (step / "critic").mkdir()
    torch.save({"version": 1}, step / "critic" / "critic.pt")
    # the run, its checkpoints folder (was "holds no complete checkpoint"): its newest one
    for given in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        with pytest.raises(ValueError, match=r"2 policy groups \(\['actor', 'student'\]\): "
                                             r"name one with --group"):
            export(given, tmp_path / "out")
    # a checkpoint's file (was "does not exist")
    with pytest.raises(ValueError, match=r"meta.json is a file; give a run directory .* or "
                                         r"one of its checkpoints/step_\* folders"):
        export(step / "meta.json", tmp_path / "out")
    with pytest.raises(ValueError, match="'critic' holds no policy .* policies .*: "
                                         r"\['actor', 'student'\]"):
        export(tmp_path / "run", tmp_path / "out", group="critic")
    with pytest.raises(ValueError, match="'ref' is not in it"):
        export(tmp_path / "run", tmp_path / "out", group="ref")
    with pytest.raises(ValueError, match="has no model.json or hf/config.json"):
        export(tmp_path / "run", tmp_path / "out", group="student")
    with pytest.raises(ValueError, match="'int8' is not a floating torch dtype"):
        export(tmp_path / "run", tmp_path / "out", group="actor", dtype="int8")
    # floating, but transformers failed deep inside on it
    with pytest.raises(ValueError, match="'float8_e4m3fn' is not a floating torch dtype"):
        export(tmp_path / "run", tmp_path / "out", group="actor", dtype="float8_e4m3fn")
    # an alias a model's dtype takes ("half") exports as what it names
    from types import SimpleNamespace

    from asyncrl.hybrid.export import _dtype
    assert _dtype(None, SimpleNamespace(dtype=None),
                  ModelConfig(preset="tiny-llama", dtype="half")) is torch.float16

    import torch.distributed.checkpoint as dcp  # GPT-2's weights under a Llama's model.json

    gpt2 = build_model(ModelConfig(preset="tiny-gpt2")).state_dict()
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": gpt2}, checkpoint_id=str(step / "actor" / "train"), no_dist=True)
    with pytest.raises(ValueError, match=r"do not fit the model of model.json: missing "
                                         r"\['model.embed_tokens.weight', .*unexpected "
                                         r"\['transformer.h.0.attn.c_attn.bias'"):
        export(tmp_path / "run", tmp_path / "out", group="actor")

    kept = tmp_path / "out" / "mine.txt"  # nothing is overwritten
    kept.parent.mkdir()
    kept.write_text("keep me")
    out = cli("export", str(tmp_path / "run"), str(tmp_path / "out"), "--group", "actor")
    assert out.returncode == 1 and "exists and is not an empty folder" in out.stderr
    assert kept.read_text() == "keep me" and not (tmp_path / "out" / "config.json").exists()
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []


def test_a_zero_checkpoint_without_deepspeed_here_says_what_to_install(tmp_path, monkeypatch):
    """`asyncrl export` of a ZeRO run on a machine without DeepSpeed was an ImportError's
    traceback (the CLI says ValueErrors in a line)."""
    import sys

    from asyncrl.hybrid.export import trained_weights
    from asyncrl.hybrid.zero import TAG

    (tmp_path / "actor" / "train" / TAG).mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "deepspeed.utils.zero_to_fp32", None)  # not installed
    with pytest.raises(ValueError, match=r"written by DeepSpeed ZeRO, whose files only "
                                         r"DeepSpeed reads: pip install 'asyncrl\[deepspeed\]'"):
        trained_weights(tmp_path / "actor")


def test_a_zero_lora_checkpoint_with_the_old_adapter_names_exports_merged(tmp_path,
                                                                          monkeypatch):
    """A ZeRO checkpoint of before 2026-12-04, its adapters named `<layer>.lora_A`: only
    FSDP2's were read by today's names ("unexpected [...lora_A]")."""
    from transformers import AutoModelForCausalLM

    from asyncrl.hybrid.lora import is_adapter, merged

    cfg = ModelConfig(preset="tiny-llama", seed=0, lora={"rank": 2, "alpha": 4})
    trained = trained_lora(cfg)
    # DeepSpeed's reader, as it reads such a checkpoint: the adapters under their old names
    old = {k.removesuffix(".weight") if is_adapter(k) else k: v for k, v in trained.items()}
    zero_checkpoint(tmp_path / "run", cfg, old, monkeypatch)
    export(tmp_path / "run", tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                    local_files_only=True).state_dict()
    assert cfg.lora is not None
    want = dict(merged(trained, cfg.lora))
    assert set(exported) == set(want)
    assert all(torch.equal(exported[k], want[k]) for k in want)


def test_an_fp64_lora_policy_exports_its_merge_to_fp64_accuracy(tmp_path, monkeypatch):
    """An fp64 LoRA model's export merged W + s B A in fp32: an error of ~1e-7 where fp64
    holds ~1e-16."""
    from safetensors.torch import load_file

    from asyncrl.hybrid.lora import is_adapter

    cfg = ModelConfig(preset="tiny-llama", seed=0, dtype="float64", lora={"rank": 2, "alpha": 4})
    trained = trained_lora(cfg)
    zero_checkpoint(tmp_path / "run", cfg, trained, monkeypatch)
    assert export(tmp_path / "run", tmp_path / "hf", dtype="float64")["dtype"] == "float64"
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert cfg.lora is not None
    want = {k: v for k, v in trained.items() if not is_adapter(k)}
    for name in [k.removesuffix(".lora_A.weight") for k in trained if ".lora_A." in k]:
        a, b = trained[f"{name}.lora_A.weight"], trained[f"{name}.lora_B.weight"]
        want[f"{name}.weight"] = want[f"{name}.weight"] + cfg.lora.scaling * b @ a
    assert {v.dtype for v in want.values()} == {torch.float64} and set(exported) == set(want)
    assert max((exported[k] - want[k]).abs().max().item() for k in want) < 1e-12


def trained_lora(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A LoRA model's state dict, as if trained: its adapters change the model."""
    from asyncrl.hybrid.lora import lora_layers

    model = build_model(cfg)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.weight.normal_(0, 0.05)
    return model.state_dict()


def zero_checkpoint(run_dir: Path, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                    monkeypatch) -> None:
    """A ZeRO checkpoint of group "actor" at run_dir's step 0, read as `weights` by a fake of
    DeepSpeed's reader (not installed here)."""
    import sys
    import types

    from asyncrl.hybrid.zero import TAG

    step = run_dir / "checkpoints" / "step_000000"
    (step / "actor" / "train" / TAG).mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    torch.save({"version": 1}, step / "actor" / "actor.pt")
    save_model_files(step / "actor", cfg)
    zero = types.ModuleType("deepspeed.utils.zero_to_fp32")
    zero.get_fp32_state_dict_from_zero_checkpoint = lambda path, tag: dict(weights)
    monkeypatch.setitem(sys.modules, "deepspeed.utils.zero_to_fp32", zero)


CUSTOM_CONFIG = """from transformers import GPT2Config


class MyConfig(GPT2Config):
    model_type = "my_gpt2"
"""
CUSTOM_MODEL = """from transformers import GPT2LMHeadModel

from .configuration_my import MyConfig


class MyModel(GPT2LMHeadModel):
    config_class = MyConfig
"""


def test_a_policy_with_code_of_its_own_exports_with_its_code(tmp_path):
    """A trust_remote_code model's run could not be exported: its modeling code was not
    kept with the checkpoint, and export read the config without trusting it."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "source"
    local_model(source)
    (source / "configuration_my.py").write_text(CUSTOM_CONFIG)
    (source / "modeling_my.py").write_text(CUSTOM_MODEL)
    config = json.loads((source / "config.json").read_text())
    config.update(model_type="my_gpt2", auto_map={
        "AutoConfig": "configuration_my.MyConfig",
        "AutoModelForCausalLM": "modeling_my.MyModel"})
    (source / "config.json").write_text(json.dumps(config))
    trained = trained_checkpoint(tmp_path / "run", {"path": str(source),
                                                    "trust_remote_code": True})
    out = cli("export", str(tmp_path / "run"), str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "hf" / "modeling_my.py").read_text() == CUSTOM_MODEL
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True,
                                                 trust_remote_code=True, dtype="auto")
    assert type(model).__name__ == "MyModel"
    exported = model.state_dict()
    assert all(torch.equal(exported[k], trained[k].to(exported[k].dtype)) for k in trained)


def tiny_deepseek_v3():
    """A 2-layer DeepseekV3 (its second layer a mixture of 4 experts): a model whose router
    transformers keeps in fp32 (_keep_in_fp32_modules_strict)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, n_shared_experts=1, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=64)


def test_parameters_transformers_keeps_in_fp32_export_in_fp32(tmp_path):
    """A bf16 MoE's router (gate.weight, e_score_correction_bias), which from_pretrained and
    so the trainer keep in fp32, was exported rounded to bf16: the model routed otherwise.
    Which of them are kept is transformers' to say (5.20 keeps e_score_correction_bias)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source = tmp_path / "source"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_deepseek_v3()).to(torch.bfloat16).save_pretrained(source)
    cfg = ModelConfig(path=str(source), dtype="bfloat16")
    trained = build_model(cfg).state_dict()
    router = [k for k in trained if k.endswith(("gate.weight", "e_score_correction_bias"))]
    assert len(router) == 2
    plain = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).state_dict()
    kept = [k for k in router if plain[k].dtype == torch.float32]
    if not kept:  # (transformers' choice: asyncrl's own dtypes are asserted below)
        pytest.skip("this transformers keeps no parameter of DeepSeek-V3's router in fp32")
    assert {k: trained[k].dtype for k in router} == {k: plain[k].dtype for k in router}
    for name in kept:  # as if trained: values bf16 cannot hold
        trained[name] = trained[name] + torch.rand_like(trained[name]) * 1e-3
    saved_policy(tmp_path / "run", cfg, trained)

    assert export(tmp_path / "run", tmp_path / "hf")["dtype"] == "bfloat16"
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert {k: exported[k].dtype for k in kept} == dict.fromkeys(kept, torch.float32)
    assert all(torch.equal(exported[k], trained[k]) for k in kept)
    assert {v.dtype for k, v in exported.items() if k not in kept} == {torch.bfloat16}


def test_an_export_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """OUT took its final name with its files maybe in the page cache alone: a host crash
    left a model folder whose shards were cut short."""
    cfg = ModelConfig(preset="tiny-llama")
    saved_policy(tmp_path / "run", cfg, build_model(cfg).state_dict())
    synced: list[int] = []  # the inodes fsynced, in order
    renamed_after: list[int] = []  # how many fsyncs came before the rename
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        synced.append(os.fstat(fd).st_ino)
        fsync(fd)

    def checked_replace(src, dst):
        written = [src, *(str(p) for p in Path(src).rglob("*"))]
        assert [p for p in written if os.stat(p).st_ino not in synced] == []
        replace(src, dst)
        renamed_after.append(len(synced))

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", checked_replace)
    export(tmp_path / "run", tmp_path / "hf")
    assert len(renamed_after) == 1  # and the rename, in its folder
    assert os.stat(tmp_path).st_ino in synced[renamed_after[0]:]


def test_an_export_that_cannot_be_written_fails_before_reading_the_weights(tmp_path,
                                                                           monkeypatch):
    """A parent of OUT that is a file failed after minutes of reading, and as "File
    exists", as if OUT existed."""
    import asyncrl.hybrid.export as module

    step = tmp_path / "run" / "checkpoints" / "step_000000"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    policy_folder(step, "actor")

    def unread(folder):
        raise AssertionError("read before the destination was checked")

    monkeypatch.setattr(module, "trained_weights", unread)
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for out in (afile / "out", afile / "deeper" / "out"):
        with pytest.raises(ValueError,  # (what the CLI says in a line)
                           match=f"cannot write the export {out}: {afile} is a file, not a "
                                 f"folder; give an OUT whose folder can be written"):
            export(tmp_path / "run", out)
    assert afile.read_text() == "mine"
    # the folders made for OUT go with a failed export: it leaves nothing
    with pytest.raises(AssertionError, match="read before"):
        export(tmp_path / "run", tmp_path / "new" / "deep" / "out")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["afile", "run"]


NO_SPACE = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.mark.parametrize("where", ["fsync", "model", "adapter"])
def test_an_export_that_fills_the_disk_says_so_and_leaves_nothing(tmp_path, monkeypatch, where):
    """safetensors' writes (the model's, a LoRA policy's adapters) fail with its own
    SafetensorError, not an OSError: a full disk there was a traceback."""
    import errno
    import re

    import safetensors.torch
    import transformers.modeling_utils
    from safetensors import SafetensorError

    import asyncrl.hybrid.export as module

    cfg = ModelConfig(preset="tiny-llama",
                      lora={"rank": 2, "alpha": 4} if where == "adapter" else None)
    saved_policy(tmp_path / "run", cfg, build_model(cfg).state_dict())

    def full(*args, **kwargs):
        if where == "fsync":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise SafetensorError(NO_SPACE)

    monkeypatch.setattr(*{"fsync": (module, "sync_tree"),
                          "model": (transformers.modeling_utils, "safe_save_file"),
                          "adapter": (safetensors.torch, "save_file")}[where], full)
    why = "No space left on device" if where == "fsync" else NO_SPACE
    with pytest.raises(ValueError, match=re.escape(f"cannot write the export {tmp_path / 'hf'}: "
                                                   f"{why}: {tmp_path}; give an OUT whose")):
        export(tmp_path / "run", tmp_path / "hf")
    assert [f.name for f in tmp_path.iterdir()] == ["run"]
