"""Generation engines on CPU: the built-in Sampler, the vLLM adapter against a fake that
follows vLLM's API (tests/fake_vllm.py), and roles built on either."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from helpers import assert_gone, group_pids, run

import asyncrl
from asyncrl import TensorBatch
from asyncrl.hybrid import engine as engine_module
from asyncrl.hybrid.engine import HybridEngine
from asyncrl.hybrid.models import ModelConfig, build_model, sequence_logprobs
from asyncrl.hybrid.roles import Policy, Rollout
from asyncrl.hybrid.sampler import Sampler, SamplingConfig, sample, streams, top_p_filter, uniforms

PROMPTS = [[1, 5, 6], [1, 7], [1, 9, 10, 11, 12], [1, 3]]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_engine_logprobs_equal_a_training_forward_pass(preset):
    model = build_model(ModelConfig(preset=preset))
    out = Sampler(model, SamplingConfig(max_new_tokens=10)).generate(PROMPTS, seeds=[1, 2, 3, 4])
    forward = sequence_logprobs(model, out["prompt_ids"], out["prompt_mask"],
                                out["response_ids"], out["response_mask"])
    assert (forward - out["logprobs"]).abs().max().item() < 1e-5
    assert out["response_mask"].sum().item() == 4 * 10


def test_a_model_config_takes_a_preset_or_a_path_and_defaults_to_tiny_llama():
    """path= alone was refused: the preset default was there too."""
    assert ModelConfig().preset == "tiny-llama"
    assert (ModelConfig(path="/ckpt").preset, ModelConfig(path="/ckpt").path) == (None, "/ckpt")
    with pytest.raises(ValueError, match="preset= .* or path= .*not both: got preset='tiny-"):
        ModelConfig(preset="tiny-llama", path="/ckpt")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        ModelConfig(preset="huge")


def test_a_bf16_preset_keeps_its_rope_frequencies_in_fp32():
    """Module.to(bf16) cast the rotary inv_freq buffer too: a bf16 engine beside an fp32
    trainer (mixed precision casts parameters only) rotated positions differently (0.45 rad
    apart at position 1024), as a checkpoint loaded in bf16 does not."""
    fp32 = build_model(ModelConfig(preset="tiny-llama"))
    bf16 = build_model(ModelConfig(preset="tiny-llama", dtype="bfloat16"))
    rope = bf16.model.rotary_emb
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(
        rope.inv_freq, fp32.model.rotary_emb.inv_freq)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    for (name, a), (_, b) in zip(fp32.named_parameters(), bf16.named_parameters(), strict=True):
        assert torch.equal(a.to(torch.bfloat16), b), name  # the same seed, the same weights


def test_seeds_stop_tokens_temperature_and_top_p():
    model = build_model(ModelConfig())
    engine = Sampler(model)
    cfg = SamplingConfig(max_new_tokens=12, temperature=0.7)
    a = engine.generate(PROMPTS, seeds=[1, 2, 3, 4], config=cfg)
    b = engine.generate(PROMPTS, seeds=[1, 2, 3, 4], config=cfg)
    c = engine.generate(PROMPTS, seeds=[5, 6, 7, 8], config=cfg)
    assert torch.equal(a["response_ids"], b["response_ids"])  # a seed per sample
    assert not torch.equal(a["response_ids"], c["response_ids"])
    forward = sequence_logprobs(model, a["prompt_ids"], a["prompt_mask"], a["response_ids"],
                                a["response_mask"], temperature=0.7)
    assert (forward - a["logprobs"]).abs().max().item() < 1e-5
    stop = int(a["response_ids"][0, 3])  # make that token a stop token: row 0 ends there
    s = engine.generate(PROMPTS, seeds=[1, 2, 3, 4],
                        config=SamplingConfig(max_new_tokens=12, temperature=0.7,
                                              stop_token_ids=(stop,)))
    first = (a["response_ids"][0] == stop).nonzero()[0].item()
    mask = s["response_mask"][0].tolist()
    assert mask == [1] * (first + 1) + [0] * (12 - first - 1)  # a prefix, stop included
    assert s["response_ids"][0, first] == stop and s["logprobs"][0, first + 1:].eq(0).all()
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    kept = top_p_filter(logits, 0.7).isfinite()[0].tolist()
    assert kept == [True, True, False, False]  # 0.64 < 0.7: the second token is kept too
    with pytest.raises(ValueError, match="one seed per sample"):
        engine.generate(PROMPTS, seeds=[1])
    for bad in (-1, float("nan")):  # NaN failed each step later, blamed on the weights
        with pytest.raises(ValueError, match="temperature must be >= 0 \\(0: greedy "):
            SamplingConfig(temperature=bad)
    for name, bad in (("temperature", "0.7"), ("top_p", "0.9"), ("temperature", True)):
        with pytest.raises(ValueError, match=f"SamplingConfig.{name} must be a number, got"):
            SamplingConfig(**{name: bad})
    # left padding is embedded too; past GPT-2's learned positions an IndexError (a device
    # assert on a GPU, which ends the CUDA context)
    with pytest.raises(ValueError, match="pad_token_id=500 is outside the model's vocabulary"):
        engine.generate(PROMPTS, seeds=[1, 2, 3, 4], config=SamplingConfig(pad_token_id=500))
    gpt2 = Sampler(build_model(ModelConfig(preset="tiny-gpt2")))
    with pytest.raises(ValueError, match=r"longest prompt plus max_new_tokens=254 is 257 "
                                         r"positions, beyond the model's 256"):
        gpt2.generate([[1, 2, 3]], seeds=[0], config=SamplingConfig(max_new_tokens=254))
    # a rotary model (Llama) past max_position_embeddings: positions never trained on, which
    # it generated unsaid; with rope_scaling (YaRN keeps the original limit) it may go on
    llama = build_model(ModelConfig())
    with pytest.raises(ValueError, match=r"is 257 positions, beyond the model's 256"):
        Sampler(llama).generate([[1, 2, 3]], seeds=[0],
                                config=SamplingConfig(max_new_tokens=254))
    setattr(llama.config, "rope_parameters" if hasattr(llama.config, "rope_parameters") else
            "rope_scaling", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert Sampler(llama).generate([[1, 2, 3]], seeds=[0], config=SamplingConfig(
        max_new_tokens=254))["response_ids"].shape == (1, 254)


def test_temperature_zero_decodes_greedily_as_transformers_does():
    """Greedy (validation): the most likely token at each step, whatever the seeds, as
    transformers' generate(do_sample=False); log-probs at temperature 1, which the batch's
    meta says (as vLLM reports them for greedy requests)."""
    from asyncrl.hybrid.sampler import with_overrides

    model = build_model(ModelConfig(seed=6))
    engine = Sampler(model, SamplingConfig(max_new_tokens=8, temperature=0.7))
    greedy = with_overrides(engine.config, {"temperature": 0})
    assert (greedy.temperature, greedy.max_new_tokens, engine.config.temperature) == (0, 8, 0.7)
    widths = []  # the LM head's positions per forward pass: the prefill's last one only
    model.lm_head.register_forward_hook(lambda m, i, o: widths.append(o.shape[1]))
    out = engine.generate(PROMPTS, seeds=[1, 2, 3, 4], config=greedy)
    assert widths == [1] * 8
    again = engine.generate(PROMPTS, seeds=[9, 8, 7, 6], config=greedy)
    assert torch.equal(out["response_ids"], again["response_ids"])
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
        assert out["response_ids"][i].tolist() == want[0, len(prompt):].tolist()
    forward = sequence_logprobs(model, out["prompt_ids"], out["prompt_mask"],
                                out["response_ids"], out["response_mask"], temperature=1.0)
    assert (forward - out["logprobs"]).abs().max().item() < 1e-5
    assert out.meta["temperature"] == 1.0
    with pytest.raises(ValueError, match=r"\['temp'\] are not sampling settings; they are "
                                         r"\['max_new_tokens', 'pad_token_id'"):
        with_overrides(engine.config, {"temp": 0})
    with pytest.raises(ValueError, match="top_p must be in"):
        with_overrides(engine.config, {"top_p": 0})
    # a count given as a fraction (a command line's max_new_tokens=2.5), an id as text
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 2.5"):
        with_overrides(engine.config, {"max_new_tokens": 2.5})
    with pytest.raises(ValueError, match=r"token ids \(an int >= 0, and a list of them\), "
                                         r"got 0 and \['2'\]"):
        with_overrides(engine.config, {"stop_token_ids": ["2"]})
    import numpy as np  # a tokenizer's ids may be numpy's: taken, as plain ints

    taken = with_overrides(engine.config, {"stop_token_ids": [np.int64(2)]})
    assert taken.stop_token_ids == [2] and type(taken.stop_token_ids[0]) is int
    vocab = engine.model.get_input_embeddings().num_embeddings  # not torch's IndexError
    with pytest.raises(ValueError, match=rf"prompt 1 has token ids outside the model's "
                                         rf"vocabulary of {vocab} \(\[{vocab}, -1\]\)"):
        engine.generate([[1, 2], [3, vocab, -1]], [0, 1])


def test_sampling_follows_the_distribution_and_depends_on_seed_and_step_only():
    probs = torch.tensor([0.5, 0.3, 0.0, 0.2]).expand(20_000, 4)
    stream = streams(range(20_000))
    drawn = sample(probs, uniforms(stream, step=0))
    freq = torch.bincount(drawn, minlength=4) / 20_000
    # 4 standard deviations of a binomial at n=20,000 is below 0.015
    assert (freq - probs[0]).abs().max().item() < 0.015 and freq[2] == 0
    later = sample(probs, uniforms(stream, step=1))
    assert 0.3 < (later == drawn).float().mean().item() < 0.45  # steps independent (0.38)
    u = uniforms(stream, 0)
    assert 0 <= u.min().item() and u.max().item() < 1 and abs(u.mean().item() - 0.5) < 0.01
    # a sample draws the same uniforms alone or in any batch, whatever its seed's size
    assert torch.equal(uniforms(streams([7]), 3)[0], uniforms(streams([5, 6, 7]), 3)[2])
    assert uniforms(streams([-1, 2**64 - 1, 2**70]), 0).isfinite().all()
    one_hot = torch.tensor([[0.0, 0.0, 1.0]])  # top-p left one token: always that one
    assert sample(one_hot, torch.tensor([0.0])).item() == 2
    assert sample(one_hot, torch.tensor([1 - 2**-53])).item() == 2
    cut = torch.tensor([[0.3, 0.7, 0.0]])  # u rounds up to the total in fp32: not token 2
    assert sample(cut, torch.tensor([1 - 2**-30], dtype=torch.float64)).item() == 1
    with pytest.raises(ValueError, match="probabilities contain NaN"):
        sample(torch.tensor([[float("nan"), 1.0]]), torch.tensor([0.5]))
    model = build_model(ModelConfig())
    engine = Sampler(model, SamplingConfig(max_new_tokens=8))
    alone = engine.generate(PROMPTS[2:3], seeds=[3])
    batch = engine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    n = int(alone["response_mask"].sum())
    assert torch.equal(alone["response_ids"][0, :n], batch["response_ids"][2, :n])


def test_engine_loads_weights_in_place_and_sleeps():
    src, dst = build_model(ModelConfig(seed=1)), build_model(ModelConfig(seed=2))
    engine = Sampler(dst)
    before = {n: p.data_ptr() for n, p in dst.named_parameters()}
    assert engine.load_weights(src.named_parameters()) == len(before)
    assert all(torch.equal(p, dict(src.named_parameters())[n]) for n, p in dst.named_parameters())
    assert {n: p.data_ptr() for n, p in dst.named_parameters()} == before  # no new memory
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, seeds=[0, 0, 0, 0])
    engine.wake()
    assert len(engine.generate(PROMPTS, seeds=[0, 0, 0, 0])) == 4


def test_a_paused_engine_holds_its_generation_at_a_token_boundary_until_resumed():
    """pause() from another thread (a weight sync's): the generation in flight stops between
    two token steps, keeps its tokens, takes no new call, and goes on once resumed, with the
    tokens an undisturbed generation gives (the same weights, the same seeds)."""
    import threading

    engine = Sampler(build_model(ModelConfig(seed=3)), SamplingConfig(max_new_tokens=6))
    want = engine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    steps, held = [], threading.Event()

    def on_token(step):
        steps.append(step)
        if step == 2:
            engine.pause()
            held.set()
    engine.on_token = on_token
    out = {}
    worker = threading.Thread(target=lambda: out.update(got=engine.generate(
        PROMPTS, seeds=[1, 2, 3, 4])))
    worker.start()
    assert held.wait(60)
    worker.join(0.5)  # it would have finished its 6 tokens by now
    assert worker.is_alive() and steps == [1, 2] and engine.paused
    with pytest.raises(RuntimeError, match=r"paused: resume\(\) it before generating"):
        engine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    engine.resume()
    worker.join(60)
    assert not worker.is_alive() and steps == [1, 2, 3, 4, 5]
    for key in ("response_ids", "response_mask", "logprobs"):
        assert torch.equal(out["got"][key], want[key]), key


def test_engine_takes_state_dicts_of_tied_models_bf16_packs_and_refuses_bad_ones_whole():
    src, dst = build_model(ModelConfig(preset="tiny-gpt2", seed=1)), build_model(
        ModelConfig(preset="tiny-gpt2", seed=2))
    engine = Sampler(dst)
    state = src.state_dict()  # its tied lm_head.weight is a name of the embedding too
    assert engine.load_weights(state.items()) == len(state)
    assert all(torch.equal(v, dst.state_dict()[k]) for k, v in state.items())
    half = {k: v.to(torch.bfloat16) for k, v in build_model(
        ModelConfig(preset="tiny-gpt2", seed=3)).state_dict().items()}  # a bf16 trainer's pack
    assert engine.adopt_weights(half.items(), version=4) == len(half)
    assert all(p.dtype == torch.float32 for p in dst.parameters()) and engine.version == 4
    assert all(torch.equal(v.float(), dst.state_dict()[k]) for k, v in half.items())
    kept = {k: v.clone() for k, v in dst.state_dict().items()}
    bad = [*state.items(), ("transformer.wte.weight", torch.zeros(3, 3))]
    with pytest.raises(ValueError, match=r"transformer.wte.weight is \(3, 3\)"):
        engine.adopt_weights(bad, version=5)
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.load_weights([*state.items(), ("nope", torch.zeros(1))])
    assert all(torch.equal(v, dst.state_dict()[k]) for k, v in kept.items())  # nothing changed
    assert engine.version == 4



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
        mp.setattr(fake_vllm, "__version__", "0.10.1")
        with pytest.raises(ImportError, match=r"needs vLLM >= 0.10.2 .*found 0.10.1"):
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
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments:True, which vLLM's sleep mode"):
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


def test_engine_choices_are_checked_before_anything_is_built():
    from asyncrl.hybrid.engine import make_engine

    with pytest.raises(ValueError, match="engine='vllm' loads a local checkpoint: give "
                                         "model=\\{'path': DIR\\}; the preset 'tiny-llama'"):
        make_engine("vllm", ModelConfig(), None)
    with pytest.raises(ValueError, match="engine is one of \\('builtin', 'vllm'\\), got 'vlm'"):
        make_engine("vlm", ModelConfig(), None)
    with pytest.raises(ValueError, match="engine_options \\['gpu_memory_utilization'\\] are "
                                         "for engine='vllm'"):
        make_engine("builtin", ModelConfig(), None, {"gpu_memory_utilization": 0.3})
    with pytest.raises(ValueError, match="the model overrides \\['vocab_size'\\] would reach "
                                         "the trainer only"):
        make_engine("vllm", ModelConfig(path="/ckpt", overrides={"vocab_size": 64}), None)


def test_a_checkpoints_model_stops_at_its_end_of_sequence_beside_the_stops_given(tmp_path):
    """verl stops at the model's EOS: a checkpoint given by path generated on past it unless
    stop_token_ids were given, and stop_token_ids given (a chat model's end-of-turn token)
    replaced its EOS: a response went on past it. Its generation_config's ids, else its
    config's, beside those given; [] for none at all."""
    import json

    from asyncrl.hybrid.roles import sampling_config

    build_model(ModelConfig(seed=4)).save_pretrained(tmp_path / "ckpt")
    path = str(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert sampling_config({}, ModelConfig(path=path)).stop_token_ids == [config["eos_token_id"]]
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [5, 7]}))
    assert sampling_config(None, ModelConfig(path=path)).stop_token_ids == [5, 7]
    assert sampling_config({"stop_token_ids": [9, 7]}, ModelConfig(path=path)
                           ).stop_token_ids == [9, 7, 5]
    assert sampling_config({"stop_token_ids": []}, ModelConfig(path=path)).stop_token_ids == []
    assert sampling_config({}, ModelConfig(seed=0)).stop_token_ids == ()  # a preset: none


def test_the_hybrid_engine_offloads_the_optimizer_unless_told_to_keep_it():
    """offload_optimizer=False (a Policy's argument too): a switch moves neither the
    optimizer's state nor a backend's masters; True (the default) moves both off for
    generation and back for training."""
    class Counting:
        def __init__(self) -> None:
            self.model = build_model(ModelConfig())
            self.opt = torch.optim.AdamW(self.model.parameters())
            self.moves: list[str] = []

        def offload_masters(self) -> int:
            self.moves.append("masters off")
            return 123

        def reload_masters(self) -> None:
            self.moves.append("masters back")

    with pytest.raises(TypeError, match=r"offload_optimizer is True .* got 'yes'"):
        HybridEngine(Counting(), ModelConfig(), offload_optimizer="yes")
    for offload, moves, moved in (
            (True, ["state to cpu", "masters off", "masters back", "state to cpu"], 123),
            (False, [], 0)):
        backend = Counting()
        hybrid = HybridEngine(backend, ModelConfig(), offload_optimizer=offload)
        hybrid._move_optimizer = lambda device, b=backend: b.moves.append(f"state to {device}")
        hybrid.to_generate()
        assert hybrid.offloaded_bytes == moved
        hybrid.to_train()
        assert backend.moves == moves, offload
    # the flag turned off while generating: the way back still undoes the offload, and the
    # next switch moves nothing (nor reports the bytes of the one before)
    backend = Counting()
    hybrid = HybridEngine(backend, ModelConfig())
    hybrid._move_optimizer = lambda device, b=backend: b.moves.append(f"state to {device}")
    hybrid.to_generate()
    hybrid.offload_optimizer = False
    hybrid.to_train()
    hybrid.to_generate()
    assert backend.moves == ["state to cpu", "masters off", "masters back", "state to cpu"]
    assert hybrid.offloaded_bytes == 0


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

    class Backend:
        def __init__(self) -> None:
            self.model = build_model(ModelConfig(path=str(tmp_path / "ckpt")))
            self.opt = torch.optim.AdamW(self.model.parameters())
            self.moves: list[str] = []

        def offload_masters(self) -> int:
            self.moves.append("masters off")
            return 1

        def reload_masters(self) -> None:
            if fail["reload"]:
                fail["reload"] -= 1
                raise torch.OutOfMemoryError("CUDA out of memory (the masters)")
            self.moves.append("masters back")

    backend = Backend()
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


def test_weights_adopted_are_all_taken_or_none():
    """A copy failing half-way (out of memory converting a pack's dtype) left the weights
    before it new and the rest old, under the old version: a torn model generated on."""
    sampler = Sampler(build_model(ModelConfig()))
    (a, first), (b, second) = list(sampler.model.named_parameters())[:2]
    before = first.detach().clone()
    with pytest.raises(NotImplementedError):  # a meta tensor cannot be copied to the CPU
        sampler.adopt_weights([(a, torch.ones_like(first)),
                               (b, torch.empty(second.shape, device="meta"))], version=5)
    assert torch.equal(sampler.model.get_parameter(a), before) and sampler.version == 0
    sampler.adopt_weights([(a, torch.ones_like(first, dtype=torch.bfloat16))], version=6)
    assert sampler.model.get_parameter(a).dtype == torch.float32 and sampler.version == 6
    assert torch.equal(sampler.model.get_parameter(a), torch.ones_like(first))
