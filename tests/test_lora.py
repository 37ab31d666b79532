"""LoRA: adapters on a frozen model. Only they train (FSDP2, ZeRO-2), a hybrid switch gathers
the frozen model once and the adapters after, a weight sync carries the adapters alone, the
reference is the policy with its adapters off, and an export is the merged model plus the
adapters in peft's format."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from helpers import assert_gone, group_pids, run

import asyncrl
from asyncrl import TensorBatch
from asyncrl.hybrid.export import ADAPTER_FOLDER, export
from asyncrl.hybrid.lora import (
    LoraConfig,
    LoraLinear,
    adapters_off,
    is_adapter,
    lora_layers,
    merged,
)
from asyncrl.hybrid.models import ModelConfig, build_model, build_value_model
from asyncrl.hybrid.roles import Policy, Rollout

LORA = {"rank": 3, "alpha": 6}  # 3 rows of A on 2 ranks: uneven shards
MODEL = {"preset": "tiny-llama", "seed": 0, "lora": LORA}
SAMPLING = {"max_new_tokens": 6, "temperature": 0.8}
TRAIN = {"lr": 3e-2, "micro_batch_size": 4}


def prompts(n: int = 8) -> TensorBatch:
    return TensorBatch({"prompt": [[1, 4 + i, 5 + i] for i in range(n)], "seed": list(range(n))})


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 9, 13, 17, 21], [1, 30, 40, 50, 60, 70]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def trained_lora_model() -> torch.nn.Module:
    model = build_model(ModelConfig(**MODEL))
    with torch.no_grad():  # as if trained: the adapters change the model
        for layer in lora_layers(model).values():
            layer.lora_B.weight.normal_(0, 0.05)
    return model


class WholeBackend:
    """A trainer in one process, its model whole: what the hybrid engine reads of one."""

    loads = 0  # load() and load_state_dict() count here

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.opt = model, torch.optim.AdamW(model.parameters())

    def offload_masters(self) -> int:
        return 0

    def reload_masters(self) -> None:
        pass


def test_adapters_start_as_no_change_and_alone_train():
    base, model = build_model(ModelConfig(seed=0)), build_model(ModelConfig(**MODEL))
    assert torch.equal(logits(base), logits(model))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(is_adapter(n) for n in trained)
    assert len(lora_layers(model)) == 7 * 2  # q k v o gate up down, two layers; no lm_head
    assert {n for n, _ in base.named_parameters()} == \
        {n for n, _ in model.named_parameters() if not is_adapter(n)}  # the same names
    qv = {"rank": 2, "target_modules": ["q_proj", "v_proj"]}
    only_qv = build_model(ModelConfig(**{**MODEL, "lora": qv}))
    assert sorted({n.rsplit(".", 1)[-1] for n in lora_layers(only_qv)}) == ["q_proj", "v_proj"]
    critic = build_value_model(ModelConfig(**MODEL))  # adapters on the backbone, the head whole
    assert {n for n, p in critic.named_parameters() if p.requires_grad and not is_adapter(n)} \
        == {"value_head.weight", "value_head.bias"}
    # the actor's config with its LM head trained whole serves the critic (no LM head there)
    head_too = {**MODEL, "lora": {**LORA, "modules_to_save": ["lm_head"]}}
    critic = build_value_model(ModelConfig(**head_too))
    assert {n for n, p in critic.named_parameters() if p.requires_grad and not is_adapter(n)} \
        == {"value_head.weight", "value_head.bias"}
    with pytest.raises(ValueError, match=r"\['lm_head'\] is the model's output head, which "
                                         r"LoRA does not adapt here; train it whole"):
        build_model(ModelConfig(**{**MODEL, "lora": {"rank": 2, "target_modules": ["lm_head"]}}))
    # the same adapters on every rank: drawn from the model's seed
    again = build_model(ModelConfig(**MODEL))
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters(),
                                                 strict=True))


def test_merged_weights_and_adapters_off_are_the_plain_models():
    model = trained_lora_model()
    plain = build_model(ModelConfig(seed=0))
    out = logits(model)
    assert not torch.allclose(out, logits(plain), atol=1e-3)  # the adapters do something
    with adapters_off(model):
        assert torch.equal(logits(model), logits(plain))
    assert torch.equal(logits(model), out)  # and on again
    weights = dict(merged(model.state_dict(), LoraConfig(**LORA)))
    assert set(weights) == set(plain.state_dict())
    plain.load_state_dict(weights)
    assert (logits(plain) - out).abs().max().item() < 1e-5


def test_a_bf16_layers_merge_is_rounded_once_into_the_dtype_asked_for():
    """`asyncrl export --dtype float32` of a bf16 LoRA model rounded W + s B A through bf16
    first: most of a small update was lost although fp32 was asked for."""
    torch.manual_seed(0)
    w = torch.randn(8, 8).to(torch.bfloat16)
    a, b = torch.randn(2, 8), 1e-3 * torch.randn(8, 2)  # fp32 adapters, as trained
    weights = {"q.weight": w, "q.lora_A.weight": a, "q.lora_B.weight": b}
    cfg = LoraConfig(rank=2, alpha=4)
    exact = w.float() + cfg.scaling * b @ a
    wide = dict(merged(weights, cfg, torch.float32))["q.weight"]
    assert wide.dtype == torch.float32 and (wide - exact).abs().max().item() < 1e-6
    assert dict(merged(weights, cfg))["q.weight"].dtype == torch.bfloat16  # W's, by default


def test_modules_to_save_train_whole_beside_the_adapters():
    model = build_model(ModelConfig(**{**MODEL, "lora": {**LORA, "modules_to_save": ["lm_head"]}}))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "lm_head.weight" in trained and all(is_adapter(n) for n in trained - {"lm_head.weight"})
    # a module's nested parameters: what trains is what an export saves (trains_whole)
    cfg = LoraConfig(rank=2, target_modules=["q_proj"], modules_to_save=["mlp"])
    nested = build_model(ModelConfig(lora={"rank": 2, "target_modules": ["q_proj"],
                                           "modules_to_save": ["mlp"]}))
    whole = {n for n, p in nested.named_parameters() if p.requires_grad and not is_adapter(n)}
    assert len(whole) == 6 and all(".mlp." in n for n in whole)  # gate, up, down x 2 layers
    assert whole == {n for n, _ in nested.named_parameters() if cfg.trains_whole(n)}
    with pytest.raises(ValueError, match=r"has no module with parameters named \['head'\]"):
        build_model(ModelConfig(lora={**LORA, "modules_to_save": ["head"]}))
    with pytest.raises(ValueError, match=r"q_proj is adapted by LoRA"):
        build_model(ModelConfig(lora={**LORA, "modules_to_save": ["q_proj"]}))
    with pytest.raises(ValueError, match=r"lm_head.weight is tied to \['model.embed_tokens"):
        build_model(ModelConfig(overrides={"tie_word_embeddings": True},
                                lora={**LORA, "modules_to_save": ["lm_head"]}))


def test_a_tied_checkpoint_untied_by_an_override_starts_its_head_as_the_embeddings(tmp_path):
    """The fix the tied-head error names (overrides={"tie_word_embeddings": False}) loaded a
    tied checkpoint (Qwen2.5-0.5B, Llama-3.2-1B: no head in its files) with a random head:
    the policy generated noise from its first step."""
    tied = build_model(ModelConfig(overrides={"tie_word_embeddings": True}))
    tied.save_pretrained(tmp_path)
    untied = build_model(ModelConfig(path=str(tmp_path),
                                     overrides={"tie_word_embeddings": False},
                                     lora={**LORA, "modules_to_save": ["lm_head"]}))
    head = untied.get_output_embeddings().weight
    embeddings = untied.get_input_embeddings().weight
    assert torch.equal(head, embeddings) and head is not embeddings
    assert torch.equal(head, tied.lm_head.weight)


def test_a_checkpoint_with_code_of_its_own_is_refused_unless_trusted(tmp_path):
    """A config.json with an auto_map runs the checkpoint's own code: transformers asked on
    the terminal (a rank with one could wait there) and failed; now it fails at once, naming
    model={"trust_remote_code": True}, as verl's setting."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "my_custom_lm", "hidden_size": 8,
        "auto_map": {"AutoConfig": "configuration_my.MyConfig",
                     "AutoModelForCausalLM": "modeling_my.MyModel"}}))
    with pytest.raises(ValueError, match=r"code of its own .*'trust_remote_code': True"):
        build_model(ModelConfig(path=str(tmp_path)))
    with pytest.raises(TypeError, match="trust_remote_code is True or False"):
        ModelConfig(trust_remote_code="yes")


def test_a_model_dtype_is_a_floating_point_one():
    """dtype="int8" passed the check and failed every rank's build (nn.Module.to refuses it)."""
    for bad in ("int8", "bool", "tensor", 32):
        with pytest.raises(ValueError, match="is not a torch floating point dtype"):
            ModelConfig(dtype=bad)
    assert ModelConfig(dtype="float16").dtype == "float16"


def test_lora_configs_compare_however_given_and_adapters_off_nests():
    a = LoraConfig(rank=4, alpha=8, target_modules=("v_proj", "q_proj"))
    b = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    assert a.described() == b.described()
    model = trained_lora_model()
    plain = logits(build_model(ModelConfig(seed=0)))
    with adapters_off(model):
        with adapters_off(model):
            pass
        assert torch.equal(logits(model), plain)  # still off after the inner one
    assert not torch.equal(logits(model), plain)


def test_the_engine_gathers_frozen_weights_once_until_the_trainer_loads_new_ones():
    """A LoRA switch gathers the adapters alone; after the trainer loaded weights (its load
    count moved) the frozen ones too, else the engine would keep stale ones."""
    from asyncrl.hybrid.engine import HybridEngine

    model = trained_lora_model()
    backend = WholeBackend(model)
    hybrid = HybridEngine(backend, ModelConfig(**MODEL))
    engine = dict(hybrid.engine.model.named_parameters())
    frozen = "model.layers.0.mlp.up_proj.weight"
    adapter = "model.layers.0.mlp.up_proj.lora_B.weight"
    hybrid.to_generate()
    assert all(torch.equal(engine[k], v) for k, v in model.named_parameters())
    first = hybrid.peak_gather_bytes
    with torch.no_grad():  # a train step changes adapters; a load may change anything
        model.get_parameter(adapter).add_(1.0)
        model.get_parameter(frozen).add_(1.0)
    hybrid.to_train()
    hybrid.to_generate()
    assert torch.equal(engine[adapter], model.get_parameter(adapter))
    assert not torch.equal(engine[frozen], model.get_parameter(frozen))  # not gathered again
    assert hybrid.peak_gather_bytes < first
    backend.loads += 1
    hybrid.to_train()
    hybrid.to_generate()
    assert all(torch.equal(engine[k], v) for k, v in model.named_parameters())


@pytest.mark.parametrize("lora, message", [
    ({"rank": 0}, "lora.rank must be an int >= 1"),
    ({"rank": 4, "alpha": -1}, "lora.alpha must be a number > 0"),
    ({"rank": 4, "target_modules": "q_proj"}, "'all-linear' or a list of layer names"),
    ({"rank": 4, "dropout": 0.1}, "its keys are rank, alpha, target_modules"),
    ({"rank": 4, "modules_to_save": "lm_head"}, "modules_to_save is a list of module names"),
    ([4], "lora= is a dict"),
])
def test_a_bad_lora_entry_is_refused_by_the_model_config(lora, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ModelConfig(lora=lora)


def test_numpy_numbers_are_a_lora_entry_as_any_setting():
    """A sweep's np.int64 rank was refused as not an int, in a message that showed 8."""
    import numpy as np

    lora = ModelConfig(lora={"rank": np.int64(8), "alpha": np.float32(16)}).lora
    assert lora.described()["rank"] == 8 and type(lora.rank) is int
    assert lora == ModelConfig(lora={"rank": 8, "alpha": 16.0}).lora


def test_an_empty_modules_to_save_means_none():
    assert ModelConfig(lora={"rank": 4, "modules_to_save": []}).lora == LoraConfig(rank=4)


def test_lora_names_the_layers_a_model_has_when_none_match():
    with pytest.raises(ValueError, match=r"no nn.Linear layer named \['qkv'\]; its nn.Linear "
                                         r"layers: \['down_proj', 'gate_proj', 'k_proj'"):
        build_model(ModelConfig(lora={"rank": 2, "target_modules": ["q_proj", "qkv"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no nn.Linear layer to adapt"):
        build_model(ModelConfig(preset="tiny-gpt2", lora={"rank": 2}))


def test_a_rollout_refuses_adapters_for_another_frozen_model_and_vllm():
    rollout = Rollout.__new__(Rollout)
    rollout.__init__({**MODEL, "seed": 1})
    pack = TensorBatch({"x": torch.zeros(1, 1)}, meta={
        "frozen_model": ModelConfig(**MODEL).frozen_model(), "version": 1, "nbytes": 4,
        "shapes": {"x": [1]}})
    with pytest.raises(ValueError, match="adapters for the frozen model .*'seed': 0.* this "
                                         "Rollout holds .*'seed': 1"):
        rollout.load_weights(pack)
    assert rollout.engine.version == 0
    with pytest.raises(ValueError, match="engine='vllm' and a LoRA model is not supported yet"):
        Rollout.__new__(Rollout).__init__(MODEL, engine="vllm")


def test_a_lora_rollout_refuses_the_weights_of_a_trainer_without_lora():
    """A trainer without LoRA sends every weight and no frozen_model: its pack failed in
    adopt_weights, with an error that blamed tie_word_embeddings."""
    from asyncrl.hybrid.weight_sync import SyncSource

    rollout = Rollout.__new__(Rollout)
    rollout.__init__(MODEL)
    plain = build_model(ModelConfig(preset="tiny-llama", seed=0))
    pack = SyncSource().pack(plain.named_parameters(), version=1)
    pack.meta["whole"] = True  # as a Policy without LoRA sends it
    with pytest.raises(ValueError, match=r"the trainer sends the weights of a model without "
                                         r"LoRA, but this Rollout holds .*'lora': .*give both "
                                         r"groups the same model="):
        rollout.load_weights(pack)
    assert rollout.engine.version == 0


def test_a_hybrid_lora_policy_trains_adapters_alone_and_switches_with_them():
    """FSDP2 on two ranks: the frozen weights never change; the first switch gathers them,
    the next ones the adapters alone, and the engine still scores as the trainer does; the
    policy's own reference (adapters off) stays the frozen model's. A rollout synced from it
    (the adapters gathered together, their shards uneven) samples as it does."""

    async def main():
        async with asyncrl.Controller() as ctl:
            policy, rollout = await asyncio.gather(
                ctl.spawn(Policy, MODEL, TRAIN, SAMPLING, nprocs=2, name="actor"),
                ctl.spawn(Rollout, MODEL, SAMPLING, name="rollout"))
            pids = group_pids(policy) + group_pids(rollout)
            before = (await policy.weights("train"))[0]
            first = await policy.generate(prompts())
            reports = [(await policy.switch_report())[0]]
            lps = [await policy.logprobs(first), await policy.ref_logprobs(first)]
            stats = [await policy.train_step(first) for _ in range(2)]
            after = (await policy.weights("train"))[0]
            second = await policy.generate(prompts())
            reports.append((await policy.switch_report())[0])
            engine = (await policy.weights("engine"))[0]
            lps += [await policy.logprobs(second), await policy.ref_logprobs(second),
                    await policy.ref_logprobs(first)]
            synced = await rollout.load_weights(policy.sync_pack())
            third = await rollout.generate(prompts())
            lps.append(await policy.logprobs(third))
            return before, first, reports, lps, stats, after, second, engine, synced, third, pids
    before, first, reports, lps, stats, after, second, engine, synced, third, pids = \
        run(main(), timeout=300)
    assert_gone(pids)
    assert synced["sync/tensors"] == sum(map(is_adapter, after)) == 2 * 7 * 2
    assert (lps.pop()["logprobs"] - third["logprobs"]).abs().max().item() < 1e-5
    lp_first, ref_first, lp_second, ref_second, ref_first_again = [x["logprobs"] for x in lps]
    assert stats[0][0]["loss"] != stats[1][0]["loss"]
    frozen = [k for k in before if not is_adapter(k)]
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    assert all(not torch.equal(before[k], after[k]) for k in after if k.endswith("lora_B.weight"))
    assert all(torch.equal(engine[k], after[k]) for k in after)  # the engine has the adapters
    # the engine's log-probs are the trainer's, before and after training
    assert (lp_first - first["logprobs"]).abs().max().item() < 1e-5
    assert (lp_second - second["logprobs"]).abs().max().item() < 1e-5
    assert (ref_first - lp_first).abs().max().item() < 1e-6  # B = 0: no change yet
    assert torch.equal(ref_first, ref_first_again)  # the reference never moves
    assert (ref_second - lp_second).abs().max().item() > 1e-3  # the policy did
    adapters = sum(v.numel() * v.element_size() for k, v in after.items() if is_adapter(k))
    if not torch.cuda.is_available():  # (a GPU engine frees its weights while training)
        # the adapters alone the second time (their uneven shards padded in the gather)
        assert adapters <= reports[1]["peak_gather_bytes"] <= 2 * adapters \
            < reports[0]["peak_gather_bytes"]


@pytest.mark.timeout(600)
def test_a_zero3_lora_policy_switches_syncs_and_exports_its_adapters(tmp_path):
    """ZeRO-3 on two ranks steps the adapters alone; its hybrid switch gathers them one by
    one (the frozen weights the first time only) and generates as it scores; a rollout
    receives the adapters only (its frozen model is its own build) and samples as it
    scores; its checkpoint (DeepSpeed's) exports as the model the policy is."""
    pytest.importorskip("deepspeed")
    step = tmp_path / "run" / "checkpoints" / "step_000000"

    async def main():
        async with asyncrl.Controller(construct_timeout=500) as ctl:
            policy, rollout = await asyncio.gather(
                ctl.spawn(Policy, MODEL, TRAIN, SAMPLING, backend="zero3", nprocs=2,
                          name="actor"),
                ctl.spawn(Rollout, MODEL, SAMPLING, name="rollout"))
            pids = group_pids(policy) + group_pids(rollout)
            before = (await policy.weights("train"))[0]
            batch = await policy.generate(prompts())
            first = (await policy.switch_report())[0]
            stats = await policy.train_step(batch)
            again = await policy.generate(prompts())
            second = (await policy.switch_report())[0]
            scored = [await policy.logprobs(again)]
            synced = await rollout.load_weights(policy.sync_pack())
            third = await rollout.generate(prompts())
            scored.append(await policy.logprobs(third))
            after = (await policy.weights("train"))[0]
            await policy.save_checkpoint(str(step))
            return before, stats, first, second, again, synced, third, scored, after, pids
    before, stats, first, second, again, synced, third, scored, after, pids = \
        run(main(), timeout=580)
    assert_gone(pids)
    assert stats[0]["loss"] > 0
    assert all(torch.equal(before[k], after[k]) for k in before if not is_adapter(k))
    adapters = {k: v for k, v in after.items() if is_adapter(k)}
    assert any(not torch.equal(before[k], v) for k, v in adapters.items())
    assert second["peak_gather_bytes"] < first["peak_gather_bytes"]
    assert (scored[0]["logprobs"] - again["logprobs"]).abs().max().item() < 1e-5
    assert synced["sync/tensors"] == len(adapters)
    assert synced["sync/bytes"] == sum(v.numel() * v.element_size() for v in adapters.values())
    assert synced["sync/version"] == 1
    assert (scored[1]["logprobs"] - third["logprobs"]).abs().max().item() < 1e-5
    (step / "meta.json").write_text(json.dumps({"step": 0}))
    export(tmp_path / "run", tmp_path / "out")
    from transformers import AutoModelForCausalLM

    policy = build_model(ModelConfig(**MODEL))
    policy.load_state_dict(after)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (logits(exported) - logits(policy)).abs().max().item() < 1e-5


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft's
def test_a_lora_policy_resumes_and_exports_merged_and_as_a_peft_adapter(tmp_path):
    """The export is the plain model with the adapters (and the head, trained whole) merged
    in: transformers loads it; beside it the adapters, which peft loads onto the frozen
    model: the same logits. A checkpoint brings the adapters back, into the engine too."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    step = tmp_path / "run" / "checkpoints" / "step_000000"
    # "norm": the final norm, as asyncrl matches names; peft matches by a name's end, and
    # took every layer's input_layernorm too (a KeyError loading the adapter)
    model = {**MODEL, "lora": {**LORA, "modules_to_save": ["lm_head", "norm"]}}

    async def main():
        async with asyncrl.Controller() as ctl:
            policy = await ctl.spawn(Policy, model, TRAIN, SAMPLING, nprocs=2, name="actor")
            pids = group_pids(policy)
            await policy.train_step(await policy.generate(prompts()))
            await policy.save_checkpoint(str(step))
            saved = (await policy.weights("train"))[0]
            await policy.train_step(await policy.generate(prompts()))
            with pytest.raises(asyncrl.RemoteError, match="no modules_to_save"):
                await policy.ref_logprobs(await policy.generate(prompts()))
            await policy.load_checkpoint(str(step))
            await policy.generate(prompts())
            # a checkpoint of before 2026-12-04, its adapters named `<layer>.lora_A`: refused
            # by name here, exported below
            with pytest.raises(asyncrl.RemoteError, match=r"under the names asyncrl gave "
                               r"them before 2026-12-04 \(model\.layers\.0\..*\.lora_A; now"):
                await policy.load_checkpoint(str(legacy_checkpoint(step, tmp_path / "old")))
            return saved, (await policy.weights("train"))[0], \
                (await policy.weights("engine"))[0], pids
    weights, loaded, engine, pids = run(main(), timeout=300)
    assert_gone(pids)
    assert all(torch.equal(weights[k], loaded[k]) and torch.equal(engine[k], loaded[k])
               for k in weights)
    (step / "meta.json").write_text(json.dumps({"step": 0}))
    done = export(tmp_path / "run", tmp_path / "out")
    policy = build_model(ModelConfig(**model))
    policy.load_state_dict(weights)
    want = logits(policy)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert not any(isinstance(m, LoraLinear) for m in exported.modules())
    assert done["parameters"] == sum(p.numel() for p in exported.parameters())
    assert (logits(exported) - want).abs().max().item() < 1e-5
    config = json.loads((tmp_path / "out" / ADAPTER_FOLDER / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["modules_to_save"]) == (
        3, 6, ["lm_head", "model.norm"])
    from safetensors import safe_open  # a bf16 export: its adapters as they trained (fp32),
    export(tmp_path / "run", tmp_path / "bf16", dtype="bfloat16")  # not rounded to bf16
    with safe_open(str(tmp_path / "bf16" / ADAPTER_FOLDER / "adapter_model.safetensors"),
                   "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    frozen = build_model(ModelConfig(seed=0))
    with_adapter = PeftModel.from_pretrained(frozen, tmp_path / "out" / ADAPTER_FOLDER).eval()
    assert (logits(with_adapter) - want).abs().max().item() < 1e-5
    export(tmp_path / "old", tmp_path / "old_out")  # the old names, read as peft's
    old = AutoModelForCausalLM.from_pretrained(tmp_path / "old_out").eval()
    assert (logits(old) - want).abs().max().item() < 1e-5


def test_the_adapters_of_a_policy_with_overrides_name_no_base_model(tmp_path):
    """peft loads adapter_config.json's base_model_name_or_path without the overrides that
    made the policy another model (the merged export's config.json has them): it silently
    put the adapters on a different model."""
    from test_export import saved_policy

    source = tmp_path / "source"
    build_model(ModelConfig(preset="tiny-llama")).save_pretrained(source)
    # how the model computes, not what (the source is still its base): attn_implementation,
    # use_cache, a dropout (off in evaluation)
    for i, (overrides, base) in enumerate([
            ({"rms_norm_eps": 1e-3}, None),
            ({"attn_implementation": "eager", "use_cache": False, "attention_dropout": 0.1},
             str(source))]):
        cfg = ModelConfig(path=str(source), overrides=overrides, lora=LORA)
        saved_policy(tmp_path / f"run{i}", cfg, build_model(cfg).state_dict())
        done = export(tmp_path / f"run{i}", tmp_path / f"out{i}")
        adapter = json.loads((tmp_path / f"out{i}" / ADAPTER_FOLDER / "adapter_config.json"
                              ).read_text())
        assert adapter["base_model_name_or_path"] == base
        said = [n for n in done["notes"] if "names no base model" in n and "rms_norm_eps" in n]
        assert len(said) == (0 if base else 1)  # (what the export returns says why)


def legacy_checkpoint(step, run):
    """A copy of checkpoint `step` in run directory `run`, its weights' adapters named as
    asyncrl named them before 2026-12-04 (`<layer>.lora_A`)."""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp

    from asyncrl.hybrid.export import trained_weights

    old = run / "checkpoints" / step.name
    shutil.copytree(step, old)
    weights = trained_weights(old / "actor")
    shutil.rmtree(old / "actor" / "train")
    with warnings.catch_warnings():  # one process on purpose, which DCP warns of
        warnings.filterwarnings("ignore", message=".*in a single process")
        dcp.save({"model": {k.removesuffix(".weight") if is_adapter(k) else k: v
                            for k, v in weights.items()}},
                 checkpoint_id=str(old / "actor" / "train"), no_dist=True)
    (old / "meta.json").write_text(json.dumps({"step": 0}))
    return old


def test_a_hybrid_vllm_gets_the_lora_layers_merged_and_samples_as_the_builtin_engine(tmp_path):
    """vLLM (faked) has no adapters: the hybrid engine hands it W + scaling B A by the plain
    model's names, and it samples what the built-in engine samples with the adapters apart."""
    import fake_vllm

    from asyncrl.hybrid.engine import HybridEngine
    from asyncrl.hybrid.sampler import Sampler, SamplingConfig

    build_model(ModelConfig(seed=0)).save_pretrained(tmp_path / "ckpt")
    cfg = ModelConfig(path=str(tmp_path / "ckpt"), lora=LORA)
    model = trained_lora_model()
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.8)
    hybrid = HybridEngine(WholeBackend(model), cfg, sampling, engine="vllm", engine_options={
        "llm_cls": fake_vllm.LLM, "sampling_params_cls": fake_vllm.SamplingParams})
    hybrid.to_generate()  # would fail naming any parameter of vLLM's left unfilled
    seeds = list(range(6))
    out = hybrid.generate([[1, 4 + i, 9] for i in seeds], seeds)
    want = Sampler(model, sampling).generate([[1, 4 + i, 9] for i in seeds], seeds)
    assert torch.equal(out["response_ids"], want["response_ids"])
    assert (out["logprobs"] - want["logprobs"]).abs().max().item() < 1e-5


def test_a_bf16_lora_policy_trains_fp32_adapters_that_small_updates_move():
    """On a bf16 model the adapters are fp32 (as peft makes them), FSDP2 sharding them apart
    from the bf16 layers: an update at a LoRA learning rate (1e-5, below a bf16 weight's
    resolution at A's size) moves nearly every element of the adapters; in bf16 it rounded
    away. The
    engine holds the same fp32 adapters."""
    model = {**MODEL, "dtype": "bfloat16"}
    built = build_model(ModelConfig(**model))
    dtypes = {n: p.dtype for n, p in built.named_parameters()}
    assert {d for n, d in dtypes.items() if is_adapter(n)} == {torch.float32}
    assert {d for n, d in dtypes.items() if not is_adapter(n)} == {torch.bfloat16}

    async def main():
        async with asyncrl.Controller() as ctl:
            policy = await ctl.spawn(Policy, model, {**TRAIN, "lr": 1e-5}, SAMPLING, nprocs=2,
                                     name="actor")
            pids = group_pids(policy)
            before = (await policy.weights("train"))[0]
            for _ in range(2):  # (A's gradient is 0 while B is: the second step moves A)
                await policy.train_step(await policy.generate(prompts()))
            after = (await policy.weights("train"))[0]
            return before, after, (await policy.weights("engine"))[0], pids
    before, after, engine, pids = run(main(), timeout=300)
    assert_gone(pids)
    assert {k: v.dtype for k, v in after.items()} == dtypes
    for name in (k for k in after if is_adapter(k)):
        moved = (after[name] != before[name]).float().mean().item()
        assert moved > 0.9, f"{name}: {moved:.0%} of it moved"
    assert all(torch.equal(before[k], after[k]) for k in after if not is_adapter(k))
    assert all(torch.equal(engine[k], v) and engine[k].dtype == v.dtype for k, v in after.items())


class AdapterProbe(asyncrl.Worker):
    @asyncrl.register
    def adapter_dtypes(self, model: dict, train: dict) -> list[tuple[str, str]]:
        """The dtypes the adapters compute in, on this rank's FSDP2 trainer: (weight as the
        forward sees it, output)."""
        from asyncrl.hybrid.fsdp import TrainConfig
        from asyncrl.hybrid.lora import LoraFactor
        from asyncrl.hybrid.roles import make_backend

        backend = make_backend(self, "fsdp2", ModelConfig(**model), TrainConfig(**train))
        seen: set[tuple[str, str]] = set()
        for m in backend.model.modules():
            if isinstance(m, LoraFactor):
                m.register_forward_hook(
                    lambda m, _, out: seen.add((str(m.weight.dtype), str(out.dtype))))
        with torch.no_grad():
            backend.model(input_ids=torch.tensor([[1, 5, 9]]))
        return sorted(seen)


def test_adapters_compute_in_fp32_beside_bf16_layers_as_the_engines_do():
    """Training in bf16 (an fp32 model, FSDP2's bf16 compute; or a bf16 model): the layers
    compute in bf16, the adapters in fp32, as the engine's fp32 adapters beside its bf16
    weights do (FSDP's cast took them to bf16: trainer and engine differed)."""
    async def main():
        async with asyncrl.Controller() as ctl:
            probe = await ctl.spawn(AdapterProbe, nprocs=2)
            pids = group_pids(probe)
            seen = [await probe.adapter_dtypes(MODEL, {"bf16": True}),
                    await probe.adapter_dtypes({**MODEL, "dtype": "bfloat16"}, {}),
                    await probe.adapter_dtypes(MODEL, {})]
            return seen, pids
    seen, pids = run(main(), timeout=300)
    assert_gone(pids)
    fp32 = [[["torch.float32", "torch.float32"]]] * 2  # each rank's
    assert all(s == fp32 for s in seen), seen
