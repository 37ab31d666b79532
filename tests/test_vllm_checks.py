"""The vLLM adapter's checks against what real vLLM does with what it is handed (the fake in
tests/fake_vllm.py follows vLLM's behaviour): checkpoints whose weights vLLM cannot take
again (MoE), prompts vLLM would fail on mid-batch or pass to its kernels unchecked, options
it does not know or cannot sleep with, and the failures of its sleep, wake and prefix cache
reset. Real vLLM has never run (see the README)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_engines import PROMPTS, CountingBackend

from asyncrl.hybrid.engine import HybridEngine
from asyncrl.hybrid.models import ModelConfig, build_model
from asyncrl.hybrid.sampler import Sampler, SamplingConfig


def fake_engine(path: str = "tiny-llama", sampling: SamplingConfig | None = None,
                **options):
    import fake_vllm

    from asyncrl.hybrid.vllm_engine import VLLMEngine

    options.setdefault("llm_cls", fake_vllm.LLM)
    return VLLMEngine(path, sampling or SamplingConfig(max_new_tokens=4),
                      sampling_params_cls=fake_vllm.SamplingParams, **options)


def test_vllm_refuses_a_mixture_of_experts_checkpoint(tmp_path):
    """vLLM's fused MoE rewrites its expert weights (w13) into the kernel's layout after the
    first load but keeps their weight_loader: each later load_weights wrote the checkpoint's
    layout into them (vLLM issue 42821), garbage rollouts from the first step, unsaid. Such
    a config is refused up front (a multimodal one's text_config too), and the worker
    refuses a load into a model with fused MoE layers its config did not reveal."""
    from asyncrl.hybrid.vllm_engine import WeightLoader

    build_model(ModelConfig(seed=4)).save_pretrained(tmp_path / "dense")
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    for name, extra in (("qwen", {"num_experts": 8}), ("mixtral", {"num_local_experts": 8}),
                        ("deepseek", {"n_routed_experts": 64}),
                        ("vl", {"text_config": {"num_experts": 4}}),
                        ("ernie", {"moe_num_experts": [64, 64]})):
        folder = tmp_path / name
        build_model(ModelConfig(seed=4)).save_pretrained(folder)
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
        with pytest.raises(ValueError, match=r"cannot take new weights for .*a mixture of "
                                             r"experts .*use the built-in engine "
                                             r"\(engine='builtin'\) or a dense model"):
            fake_engine(str(folder))
    (tmp_path / "dense" / "config.json").write_text(json.dumps({**config, "num_experts": 1}))
    fake_engine(str(tmp_path / "dense"))  # one expert: dense, taken

    class FusedMoE(torch.nn.Module):  # (vLLM's class name; SharedFusedMoE derives from it)
        pass

    class SharedFusedMoE(FusedMoE):
        pass

    loads: list[list] = []
    model = torch.nn.Module()
    model.mlp = SharedFusedMoE()
    model.load_weights = lambda weights: loads.append(weights) or set()
    worker = WeightLoader()
    worker.model_runner = SimpleNamespace(model=model)
    with pytest.raises(ValueError, match=r"fused MoE layers \(mlp\)"):
        worker.asyncrl_load_weights([("mlp.w13", torch.zeros(1))])
    assert loads == []


def test_vllm_refuses_to_quantize_a_model_it_must_take_new_weights_into(tmp_path):
    """vLLM's `quantization=` (or a quantization_config given by hf_overrides) quantizes the
    weights once, as it loads them: each later load_weights failed in vLLM or was cast into
    the quantized tensors with stale scales. Refused, also where the group is declared."""
    from asyncrl.hybrid.engine import check_engine

    for make in (lambda: fake_engine(quantization="fp8"),
                 lambda: check_engine("vllm", {"quantization": "fp8"})):
        with pytest.raises(ValueError, match=r"quantization='fp8': the vLLM engine cannot "
                                             r"take new weights"):
            make()
    build_model(ModelConfig(seed=4)).save_pretrained(tmp_path)
    for overrides, said in (({"quantization_config": {"quant_method": "fp8"}}, "quantized"),
                            ({"text_config": {"num_experts": 8}}, "a mixture of experts")):
        with pytest.raises(ValueError, match=f"cannot take new weights for .*{said}"):
            fake_engine(str(tmp_path), hf_overrides=overrides)
    fake_engine(str(tmp_path), quantization=None, hf_overrides={"max_position_embeddings": 64})


def test_vllm_prompts_empty_or_outside_the_vocabulary_are_refused_before_vllm():
    """vLLM refuses an empty prompt inside its add loop (the rows before it stay in the
    engine, answered by the next call), and without a tokenizer (the adapter skips it) it
    does not check ids against the vocabulary: a bad one reaches the embedding kernel, a
    device-side assert that leaves the CUDA context dead. The adapter refuses both first,
    naming the row and the id; its engine goes on."""
    import fake_vllm

    # the fake as vLLM: an empty prompt leaves the rows before it; a bad id kills it
    llm = fake_vllm.LLM("tiny-llama", distributed_executor_backend="external_launcher",
                        enable_sleep_mode=True, skip_tokenizer_init=True,
                        worker_extension_cls="asyncrl.hybrid.vllm_engine.WeightLoader")
    params = fake_vllm.SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False)
    with pytest.raises(ValueError, match="The decoder prompt cannot be empty"):
        llm.generate([{"prompt_token_ids": [1, 5]}, {"prompt_token_ids": []}], [params] * 2)
    assert len(llm.generate([{"prompt_token_ids": [1, 7]}], [params])) == 2  # the left row
    with pytest.raises(RuntimeError, match="device-side assert triggered"):
        llm.generate([{"prompt_token_ids": [1, 128]}], [params])
    with pytest.raises(RuntimeError, match="device-side assert triggered"):
        llm.generate([{"prompt_token_ids": [1, 7]}], [params])  # dead for good

    engine = fake_engine()
    with pytest.raises(ValueError, match="generate: prompt 1 is empty"):
        engine.generate([[1, 5], []], [0, 1])
    for bad in (128, -1):
        with pytest.raises(ValueError, match=rf"prompt 2 has token id {bad}, outside the "
                                             rf"model's vocabulary \[0, 128\)"):
            engine.generate([[1, 5], [1, 6], [1, bad, 3]], [0, 1, 2])
    out = engine.generate([[1, 7, 7]], [2])  # no row left behind, not dead
    assert out["prompt_ids"].tolist() == [[1, 7, 7]] and out["response_mask"].sum() == 4
    engine.llm.llm_engine = None  # a vLLM that does not say its vocabulary: still empty ones
    with pytest.raises(ValueError, match="generate: prompt 0 is empty"):
        engine.generate([[]], [0])


def test_vllm_refuses_a_kv_cache_dtype_other_than_auto():
    """vLLM's level 2 sleep keeps only the model's buffers: an fp8 KV cache's scales
    (plain tensors) were lost, and generation after the wake was garbage (vLLM PR 28783)."""
    for dtype in ("fp8", "fp8_e5m2"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype='{dtype}' is not supported: "
                                             f"an fp8 KV cache's scales"):
            fake_engine(kv_cache_dtype=dtype)
    fake_engine(kv_cache_dtype="auto")


def test_vllm_level_2_sleep_gets_its_buffers_back_when_the_weights_wake_first():
    """vLLM's level 2 drops the weights' memory, keeps the model's buffers on the host and
    copies them back at the first wake_up whatever its tags: the KV cache woken first copies
    them into unmapped memory (an illegal address), and wake_up(None) while partly awake maps
    the awake part again. The fake does so; the adapter wakes the weights first."""
    import fake_vllm

    def llm():
        return fake_vllm.LLM("tiny-llama", distributed_executor_backend="external_launcher",
                             enable_sleep_mode=True,
                             worker_extension_cls="asyncrl.hybrid.vllm_engine.WeightLoader")
    first = llm()
    first.sleep(2)
    assert all(b.isnan().all() for b in first._model.buffers())  # (with the weights' pool)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        first.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match="CUDA context is unusable"):
        first.reset_prefix_cache()
    second = llm()
    second.sleep(2)
    second.wake_up(["weights"])
    assert not any(b.isnan().any() for b in second._model.buffers())
    with pytest.raises(RuntimeError, match=r"wake_up\(None\) maps every tag"):
        second.wake_up(None)

    fake_vllm.LLM.calls.clear()
    engine = fake_engine()
    engine.sleep(2)
    other = build_model(ModelConfig(seed=9))
    engine.load_weights(other.named_parameters(), version=1)
    engine.wake()
    out = engine.generate(PROMPTS, [1, 2, 3, 4])
    want = Sampler(other, SamplingConfig(max_new_tokens=4)).generate(PROMPTS, [1, 2, 3, 4])
    assert torch.equal(out["response_ids"], want["response_ids"])  # its buffers restored
    assert [c[1] for c in fake_vllm.LLM.calls if c[0] == "wake_up"] == [["weights"],
                                                                         ["kv_cache"]]


def test_a_kv_cache_wake_that_fails_is_reported_not_hidden_by_the_rollback(tmp_path):
    """A failed switch to generation sleeps vLLM again, which first wakes what still sleeps
    (vLLM sleeps only wholly awake): after a KV cache wake that failed for lack of memory
    that wake failed too, and its error hid the first. Now the first is the cause of an
    error that says the engine is unusable, and every later call says so."""
    import fake_vllm

    build_model(ModelConfig(seed=4)).save_pretrained(tmp_path / "ckpt")
    backend = CountingBackend(build_model(ModelConfig(path=str(tmp_path / "ckpt"))))
    hybrid = HybridEngine(backend, ModelConfig(path=str(tmp_path / "ckpt")),
                          SamplingConfig(max_new_tokens=3), engine="vllm",
                          engine_options={"llm_cls": fake_vllm.LLM,
                                          "sampling_params_cls": fake_vllm.SamplingParams})
    hybrid._move_optimizer = lambda device: backend.moves.append(f"state to {device}")
    hybrid.engine.llm.kv_wake_ooms = 2  # out of memory, and still so for the rollback
    with pytest.raises(RuntimeError, match=r"the vLLM engine is unusable: restart the "
                                           r"group.*attempt 1") as failed:
        hybrid.to_generate()
    assert isinstance(failed.value.__cause__, torch.OutOfMemoryError)
    assert "attempt 1" in str(failed.value.__cause__)
    assert hybrid.mode == "train" and backend.moves[-1] == "state to cpu"
    with pytest.raises(RuntimeError, match="unusable .*restart the group") as again:
        hybrid.to_generate()
    assert "attempt 1" in str(again.value.__cause__)


def test_engine_options_vllm_does_not_know_are_named_with_the_key_meant(monkeypatch):
    """vLLM's LLM hands the keywords it does not name to EngineArgs (a dataclass): a
    misspelt one was a TypeError deep in vLLM's start on every rank. The adapter checks them
    against EngineArgs' fields first (vllm.EngineArgs where it imports vLLM) and names the
    key meant."""
    import fake_vllm

    with pytest.raises(TypeError, match="unexpected keyword argument 'gpu_memory_util'"):
        fake_vllm.LLM("tiny-llama", gpu_memory_util=0.4)  # (the fake, as vLLM)
    with pytest.raises(TypeError, match=r"engine_options 'gpu_memory_utilisation' is not a "
                                        r"keyword of vLLM's LLM .*did you mean "
                                        r"'gpu_memory_utilization'"):
        fake_engine(engine_args_cls=fake_vllm.EngineArgs, gpu_memory_utilisation=0.4)
    monkeypatch.setenv("ASYNCRL_VLLM_MODULE", "fake_vllm")
    monkeypatch.setattr("asyncrl.hybrid.vllm_engine.require_own_gpu", lambda why: None)
    from asyncrl.hybrid.vllm_engine import VLLMEngine

    with pytest.raises(TypeError, match="did you mean 'max_model_len'"):
        VLLMEngine("tiny-llama", max_modl_len=64)
    assert VLLMEngine("tiny-llama", max_model_len=64).max_model_len == 64


def test_the_fake_renormalises_processed_log_probs_over_the_top_p_nucleus():
    """vLLM's processed log-probs are taken after the top-p mask: renormalised over the
    nucleus (the reason the adapter refuses top_p < 1). The fake's were the whole
    distribution's."""
    import fake_vllm

    llm = fake_vllm.LLM("tiny-llama", distributed_executor_backend="external_launcher",
                        enable_sleep_mode=True, logprobs_mode="processed_logprobs",
                        worker_extension_cls="asyncrl.hybrid.vllm_engine.WeightLoader")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for top_p in (1.0, 0.6):
        params = [fake_vllm.SamplingParams(temperature=0.8, top_p=top_p, max_tokens=5,
                                           seed=s, logprobs=0) for s in range(4)]
        outs = llm.generate(prompts, params)
        want = Sampler(llm._model, SamplingConfig(temperature=0.8, top_p=top_p,
                                                  max_new_tokens=5)).generate(PROMPTS,
                                                                              range(4))
        gaps = []
        for i, out in enumerate(outs):
            tokens = out.outputs[0].token_ids
            assert tokens == want["response_ids"][i, :len(tokens)].tolist()
            gaps += [entry[t].logprob - want["logprobs"][i, j].item()
                     for j, (t, entry) in enumerate(zip(tokens, out.outputs[0].logprobs,
                                                        strict=True))]
        if top_p == 1.0:
            assert max(abs(g) for g in gaps) < 1e-5
        else:  # log p - log(the nucleus's mass): never lower, and higher where it cut
            assert min(gaps) > -1e-5 and max(gaps) > 1e-3


def test_a_prefix_cache_vllm_could_not_reset_after_a_load_is_an_error():
    """vLLM's reset_prefix_cache() returns False when it could not reset (blocks still
    held): it was ignored, and prefixes computed with the old weights were reused after a
    load. Now it is tried again, then an error, and generation waits for a reset."""
    import fake_vllm

    engine = fake_engine()
    other = dict(build_model(ModelConfig(seed=9)).named_parameters())
    fake_vllm.LLM.calls.clear()
    engine.llm.reset_failures = 1  # once: the second try goes through
    engine.load_weights(other.items(), version=1)
    assert [c[0] for c in fake_vllm.LLM.calls].count("reset_prefix_cache") == 2
    engine.llm.reset_failures = 4
    with pytest.raises(RuntimeError, match=r"could not reset its prefix cache after a "
                                           r"weight load \(reset_prefix_cache\(\) returned "
                                           r"False twice"):
        engine.load_weights(other.items(), version=2)
    assert engine.version == 2  # (the weights it holds)
    with pytest.raises(RuntimeError, match="could not reset its prefix cache"):
        engine.generate([[1, 5]], [0])
    out = engine.generate([[1, 5]], [0])  # the reset goes through now
    assert out["versions"][out["response_mask"].bool()].eq(2).all()


def _a_refused_call_left_in_a_reset_that_says_nothing() -> tuple[Any, Any]:
    """A fake engine whose LLM's reset_prefix_cache returns None, as vLLM 0.10-0.11's, and
    counts its calls (`resets`), with a refused call's rows left unfinished in vLLM; and
    sampling params for the LLM itself."""
    import fake_vllm

    class SaysNothing(fake_vllm.LLM):
        resets = 0

        def reset_prefix_cache(self):
            type(self).resets += 1
            super().reset_prefix_cache()

    engine = fake_engine(llm_cls=SaysNothing)
    params = fake_vllm.SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False)
    with pytest.raises(ValueError, match="The decoder prompt cannot be empty"):  # (vLLM's)
        engine.llm.generate([{"prompt_token_ids": [1, 5]}, {"prompt_token_ids": []}],
                            [params] * 2)
    return engine, params


def test_a_prefix_cache_reset_that_says_nothing_runs_out_unfinished_requests_first():
    """vLLM 0.10-0.11's reset_prefix_cache() returns None whether or not it reset (its V1
    engine's returns nothing): a reset with a refused call's rows unfinished in vLLM (they
    hold blocks once scheduled) was taken for done. They are run out first (their answers
    are nobody's), then the cache reset; counted a failure instead, every later generate
    and load failed on them. An LLM with no llm_engine: None is done."""
    engine, params = _a_refused_call_left_in_a_reset_that_says_nothing()
    other = dict(build_model(ModelConfig(seed=9)).named_parameters())
    engine.load_weights(other.items(), version=1)
    assert type(engine.llm).resets == 2
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert len(engine.llm.generate([{"prompt_token_ids": [1, 7]}], [params])) == 1
    assert engine.generate([[1, 5]], [0])["versions"].max() == 1
    del engine.llm.llm_engine  # (a stand-in LLM without one)
    engine.load_weights(other.items(), version=2)
    assert engine.generate([[1, 5]], [0])["versions"].max() == 2


def test_expandable_segments_are_taken_from_the_vllm_that_turns_them_off_around_its_pool(
        monkeypatch):
    """vLLM asserted no expandable segments with sleep mode before 0.20.1 (PR 40812); from
    then on it turns them off around its memory pool, but only if PYTORCH_CUDA_ALLOC_CONF
    says so. Taken there, from that version (when the adapter imports vLLM itself)."""
    import fake_vllm

    monkeypatch.setenv("ASYNCRL_VLLM_MODULE", "fake_vllm")
    monkeypatch.setattr("asyncrl.hybrid.vllm_engine.require_own_gpu", lambda why: None)
    from asyncrl.hybrid.vllm_engine import VLLMEngine

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for version in ("0.20.0", "0.20.1rc1"):
        monkeypatch.setattr(fake_vllm, "__version__", version)
        with pytest.raises(ValueError, match="PYTORCH_CUDA_ALLOC_CONF has expandable_segm"):
            VLLMEngine("tiny-llama")
    monkeypatch.setattr(fake_vllm, "__version__", "0.20.1")
    VLLMEngine("tiny-llama")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")  # (not read there)
    with pytest.raises(ValueError, match="PYTORCH_ALLOC_CONF has expandable_segments:True"):
        VLLMEngine("tiny-llama")


def test_a_load_while_the_kv_cache_sleeps_leaves_unfinished_requests_for_after_the_wake():
    """vLLM 0.10-0.11's sleep does not abort requests: a refused call's rows stay. The
    hybrid's fill loads with the KV cache asleep, and running them out there (before a
    reset that says nothing) ran the model into the unmapped KV cache: an illegal memory
    access, the CUDA context dead. The reset waits for the wake: generate runs them out."""
    engine, _ = _a_refused_call_left_in_a_reset_that_says_nothing()
    engine.sleep(2)
    other = build_model(ModelConfig(seed=9))
    engine.load_weights(other.named_parameters(), version=1)
    engine.wake()
    out = engine.generate(PROMPTS, [1, 2, 3, 4])
    assert out["versions"][out["response_mask"].bool()].eq(1).all()
    want = Sampler(other, SamplingConfig(max_new_tokens=4)).generate(PROMPTS, [1, 2, 3, 4])
    assert torch.equal(out["response_ids"], want["response_ids"])
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_vllm_refuses_pipeline_and_data_parallelism_inside_a_rank():
    """With external_launcher vLLM asserts on every pipeline stage but the last at the first
    generate, and its DP ranks step together: given different rows (each rank its own) they
    hang. Both were passed on to vLLM; now refused as tensor parallelism is, where a group
    is declared too."""
    from asyncrl.hybrid.engine import check_engine

    for key in ("pipeline_parallel_size", "data_parallel_size"):
        with pytest.raises(ValueError, match=f"{key}=2\\): only 1 is supported"):
            fake_engine(**{key: 2})
        with pytest.raises(ValueError, match=f"{key}=2"):
            check_engine("vllm", {key: 2})
        fake_engine(**{key: 1})


def test_building_vllm_leaves_the_ranks_random_streams_as_they_were():
    """vLLM's LLM seeds random, numpy and torch (CUDA too) with its seed as it is built,
    the same on every rank: the rank's own streams were reset to vLLM's. Put back."""
    import random

    import numpy as np

    torch.manual_seed(1234)
    random.seed(5)
    np.random.seed(6)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    fake_engine(seed=0)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()


def test_weights_go_to_vllms_model_positionally_as_its_own_loader_passes_them():
    """vLLM's loader (and TRL) call model.load_weights(weights) positionally, and plugin
    models name the parameter otherwise (the fake's is positional only): passed by keyword,
    every load into such a model was a TypeError."""
    engine = fake_engine()
    other = build_model(ModelConfig(seed=9))
    engine.load_weights(other.named_parameters(), version=1)
    out = engine.generate(PROMPTS, [1, 2, 3, 4])
    want = Sampler(other, SamplingConfig(max_new_tokens=4)).generate(PROMPTS, [1, 2, 3, 4])
    assert torch.equal(out["response_ids"], want["response_ids"])


def test_a_hybrid_sleeps_vllm_at_level_1_when_asked_keeping_what_level_2_loses(tmp_path):
    """Level 2 sleep keeps only the model's buffers of the weights' pool: a tensor a model
    holds there beside its parameters and buffers is lost, and no load_weights restores it
    (vLLM issue 29341: garbage rollouts on some newer architectures). engine_options
    sleep_level=1 has the hybrid sleep vLLM at level 1 (a host copy); others are refused."""
    import fake_vllm

    from asyncrl.hybrid.engine import check_engine

    class PoolTensor(fake_vllm.LLM):
        pool_tensor = True

    path = str(tmp_path / "ckpt")
    build_model(ModelConfig(seed=4)).save_pretrained(path)
    sampling = SamplingConfig(max_new_tokens=3)
    want = Sampler(build_model(ModelConfig(path=path)), sampling).generate(PROMPTS, [1, 2, 3, 4])

    def generate(**options):
        fake_vllm.LLM.calls.clear()
        backend = CountingBackend(build_model(ModelConfig(path=path)))
        hybrid = HybridEngine(backend, ModelConfig(path=path), sampling, engine="vllm",
                              engine_options={"llm_cls": PoolTensor, **options,
                                              "sampling_params_cls": fake_vllm.SamplingParams})
        hybrid.to_generate()
        return hybrid.generate(PROMPTS, [1, 2, 3, 4])

    kept = generate(sleep_level=1)
    assert {c[1] for c in fake_vllm.LLM.calls if c[0] == "sleep"} == {1}
    assert torch.equal(kept["response_ids"], want["response_ids"])
    assert (kept["logprobs"] - want["logprobs"]).abs().max().item() < 1e-6
    with pytest.raises(ValueError, match="probabilities contain NaN"):  # (the fake's sampler)
        generate()  # level 2: the pool tensor lost (NaN), as vLLM's would be
    assert {c[1] for c in fake_vllm.LLM.calls if c[0] == "sleep"} == {2}
    for bad in (0, 3, True, "1"):
        with pytest.raises(ValueError, match=f"sleep_level={bad!r}: vLLM sleeps at level 1"):
            check_engine("vllm", {"sleep_level": bad})
