"""The vLLM adapter on CPU, against a fake that follows vLLM's API (tests/fake_vllm.py):
its calls, log-probs, weight loads and sleep, the hybrid engine and roles built on it.
Real vLLM has never run (see the README)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import assert_gone, group_pids, run
from test_engines import PROMPTS, CountingBackend

import asyncrl
from asyncrl import TensorBatch
from asyncrl.hybrid import engine as engine_module
from asyncrl.hybrid.engine import HybridEngine
from asyncrl.hybrid.models import ModelConfig, build_model
from asyncrl.hybrid.roles import Policy, Rollout
from asyncrl.hybrid.sampler import Sampler, SamplingConfig


def test_vllm_adapter_against_a_fake_that_follows_vllm_api(tmp_path):
    import subprocess
    import sys

    import fake_vllm

    from asyncrl.hybrid.vllm_engine import VLLMEngine

    fake_vllm.LLM.calls.clear()
    engine = VLLMEngine("tiny-llama", SamplingConfig(max_new_tokens=6, stop_token_ids=(2,)),
                        llm_cls=fake_vllm.LLM, sampling_params_cls=fake_vllm.SamplingParams)
    init = fake_vllm.LLM.calls[0][1]
    assert init["distributed_executor_backend"] == "external_launcher"
    assert init["dtype"] == "bfloat16"  # VLLMEngine's own default
    assert init["enable_sleep_mode"] is True
    assert init["logprobs_mode"] == "processed_logprobs" and init["skip_tokenizer_init"]
    out = engine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    mine = Sampler(build_model(ModelConfig()), SamplingConfig(max_new_tokens=6,
                                                              stop_token_ids=(2,)))
    want = mine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    for key in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
        assert torch.equal(out[key], want[key]), key
    assert (out["logprobs"] - want["logprobs"]).abs().max().item() < 1e-6
    hot = SamplingConfig(max_new_tokens=6, stop_token_ids=(2,), temperature=0.7)
    hot_out = engine.generate(PROMPTS, seeds=[1, 2, 3, 4], config=hot)
    hot_want = Sampler(mine.model, hot).generate(PROMPTS, seeds=[1, 2, 3, 4])
    assert torch.equal(hot_out["response_ids"], hot_want["response_ids"])
    assert (hot_out["logprobs"] - hot_want["logprobs"]).abs().max().item() < 1e-6  # after T
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    other = build_model(ModelConfig(seed=9))  # new weights while asleep survive the wake-up
    assert engine.load_weights(other.named_parameters(), version=3) == \
        len(list(other.parameters()))
    engine.wake()
    changed = engine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    theirs = Sampler(other, SamplingConfig(max_new_tokens=6, stop_token_ids=(2,))).generate(
        PROMPTS, seeds=[1, 2, 3, 4])
    assert torch.equal(changed["response_ids"], theirs["response_ids"])
    assert not torch.equal(changed["response_ids"], out["response_ids"])
    mask = changed["response_mask"].bool()
    assert changed["versions"][mask].eq(3).all() and changed["versions"][~mask].eq(-1).all()
    assert [(c[0], c[1]) for c in fake_vllm.LLM.calls if c[0] != "init"] == [
        ("sleep", 1), ("wake_up", ["weights"]), ("collective_rpc", "asyncrl_load_weights"),
        ("reset_prefix_cache", None), ("wake_up", ["kv_cache"])]
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        VLLMEngine("tiny-llama", tensor_parallel_size=2, llm_cls=fake_vllm.LLM,
                   sampling_params_cls=fake_vllm.SamplingParams)
    # vLLM's other keywords pass on (the error for a model override advises hf_overrides;
    # it was a TypeError); those the adapter sets are refused
    fake_vllm.LLM.calls.clear()
    VLLMEngine("tiny-llama", llm_cls=fake_vllm.LLM, sampling_params_cls=fake_vllm.SamplingParams,
               max_model_len=128, hf_overrides={"rope_theta": 1e4})
    assert fake_vllm.LLM.calls[0][1]["max_model_len"] == 128
    assert fake_vllm.LLM.calls[0][1]["hf_overrides"] == {"rope_theta": 1e4}
    with pytest.raises(ValueError, match=r"engine_options \['enable_sleep_mode'\] are set by"):
        VLLMEngine("tiny-llama", llm_cls=fake_vllm.LLM,
                   sampling_params_cls=fake_vllm.SamplingParams, enable_sleep_mode=False)
    # vLLM's log-probs after top-p are renormalised over the nucleus: not the trainer's
    with pytest.raises(ValueError, match="top_p=0.9 < 1 is not supported"):
        engine.generate([[1, 4]], seeds=[0], config=SamplingConfig(top_p=0.9))
    # vLLM raises a temperature in (0, 0.01) to 0.01: its samples and log-probs there, the
    # trainer's at the one asked for (below 1e-5 it was taken for greedy decoding: it is not)
    for low in (1e-6, 5e-3):
        with pytest.raises(ValueError, match=f"temperature={low} is below vLLM's lowest "
                                             f"\\(0.01\\), to which vLLM raises it"):
            engine.generate([[1, 4]], seeds=[0], config=SamplingConfig(temperature=low))
    assert fake_vllm.SamplingParams(temperature=5e-3).temperature == 0.01  # (as vLLM's)
    # a vLLM before 0.10.2: no log-probs after temperature (its "processed" ones were before
    # it in 0.10.0-0.10.1): every ratio off 1, unsaid
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCRL_VLLM_MODULE", "fake_vllm")
        for old in ("0.10.1", "0.10.2rc1", "0.10.2.dev5+g1a2b"):  # (a nightly before it)
            mp.setattr(fake_vllm, "__version__", old)
            with pytest.raises(ImportError, match=f"needs vLLM >= 0.10.2 .*found {re.escape(old)}"):
                VLLMEngine("tiny-llama")
    # the engine a role makes computes in the model's dtype, as the trainer (it was bf16
    # whatever the trainer ran in: every PPO ratio started ~1e-2 off 1)
    from asyncrl.hybrid.engine import make_engine

    fake_vllm.LLM.calls.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCRL_VLLM_MODULE", "fake_vllm")
        mp.setattr("asyncrl.hybrid.vllm_engine.require_own_gpu", lambda why: None)
        made = tmp_path / "m"
        build_model(ModelConfig()).save_pretrained(made)
        make_engine("vllm", ModelConfig(path=str(made)), None)
        make_engine("vllm", ModelConfig(path=str(made), dtype="bfloat16"), None,
                    {"dtype": "float16"})
    assert [c[1]["dtype"] for c in fake_vllm.LLM.calls if c[0] == "init"] == [
        "float32", "float16"]
    # vLLM stays out of every CPU import path
    probe = subprocess.run([sys.executable, "-c", "import sys, asyncrl, asyncrl.hybrid.roles, "
                            "asyncrl.hybrid.vllm_engine; print('vllm' in sys.modules)"],
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "False", probe.stderr



def test_vllm_log_probs_missing_are_an_error_not_zeros():
    """The adapter read missing or short log-probs as 0: PPO ratios against log p = 0."""
    import fake_vllm

    from asyncrl.hybrid.vllm_engine import VLLMEngine

    class Short(fake_vllm.LLM):
        def generate(self, *args, **kwargs):
            outs = super().generate(*args, **kwargs)
            for out in outs:
                out.outputs[0].logprobs = out.outputs[0].logprobs[:-1]
            return outs
    vllm = VLLMEngine("tiny-llama", SamplingConfig(max_new_tokens=4), llm_cls=Short,
                      sampling_params_cls=fake_vllm.SamplingParams)
    with pytest.raises(RuntimeError, match=r"vLLM returned 3 log-probs for 4 tokens of "
                                           r"prompt 0"):
        vllm.generate([[1, 2, 3]], [0])


def test_a_prompt_too_long_for_vllm_is_refused_before_vllm_keeps_the_rows_before_it():
    """vLLM up to 0.11.0 refuses a prompt longer than max_model_len after adding the rows
    before it, and hands those to the next call: its rows went into the next call's rows.
    The adapter refuses the prompt first, naming it, and checks each answer's prompt."""
    import fake_vllm

    from asyncrl.hybrid.vllm_engine import VLLMEngine

    vllm = VLLMEngine("tiny-llama", SamplingConfig(max_new_tokens=3), max_model_len=8,
                      llm_cls=fake_vllm.LLM, sampling_params_cls=fake_vllm.SamplingParams)
    with pytest.raises(ValueError, match=r"prompt 1 has 8 tokens, which leaves no room for a "
                                         r"response within vLLM's max_model_len of 8"):
        vllm.generate([[1, 5], [1] * 8], [0, 1])
    out = vllm.generate([[1, 7, 7]], [2])
    assert out["prompt_ids"].tolist() == [[1, 7, 7]] and out["response_mask"].sum() == 3
    vllm.llm.llm_engine = None  # a vLLM that does not say its limit where it is looked for
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        vllm.generate([[1, 5], [1] * 8], [0, 1])
    with pytest.raises(RuntimeError, match="vLLM answered 2 requests for 1 prompts"):
        vllm.generate([[1, 7, 7]], [2])
    assert vllm.generate([[1, 7, 7]], [2])["prompt_ids"].tolist() == [[1, 7, 7]]


def test_vllm_refuses_checkpoints_whose_weights_it_derives_tensors_from(tmp_path,
                                                                        monkeypatch):
    """vLLM derives tensors from a quantized or MLA model's weights once, after loading;
    new weights through load_weights left them as they were: generation from the first
    weights' (or a dummy load's), silently. Refused until that processing runs again."""
    import json

    import fake_vllm

    from asyncrl.hybrid.vllm_engine import VLLMEngine

    for key, value, said in (("quantization_config", {"quant_method": "fp8"}, "quantized"),
                             ("kv_lora_rank", 512, "MLA")):
        folder = tmp_path / key
        build_model(ModelConfig(seed=4)).save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=f"cannot take new weights for .*{said}"):
            VLLMEngine(str(folder), llm_cls=fake_vllm.LLM,
                       sampling_params_cls=fake_vllm.SamplingParams)
    build_model(ModelConfig(seed=4)).save_pretrained(tmp_path / "plain")
    VLLMEngine(str(tmp_path / "plain"), llm_cls=fake_vllm.LLM,  # a dense one: taken
               sampling_params_cls=fake_vllm.SamplingParams)
    # nor an allocator setting its sleep mode refuses (vLLM's own assertion, deep inside)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        with monkeypatch.context() as m:
            m.setenv(name, "expandable_segments:True")
            with pytest.raises(ValueError, match=f"{name} has expandable_segments:True"):
                VLLMEngine(str(tmp_path / "plain"), llm_cls=fake_vllm.LLM,
                           sampling_params_cls=fake_vllm.SamplingParams)


def test_a_hybrid_vllm_refuses_weights_that_leave_some_of_its_parameters_unfilled(tmp_path,
                                                                                monkeypatch):
    """A hybrid's vLLM starts from dummy weights: a parameter the trainer's names do not
    reach would stay random. The trainer's weights must cover the checkpoint's tensors
    (vLLM says a fused qkv_proj filled when any one part came); where the checkpoint does
    not list them (not safetensors), the first fill checks that vLLM's model reported every
    one of its parameters filled. A complete fill generates as the built-in engine does."""
    import fake_vllm

    build_model(ModelConfig(seed=4)).save_pretrained(tmp_path / "ckpt")
    model = build_model(ModelConfig(path=str(tmp_path / "ckpt")))

    class Partial(torch.nn.Module):  # the trainer's model, one parameter short
        def __init__(self, skipped: str):
            super().__init__()
            self.skipped = skipped

        def named_parameters(self, *args, **kwargs):
            return ((n, p) for n, p in model.named_parameters() if n != self.skipped)

    class Backend:
        def __init__(self, module):
            self.model, self.opt = module, torch.optim.AdamW(model.parameters())

        def offload_masters(self) -> int:
            return 0

        def reload_masters(self) -> None:
            pass

    options = {"llm_cls": fake_vllm.LLM, "sampling_params_cls": fake_vllm.SamplingParams}
    sampling = SamplingConfig(max_new_tokens=5)
    cfg = ModelConfig(path=str(tmp_path / "ckpt"))
    skipped = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match=f"no weight for 1 of the checkpoint's tensors "
                                         f"\\({skipped}\\)"):
        HybridEngine(Backend(Partial(skipped)), cfg, sampling, engine="vllm",
                     engine_options=options)
    # a tied model covers a checkpoint that lists its head beside its embeddings (some
    # exports do): named_parameters() leaves the tied head out
    tied = build_model(ModelConfig(preset="tiny-gpt2"))
    listed = {n for n, _ in tied.named_parameters(remove_duplicate=False)}
    assert "lm_head.weight" in listed
    (tmp_path / "tied").mkdir()
    (tmp_path / "tied" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model.safetensors" for n in listed}}))
    engine_module._check_covers(str(tmp_path / "tied"), tied)
    monkeypatch.setattr(engine_module, "checkpoint_tensors", lambda path: None)  # (.bin)
    short = HybridEngine(Backend(Partial(skipped)), cfg, sampling, engine="vllm",
                         engine_options=options)
    with pytest.raises(RuntimeError, match=f"left 1 of vLLM's parameters unfilled "
                                           f"\\(vllm_internal.{skipped}\\)"):
        short.to_generate()
    assert short.mode == "train"
    assert short.engine.llm.asleep == {"weights", "kv_cache"}  # the weights it woke: asleep
    whole = HybridEngine(Backend(model), cfg, sampling, engine="vllm", engine_options=options)
    whole.to_generate()
    out = whole.generate(PROMPTS, [1, 2, 3, 4])
    want = Sampler(model, sampling).generate(PROMPTS, seeds=[1, 2, 3, 4])
    assert torch.equal(out["response_ids"], want["response_ids"])


def test_a_rollout_tags_loads_with_versions_and_keeps_the_newest():
    """Rollout.load_weights runs on a pool beside generations: a dict without a version would
    leave tokens tagged with the old one (refused), and an older load finishing after a
    newer one is dropped (the engine would have gone back a version)."""
    from asyncrl.hybrid.roles import Rollout

    rollout = Rollout.__new__(Rollout)
    rollout.__init__({"preset": "tiny-llama", "seed": 1})
    params = dict(rollout.engine.model.named_parameters())

    def weights(fill: float) -> dict:
        return {k: torch.full_like(p, fill) for k, p in params.items()}
    with pytest.raises(ValueError, match="give version= .* every token is tagged with it"):
        rollout.load_weights(weights(1.0))
    assert rollout.load_weights(weights(5.0), version=5)["sync/version"] == 5
    assert rollout.load_weights(weights(3.0), version=3) == {"sync/version": 5.0,
                                                             "sync/stale": 1.0}
    assert all(p.eq(5.0).all() for p in rollout.engine.model.parameters())
    assert rollout.engine.version == 5


def test_roles_generate_with_vllm_from_a_checkpoint_and_keep_its_weights(tmp_path):
    """engine="vllm" in real torchrun groups, vLLM faked (ASYNCRL_VLLM_MODULE): the hybrid
    Policy hands its trained weights to vLLM by name (vLLM fuses projections: it cannot be
    written in place) and generates as the built-in engine does with the same weights; a
    Rollout takes a sync pack, and its checkpoint brings back vLLM's weights and version.
    The hybrid's vLLM starts from dummy weights and sleeps at level 2 (no host copy): the
    trainer fills it before each generation."""
    build_model(ModelConfig(seed=4)).save_pretrained(tmp_path / "ckpt")
    model = {"path": str(tmp_path / "ckpt")}
    (tmp_path / "calls").mkdir()
    env = {"ASYNCRL_VLLM_MODULE": "fake_vllm", "PYTHONPATH": str(Path(__file__).parent),
           "FAKE_VLLM_CALLS": str(tmp_path / "calls")}
    sampling = {"max_new_tokens": 5, "temperature": 0.8}
    train = {"lr": 3e-2, "micro_batch_size": 4}
    batch = TensorBatch({"prompt": [[1, 4 + i, 9] for i in range(4)], "seed": list(range(4))})

    async def main():
        async with asyncrl.Controller() as ctl:
            on_vllm, builtin, rollout = await asyncio.gather(
                ctl.spawn(Policy, model, train, sampling, engine="vllm", env=env,
                          name="on_vllm"),
                ctl.spawn(Policy, model, train, sampling, name="builtin"),
                ctl.spawn(Rollout, model, sampling, engine="vllm", env=env, name="rollout"))
            pids = group_pids(on_vllm) + group_pids(builtin) + group_pids(rollout)
            first = [await on_vllm.generate(batch), await builtin.generate(batch)]
            for policy in (on_vllm, builtin):
                await policy.train_step(first[1])
            trained = [await on_vllm.generate(batch), await builtin.generate(batch)]
            synced = await rollout.load_weights(builtin.sync_pack())
            from_rollout = await rollout.generate(batch)
            # greedy for one call (validation), whatever the seeds, on each engine
            reseeded = TensorBatch({"prompt": batch["prompt"], "seed": [7, 5, 3, 1]})
            greedy = [await on_vllm.generate(batch, {"temperature": 0}),
                      await builtin.generate(reseeded, {"temperature": 0}),
                      await rollout.generate(batch, sampling={"temperature": 0,
                                                              "max_new_tokens": 3})]
            await rollout.save_checkpoint(str(tmp_path / "saved"))
            await rollout.load_weights(other, version=9)
            changed = await rollout.generate(batch)
            await rollout.load_checkpoint(str(tmp_path / "saved"))
            restored = await rollout.generate(batch)
            return first, trained, synced, from_rollout, changed, restored, pids, \
                (list(on_vllm.pids.values()), list(rollout.pids.values())), greedy
    other = {k: v.detach() for k, v in build_model(ModelConfig(seed=7)).named_parameters()}
    first, trained, synced, from_rollout, changed, restored, pids, (hybrid, separate), \
        greedy = run(main(), timeout=300)
    assert_gone(pids)
    calls = {int(f.stem): [json.loads(line) for line in f.read_text().splitlines()]
             for f in (tmp_path / "calls").iterdir()}
    assert sorted(calls) == sorted(hybrid + separate)
    for pid in hybrid:
        assert calls[pid][0][1]["load_format"] == "dummy"
        assert {arg for name, arg in calls[pid] if name == "sleep"} == {2}
    for pid in separate:  # a Rollout loads the checkpoint and never sleeps
        assert calls[pid][0][1]["load_format"] == "auto"
        assert not [name for name, _ in calls[pid] if name == "sleep"]
    for on_vllm, builtin in (first, trained):
        assert torch.equal(on_vllm["response_ids"], builtin["response_ids"])
        assert (on_vllm["logprobs"] - builtin["logprobs"]).abs().max().item() < 1e-5
    assert not torch.equal(first[1]["response_ids"], trained[1]["response_ids"])  # it trained
    assert synced["sync/version"] == 1.0
    assert torch.equal(from_rollout["response_ids"], trained[1]["response_ids"])
    assert from_rollout["versions"][from_rollout["response_mask"].bool()].eq(1).all()
    assert not torch.equal(changed["response_ids"], from_rollout["response_ids"])
    assert changed["versions"][changed["response_mask"].bool()].eq(9).all()
    assert torch.equal(restored["response_ids"], from_rollout["response_ids"])
    assert restored["versions"][restored["response_mask"].bool()].eq(1).all()
    assert torch.equal(greedy[0]["response_ids"], greedy[1]["response_ids"])
    assert torch.equal(greedy[2]["response_ids"], greedy[1]["response_ids"][:, :3])
    assert not torch.equal(greedy[1]["response_ids"], trained[1]["response_ids"])  # sampled
    assert [g.meta["temperature"] for g in greedy] == [1.0, 1.0, 1.0]
    assert changed.meta["temperature"] == 0.8  # the rollout's next call samples as before


def test_a_switch_that_fails_is_undone_and_a_failed_restore_is_done_by_the_next_to_train(
        tmp_path):
    """vLLM's KV cache not fitting as it woke left the hybrid in train mode with the
    optimizer offloaded and vLLM's weights awake; a restore that failed in to_train left it
    in generate mode with the engine asleep. Each later switch returned at once, so
    training ran with its optimizer away (or generation with its engine asleep)."""
    import fake_vllm

    build_model(ModelConfig(seed=4)).save_pretrained(tmp_path / "ckpt")
    fail = {"wake": 1, "reload": 0}

    class Flaky(fake_vllm.LLM):
        def wake_up(self, tags=None):
            if tags == ["kv_cache"] and fail["wake"]:
                fail["wake"] -= 1
                raise torch.OutOfMemoryError("CUDA out of memory (the KV cache)")
            super().wake_up(tags)

    backend = CountingBackend(build_model(ModelConfig(path=str(tmp_path / "ckpt"))), fail)
    hybrid = HybridEngine(backend, ModelConfig(path=str(tmp_path / "ckpt")),
                          SamplingConfig(max_new_tokens=3), engine="vllm",
                          engine_options={"llm_cls": Flaky,
                                          "sampling_params_cls": fake_vllm.SamplingParams})
    hybrid._move_optimizer = lambda device: backend.moves.append(f"state to {device}")
    with pytest.raises(torch.OutOfMemoryError, match="KV cache"):
        hybrid.to_generate()
    assert hybrid.mode == "train" and hybrid.engine.llm.asleep == {"weights", "kv_cache"}
    assert backend.moves[-2:] == ["masters back", "state to cpu"]  # (cpu: these weights')
    hybrid.to_generate()  # goes now
    assert hybrid.generate(PROMPTS, [1, 2, 3, 4])["response_ids"].shape[0] == 4
    fail["reload"] = 1
    with pytest.raises(torch.OutOfMemoryError, match="masters"):
        hybrid.to_train()
    assert hybrid.mode == "train" and hybrid.engine.asleep
    backend.moves.clear()
    hybrid.to_train()  # the restore done now
    assert backend.moves == ["masters back", "state to cpu"] and not hybrid._offloaded


def test_a_weight_load_failing_midway_leaves_vllm_refusing_to_generate():
    """vLLM copies a load tensor by tensor: one it cannot take (a name it does not know, a
    shape, a CUDA error) left those before it new, under the old version and the old cached
    prefixes, and the next generation ran on the torn model. Now generation is refused until
    a whole load goes through, which resets the prefix cache and tags its version."""
    import fake_vllm

    from asyncrl.hybrid.vllm_engine import VLLMEngine

    sampling = SamplingConfig(max_new_tokens=4)
    engine = VLLMEngine("tiny-llama", sampling, llm_cls=fake_vllm.LLM,
                        sampling_params_cls=fake_vllm.SamplingParams)
    new = build_model(ModelConfig(seed=9))
    named = [(n, p.detach()) for n, p in new.named_parameters()]
    with pytest.raises(KeyError, match="model.no_such.weight"):
        engine.load_weights([*named[:2], ("model.no_such.weight", named[0][1])], version=3)
    assert engine.version == 0
    with pytest.raises(RuntimeError, match=r"a weight load \(asyncrl_load_weights\) "
                                           r"failed midway.* load the whole weights again"):
        engine.generate(PROMPTS, [1, 2, 3, 4])
    fake_vllm.LLM.calls.clear()
    engine.load_weights(named, version=3)
    assert fake_vllm.LLM.calls == [("collective_rpc", "asyncrl_load_weights"),
                                   ("collective_rpc", "asyncrl_unfilled"),  # (all filled?)
                                   ("reset_prefix_cache", None)]
    out = engine.generate(PROMPTS, [1, 2, 3, 4])
    assert out["versions"][out["response_mask"].bool()].eq(3).all()
    want = Sampler(new, sampling).generate(PROMPTS, seeds=[1, 2, 3, 4])
    assert torch.equal(out["response_ids"], want["response_ids"])


def test_a_hybrid_fill_failing_midway_is_filled_whole_by_the_next_switch(tmp_path):
    """The hybrid's own recovery from a fill that failed midway (vLLM slept, every bucket
    loaded again at the next switch) is not stopped by the refusal a torn load leaves."""
    import fake_vllm

    build_model(ModelConfig(seed=4)).save_pretrained(tmp_path / "ckpt")
    loads = [0]

    class FailsSecondBucket(fake_vllm.LLM):
        def collective_rpc(self, method, args=()):
            out = super().collective_rpc(method, args)
            if method == "asyncrl_load_weights":
                loads[0] += 1
                if loads[0] == 2:  # the second bucket, after its copies
                    raise RuntimeError("fake LLM: CUDA error midway through a load")
            return out

    sampling = SamplingConfig(max_new_tokens=3)
    backend = CountingBackend(build_model(ModelConfig(path=str(tmp_path / "ckpt"))))
    hybrid = HybridEngine(backend, ModelConfig(path=str(tmp_path / "ckpt")), sampling,
                          bucket_bytes=1, engine="vllm",
                          engine_options={"llm_cls": FailsSecondBucket,
                                          "sampling_params_cls": fake_vllm.SamplingParams})
    with pytest.raises(RuntimeError, match="CUDA error midway"):
        hybrid.to_generate()
    assert hybrid.mode == "train" and hybrid.engine.llm.asleep == {"weights", "kv_cache"}
    hybrid.to_generate()
    out = hybrid.generate(PROMPTS, [1, 2, 3, 4])
    want = Sampler(backend.model, sampling).generate(PROMPTS, seeds=[1, 2, 3, 4])
    assert torch.equal(out["response_ids"], want["response_ids"])


def test_after_a_torn_load_only_loads_filling_every_weight_or_a_whole_state_let_vllm_generate():
    """A torn load's refusal was lifted by any later load that went through: a one-tensor
    load (Rollout.load_weights allows a part) left vLLM generating on a mixed model tagged
    with its version, and state_dict() saved the torn weights under the old version. Now the
    loads since must fill every parameter vLLM holds (however many calls), or a whole state
    (load_state_dict) go in; state_dict() is refused while torn."""
    import fake_vllm

    from asyncrl.hybrid.vllm_engine import VLLMEngine

    engine = VLLMEngine("tiny-llama", SamplingConfig(max_new_tokens=3), llm_cls=fake_vllm.LLM,
                        sampling_params_cls=fake_vllm.SamplingParams)
    saved = engine.state_dict()
    named = [(n, p.detach()) for n, p in build_model(ModelConfig(seed=9)).named_parameters()]

    def tear() -> None:
        with pytest.raises(KeyError, match="model.no_such.weight"):
            engine.load_weights([*named[:2], ("model.no_such.weight", named[0][1])], 3)
    tear()
    engine.load_weights([named[-1]], version=4)  # one tensor: the rest are not all new
    assert engine.version == 4
    with pytest.raises(RuntimeError, match=rf"refuses to generate: .* left {len(named) - 1} "
                                           r"of vLLM's parameters unloaded"):
        engine.generate(PROMPTS, [1, 2, 3, 4])
    with pytest.raises(RuntimeError, match=r"refuses to save its weights \(a checkpoint would "
                                           r"keep the torn model, under version 4\)"):
        engine.state_dict()
    engine.load_weights(named[:-1], version=5)  # with the one before: every parameter
    assert engine.generate(PROMPTS, [1, 2, 3, 4])["versions"].max() == 5
    tear()
    engine.load_state_dict(saved, version=1)  # a whole state
    assert engine.generate(PROMPTS, [1, 2, 3, 4])["versions"].max() == 1
    assert all(torch.equal(v, saved[k]) for k, v in engine.state_dict().items())


def test_a_head_that_vllms_tied_model_would_skip_is_refused_not_dropped(tmp_path):
    """vLLM's model of a tied config skips lm_head.* in load_weights (its head is the
    embeddings): the head of a trainer that unties it (model overrides
    {"tie_word_embeddings": False}) was dropped, unsaid, and the rollouts sampled with the
    embeddings as their head. Refused before vLLM copies anything; a tied trainer's weights
    (its head left out, the embeddings' tensor, or a copy of it) load."""
    import fake_vllm

    from asyncrl.hybrid.vllm_engine import VLLMEngine

    tie = {"tie_word_embeddings": True}
    build_model(ModelConfig(seed=4, overrides=tie)).save_pretrained(tmp_path / "tied")
    sampling = SamplingConfig(max_new_tokens=5)
    engine = VLLMEngine(str(tmp_path / "tied"), sampling, llm_cls=fake_vllm.LLM,
                        sampling_params_cls=fake_vllm.SamplingParams)
    untied = build_model(ModelConfig(path=str(tmp_path / "tied"),
                                     overrides={"tie_word_embeddings": False}))
    with torch.no_grad():
        untied.lm_head.weight.mul_(2)  # trained apart from the embeddings
    fake_vllm.LLM.calls.clear()
    with pytest.raises(ValueError, match=r"cannot take lm_head.weight: vLLM's model ties "
                                         r"lm_head to the embeddings .*'hf_overrides'"):
        engine.load_weights(untied.named_parameters(), version=1)
    assert not fake_vllm.LLM.calls and engine.version == 0  # (not torn: it generates)
    engine.generate(PROMPTS, [1, 2, 3, 4])
    tied = build_model(ModelConfig(seed=9, overrides=tie))
    copied = {k: v.clone() for k, v in tied.state_dict().items()}  # (as over RPC)
    for version, named in enumerate((tied.named_parameters(), tied.state_dict().items(),
                                     copied.items()), start=1):
        assert engine.load_weights(named, version=version) > 0
    out = engine.generate(PROMPTS, [1, 2, 3, 4])
    want = Sampler(tied, sampling).generate(PROMPTS, seeds=[1, 2, 3, 4])
    assert torch.equal(out["response_ids"], want["response_ids"])
    assert out["versions"].max() == 3
