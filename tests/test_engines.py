"""Generation engines on CPU: the built-in Sampler (seeds, stops, temperature, top-p, weight
loads, pause) and the hybrid engine's switch (the vLLM adapter: test_vllm.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import pytest
import torch

from asyncrl.hybrid.engine import HybridEngine
from asyncrl.hybrid.models import ModelConfig, build_model, sequence_logprobs
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
    import os
    import sys
    import threading

    from helpers import wait_until

    engine = Sampler(build_model(ModelConfig(seed=3)), SamplingConfig(max_new_tokens=6))
    want = engine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    steps, held, early = [], threading.Event(), []

    def on_token(step):
        steps.append(step)
        if step > 2 and engine.paused:  # a token made past the pause point while paused
            early.append(step)
        if step == 2:
            engine.pause()
            held.set()
    engine.on_token = on_token
    out = {}
    worker = threading.Thread(target=lambda: out.update(got=engine.generate(
        PROMPTS, seeds=[1, 2, 3, 4])))

    def parked() -> bool:
        """The worker blocked in a wait of the sampler's (an Event's), not passing by one."""
        frame, where = sys._current_frames().get(worker.ident), []
        while frame is not None:
            where.append((os.path.basename(frame.f_code.co_filename), frame.f_code.co_name))
            frame = frame.f_back
        return len(where) > 2 and where[:2] == [("threading.py", "wait")] * 2 and \
            where[2][0] == "sampler.py"  # (Condition.wait, in Event.wait, in generate)
    worker.start()
    try:
        assert held.wait(60)
        wait_until(parked, 30, "the generation to hold at the paused token boundary")
        assert worker.is_alive() and steps == [1, 2] and engine.paused
        with pytest.raises(RuntimeError, match=r"paused: resume\(\) it before generating"):
            engine.generate(PROMPTS, seeds=[1, 2, 3, 4])
    finally:
        engine.resume()
        worker.join(60)
    assert not worker.is_alive() and steps == [1, 2, 3, 4, 5] and early == []
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



class CountingBackend:
    """A trainer's stand-in for the hybrid engine: its model and optimizer, and the moves
    of its masters in `moves` (`fail["reload"]`: how many reloads fail, out of memory)."""

    def __init__(self, model: torch.nn.Module, fail: dict[str, int] | None = None):
        self.model, self.opt = model, torch.optim.AdamW(model.parameters())
        self.moves: list[str] = []
        self.fail = {} if fail is None else fail

    def offload_masters(self) -> int:
        self.moves.append("masters off")
        return 123

    def reload_masters(self) -> None:
        if self.fail.get("reload"):
            self.fail["reload"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (the masters)")
        self.moves.append("masters back")


def test_the_hybrid_engine_offloads_the_optimizer_unless_told_to_keep_it():
    """offload_optimizer=False (a Policy's argument too): a switch moves neither the
    optimizer's state nor a backend's masters; True (the default) moves both off for
    generation and back for training."""
    with pytest.raises(TypeError, match=r"offload_optimizer is True .* got 'yes'"):
        HybridEngine(CountingBackend(build_model(ModelConfig())), ModelConfig(),
                     offload_optimizer="yes")
    for offload, moves, moved in (
            (True, ["state to cpu", "masters off", "masters back", "state to cpu"], 123),
            (False, [], 0)):
        backend = CountingBackend(build_model(ModelConfig()))
        hybrid = HybridEngine(backend, ModelConfig(), offload_optimizer=offload)
        hybrid._move_optimizer = lambda device, b=backend: b.moves.append(f"state to {device}")
        hybrid.to_generate()
        assert hybrid.offloaded_bytes == moved
        hybrid.to_train()
        assert backend.moves == moves, offload
    # the flag turned off while generating: the way back still undoes the offload, and the
    # next switch moves nothing (nor reports the bytes of the one before)
    backend = CountingBackend(build_model(ModelConfig()))
    hybrid = HybridEngine(backend, ModelConfig())
    hybrid._move_optimizer = lambda device, b=backend: b.moves.append(f"state to {device}")
    hybrid.to_generate()
    hybrid.offload_optimizer = False
    hybrid.to_train()
    hybrid.to_generate()
    assert backend.moves == ["state to cpu", "masters off", "masters back", "state to cpu"]
    assert hybrid.offloaded_bytes == 0


def engine_bytes(hybrid: HybridEngine) -> int:
    """What the engine's weights hold now (their blocks' storage, each counted once)."""
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in hybrid.engine.model.parameters()}.values())


@contextlib.contextmanager
def fill_fails_on_a_peer() -> Iterator[None]:
    """The hybrid engine's switches, meanwhile, as on a rank whose own fill of the engine
    went through while rank 1's did not: every rank learns of it (engine.agree)."""
    import asyncrl.hybrid.engine as engine_module

    agree = engine_module.agree

    def peer_fails(failed, what, value=0):
        agree(failed, what, value)
        if what == "filling the engine":
            raise RuntimeError(f"{what} failed on another rank of this group")
        return 0

    engine_module.agree = peer_fails
    try:
        yield
    finally:
        engine_module.agree = agree


def test_a_switch_failing_on_another_rank_leaves_the_built_in_engine_asleep(monkeypatch):
    """Rank 1's fill failing fails the switch on rank 0 too, whose engine had woken: only
    vLLM was put back to sleep, so a built-in engine over freed weights (a GPU) said it was
    awake, and to_train (in train mode still) never slept it."""
    monkeypatch.setattr(HybridEngine, "_frees_memory", lambda self: True)  # as on a GPU
    hybrid = HybridEngine(CountingBackend(build_model(ModelConfig())), ModelConfig())
    with fill_fails_on_a_peer():
        with pytest.raises(RuntimeError, match="another rank"):
            hybrid.to_generate()
    assert hybrid.mode == "train" and hybrid.engine.asleep and engine_bytes(hybrid) == 0
    assert not hybrid._offloaded
    hybrid.to_train()
    assert hybrid.engine.asleep and engine_bytes(hybrid) == 0
    with pytest.raises(RuntimeError, match="asleep"):
        hybrid.engine.generate([[1, 2]], seeds=[0])
    hybrid.to_generate()  # the next switch goes
    assert hybrid.generate([[1, 2]], seeds=[0])["response_mask"].sum() > 0


def test_a_switch_failing_on_another_rank_gathers_the_frozen_weights_again():
    """On a CPU (nothing released), a rank whose own fill went through kept the frozen
    weights as the engine's while its peer's fill failed: at the next switch one gathered
    the trained parameters only, the other frozen and trained, their all_gathers paired."""
    model = build_model(ModelConfig())
    model.get_input_embeddings().weight.requires_grad_(False)  # (LoRA's base: frozen)
    hybrid = HybridEngine(CountingBackend(model), ModelConfig())
    with fill_fails_on_a_peer(), pytest.raises(RuntimeError, match="another rank"):
        hybrid.to_generate()
    assert hybrid._frozen_plan and hybrid._fill_plan() == \
        hybrid._frozen_plan + hybrid._trained_plan  # as the peer's next switch gathers


def test_a_way_back_to_training_whose_engine_sleep_failed_is_finished_by_the_next(
        monkeypatch):
    """vLLM's sleep (collective_rpc) raising on the way back left the mode "train": the
    next to_train skipped the sleep and the release, and the engine kept its weights and
    KV cache on the GPU for the rest of training."""
    monkeypatch.setattr(HybridEngine, "_frees_memory", lambda self: True)  # as on a GPU
    backend = CountingBackend(build_model(ModelConfig()))
    hybrid = HybridEngine(backend, ModelConfig())
    sleep, calls = hybrid.engine.sleep, []

    def flaky_sleep(level=1):
        calls.append(level)
        if len(calls) == 1:
            raise RuntimeError("collective_rpc('sleep') failed")
        sleep(level)

    hybrid.engine.sleep = flaky_sleep
    hybrid.to_generate()
    with pytest.raises(RuntimeError, match="collective_rpc"):
        hybrid.to_train()
    assert hybrid.mode == "train" and not hybrid.engine.asleep
    hybrid.to_train()
    assert len(calls) == 2 and hybrid.engine.asleep and engine_bytes(hybrid) == 0
    assert not hybrid._offloaded and backend.moves == ["masters off", "masters back"]
    hybrid.to_train()  # nothing left to do
    assert len(calls) == 2 and backend.moves == ["masters off", "masters back"]


def test_a_model_that_returns_no_kv_cache_is_refused_saying_so():
    """A model (trust_remote_code, or a wrapper) ignoring use_cache failed with a bare
    KeyError('cache') after the prefill."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class NoCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = build_model(ModelConfig())
            self.config = self.inner.config

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, use_cache=False)
            return CausalLMOutputWithPast(logits=out.logits)

    with pytest.raises(ValueError, match="KV cache .* engine='vllm'"):
        Sampler(NoCache()).generate([[1, 2, 3]], seeds=[0])


@pytest.mark.parametrize("method, error, match", [
    ("adopt_weights", NotImplementedError, None),  # (a meta tensor cannot be copied to CPU)
    ("load_weights", TypeError, "cannot be copied in: a meta tensor")])
def test_weights_adopted_or_loaded_are_all_taken_or_none(method, error, match):
    """A copy failing half-way (out of memory converting a pack's dtype, a meta tensor) left
    the weights before it new and the rest old, under the old version: a torn model
    generated on. adopt_weights converts every value first; load_weights (a Rollout's dict
    of weights, its checkpoint) checks every value first, then copies one at a time
    (converting all first held a second model on the GPU at a resume)."""
    sampler = Sampler(build_model(ModelConfig()))
    take = getattr(sampler, method)
    (a, first), (b, second) = list(sampler.model.named_parameters())[:2]
    before = first.detach().clone()
    with pytest.raises(error, match=match):
        take([(a, torch.ones_like(first)), (b, torch.empty(second.shape, device="meta"))],
             version=5)
    assert torch.equal(sampler.model.get_parameter(a), before) and sampler.version == 0
    take([(a, torch.ones_like(first, dtype=torch.bfloat16))], version=6)
    assert sampler.model.get_parameter(a).dtype == torch.float32 and sampler.version == 6
    assert torch.equal(sampler.model.get_parameter(a), torch.ones_like(first))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_greedy_decoding_refuses_nan_or_inf_logits_as_sampling_does(bad):
    """argmax takes NaN for the largest: greedy validation went on on garbage (token 5 again
    and again, log-probs NaN) where sampling raised; a +inf logit (fp16's LM head
    overflowing) was taken too, its log-prob inf - inf = NaN."""
    model = build_model(ModelConfig())
    model.lm_head.register_forward_hook(lambda mod, inp, out: out.index_fill(-1, torch.tensor(
        [5]), bad))
    for temperature in (0.0, 1.0):
        engine = Sampler(model, SamplingConfig(max_new_tokens=3, temperature=temperature))
        with pytest.raises(ValueError, match="contain NaN"):
            engine.generate([[1, 2, 3]], seeds=[0])


def test_a_calls_stop_token_ids_keep_the_models_end_of_sequence(tmp_path):
    """A role's stop_token_ids had the checkpoint's EOS ids added, one call's
    (generate(p, sampling={"stop_token_ids": [3]})) replaced them: generation ran on past
    the EOS. The same merge for both; [] still stops nowhere, which multi-turn refuses."""
    from asyncrl.comm.batch import TensorBatch
    from asyncrl.hybrid.roles import call_config, sampling_config
    from asyncrl.hybrid.turns import Turns, multi_turn_config

    build_model(ModelConfig(seed=4)).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [5, 7]}))
    model = ModelConfig(path=str(tmp_path / "ckpt"))
    role = sampling_config({"stop_token_ids": [9]}, model)
    assert call_config(role, {"stop_token_ids": [3, 7]}, model).stop_token_ids == [3, 7, 5]
    assert call_config(role, {"temperature": 0}, model).stop_token_ids == [9, 5, 7]
    assert call_config(role, None, model) is role
    none = call_config(role, {"stop_token_ids": []}, model)
    assert none.stop_token_ids == []
    preset = ModelConfig(seed=0)  # no EOS ids of its own
    assert call_config(sampling_config({}, preset), {"stop_token_ids": [3]}, preset
                       ).stop_token_ids == [3]
    turns = Turns(multi_turn_config({"env": lambda prompt, response: None}))
    with pytest.raises(ValueError, match="multi_turn= needs stop tokens"):
        turns.generate(None, TensorBatch({"prompt": [[1]], "seed": [0]}), [[1]], [0], none)


def test_gather_buffers_reserved_for_every_dtype_of_a_plan(monkeypatch):
    """A LoRA plan gathers bf16 base buckets and fp32 adapter buckets: the buffers were one
    pair, so reserving them before the gathers kept only the last dtype's, and the gathers
    allocated the other's between their collectives (out of memory there: peers left in an
    all_gather). Each dtype keeps its pair now, reserved up front."""
    from types import SimpleNamespace

    from asyncrl.hybrid.gather import Bucket, Gatherer

    mesh = SimpleNamespace(get_group=lambda: None, size=lambda: 2)  # (no collective here)
    plan = []
    for dtype, rows in ((torch.bfloat16, 8), (torch.float32, 2), (torch.bfloat16, 4)):
        bucket = Bucket(mesh, dtype, torch.device("cpu"))
        bucket.add(torch.zeros(rows, 3, dtype=dtype), torch.zeros(rows, 3, dtype=dtype))
        plan.append(bucket)
    gatherer = Gatherer()
    gatherer.reserve(plan)
    # the widest bucket of each dtype: bf16 4 rows x 3 of 2 ranks, fp32 1 x 3; local + out
    assert gatherer.buffer_bytes == (12 + 24) * 2 + (3 + 6) * 4

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("allocated between the collectives")
    monkeypatch.setattr(torch, "zeros", no_memory)
    monkeypatch.setattr(torch, "empty", no_memory)
    for bucket in plan:  # what the gathers take: all reserved
        local, out = gatherer._buffers(bucket, plan)
        assert (local.dtype, out.numel()) == (bucket.dtype, bucket.width * 2)
