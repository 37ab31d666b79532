"""A model given by the id of a Hugging Face Hub model in the local cache (model={"path":
"org/name"}), which transformers' from_pretrained(local_files_only=True) loads: what asyncrl
reads of the model's files besides (its EOS ids, its config for vLLM's checks, its scalar
head, its tensor names, its tokenizer, an export's files) comes from its cached snapshot
folder, as for the folder given itself. Each was read from Path("org/name") / file: skipped
or refused, silently for most."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import word_tokenizer

from asyncrl.hybrid.models import ModelConfig, build_value_model, model_folder, tiny_gpt2

EOS = [2, 5]  # the tiny model's generation_config.json's (its config's is 2 alone)


def reward_model(folder):
    """A tiny GPT-2 reward model (transformers' *ForSequenceClassification, num_labels=1:
    a scalar head "score") with a word tokenizer and EOS ids EOS."""
    from transformers import GPT2ForSequenceClassification

    torch.manual_seed(0)
    config = tiny_gpt2()
    config.num_labels = 1
    model = GPT2ForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_()  # (not the zeros a critic starts from)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    word_tokenizer(folder)


def moe_config(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_moe",
                                                    "num_experts": 8}))


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local Hugging Face cache (huggingface_hub and transformers read HF_HUB_CACHE at each
    call) holding "org/tiny" (reward_model) and "org/moe" (moe_config), each as a download
    leaves it: models--org--NAME/snapshots/abc and refs/main naming it. Their snapshot
    folders, by id. Nothing may look a host up meanwhile: nothing is downloaded (with a Hub
    id, transformers looked for a peft adapter online, ~23 s of retries with no network)."""
    import socket

    import huggingface_hub.constants

    dialled = []

    def offline(host, *args, **kwargs):
        dialled.append(host)
        raise AssertionError(f"looked up {host}: asyncrl loads a Hub model from the cache")
    monkeypatch.setattr(socket, "getaddrinfo", offline)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    folders = {}
    for repo, build in (("org/tiny", reward_model), ("org/moe", moe_config)):
        cached = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
        build(cached / "snapshots" / "abc")
        (cached / "refs").mkdir()
        (cached / "refs" / "main").write_text("abc")
        folders[repo] = cached / "snapshots" / "abc"
    yield folders
    assert dialled == []


def test_a_hub_models_generation_stops_at_its_end_of_sequence_ids(hub):
    """README: "a model given by path stops at its own EOS ids too"; an id's ran on to
    max_new_tokens (no EOS found at Path("org/tiny"))."""
    from asyncrl.hybrid.roles import eos_token_ids, sampling_config

    assert eos_token_ids(str(hub["org/tiny"])) == EOS
    assert sampling_config({}, ModelConfig(path="org/tiny")).stop_token_ids == EOS
    assert sampling_config({"stop_token_ids": [9]}, ModelConfig(path="org/tiny")
                           ).stop_token_ids == [9, *EOS]


def test_vllm_refuses_a_hub_mixture_of_experts_as_it_does_its_folder(hub):
    """vLLM cannot reload a MoE's weights: the check read config.json beside "org/moe", found
    none and took the model."""
    from asyncrl.hybrid.vllm_engine import _check_reloadable

    for given in (str(hub["org/moe"]), "org/moe"):
        with pytest.raises(ValueError, match="it is a mixture of experts .*'num_experts': 8"):
            _check_reloadable(given)
    _check_reloadable("org/tiny")  # dense: taken


def test_vllm_is_given_a_hub_models_cached_folder(hub, monkeypatch):
    """vLLM given the id would ask the Hub for it (nothing is downloaded)."""
    import fake_vllm

    from asyncrl.hybrid.engine import make_engine

    monkeypatch.setenv("ASYNCRL_VLLM_MODULE", "fake_vllm")
    monkeypatch.setattr("asyncrl.hybrid.vllm_engine.require_own_gpu", lambda why: None)
    monkeypatch.setattr(fake_vllm.LLM, "calls", [])
    make_engine("vllm", ModelConfig(path="org/tiny"), None)
    assert [c[1]["model"] for c in fake_vllm.LLM.calls if c[0] == "init"] == [
        str(hub["org/tiny"])]


def test_a_hub_reward_model_keeps_its_score_head(hub):
    """A reward model given by id was refused as having no scalar head (a critic from one
    started from zeros); its head is the checkpoint's."""
    from safetensors.torch import load_file

    from asyncrl.hybrid.models import checkpoint_head

    saved = load_file(hub["org/tiny"] / "model.safetensors")["score.weight"]
    head = checkpoint_head("org/tiny")
    assert head is not None and torch.equal(head["weight"], saved)
    model = build_value_model(ModelConfig(path="org/tiny"), require_head=True)
    assert torch.equal(model.value_head.weight.detach(), saved)


def test_the_trainer_covers_check_reads_a_hub_models_tensor_names(hub):
    """The check that the trainer's weights cover what vLLM loads was skipped (None)."""
    from asyncrl.hybrid.engine import checkpoint_tensors

    names = checkpoint_tensors("org/tiny")
    assert names is not None and "score.weight" in names
    assert names == checkpoint_tensors(str(hub["org/tiny"]))
    assert checkpoint_tensors("org/moe") is None  # (no weights there)


def test_a_tokenizer_is_loaded_by_the_hub_id_the_model_was_given_by(hub):
    """RewardFn(tokenizer=), PromptSource(tokenizer=) and multi-turn's tokenizer refused an
    id as "not a directory"."""
    from asyncrl.hybrid.user_fn import load_tokenizer

    tok = load_tokenizer("org/tiny")
    assert tok("w1 w2")["input_ids"] == load_tokenizer(str(hub["org/tiny"]))("w1 w2")[
        "input_ids"] == [18, 19]
    with pytest.raises(FileNotFoundError, match="'org/none' is not a directory; give the "
                                                "local folder .* or the id of a Hub model"):
        load_tokenizer("org/none")


def test_a_hub_model_in_the_local_cache_is_noted_with_its_tokenizer(hub, tmp_path):
    """A Policy's checkpoint noted os.path.abspath("org/tiny") as the model's path, a folder
    that does not exist, and no tokenizer; an id not in the cache is refused, naming it."""
    from asyncrl.hybrid.export import save_model_files

    assert model_folder("org/tiny") == hub["org/tiny"]
    (tmp_path / "noted").mkdir()
    save_model_files(tmp_path / "noted", ModelConfig(path="org/tiny"))
    assert json.loads((tmp_path / "noted" / "model.json").read_text())["path"] == \
        str(hub["org/tiny"])
    assert (tmp_path / "noted" / "hf" / "tokenizer.json").read_bytes() == \
        (hub["org/tiny"] / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match=r"path='org/baz' is neither a local directory nor a "
                                         r"model in the local Hugging Face cache"):
        save_model_files(tmp_path / "noted", ModelConfig(path="org/baz"))
