"""Prompt sources: files and sequences, seeded shuffling, resumable positions, text and chat
prompts through a tokenizer, bad data."""

from __future__ import annotations

import json
import re

import pytest
from helpers import WORDS, word_tokenizer

from asyncrl.rl import PromptSource


def records(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "answer": i} for i in range(n)]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_jsonl_batches_cover_every_record_once_per_epoch(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", records(10))
    src = PromptSource(tmp_path / "p.jsonl", batch_size=4, seed=1, epochs=2)
    batches = list(src)
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    first = [a for b in batches[:3] for a in b["answer"]]
    second = [a for b in batches[3:] for a in b["answer"]]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # each epoch has its own order
    assert batches[0]["prompt"] == [f"p{a}" for a in batches[0]["answer"]]


def test_seeded_order_and_exact_resume():
    a = [b["answer"] for b in PromptSource(records(12), batch_size=3, seed=7)]
    assert a == [b["answer"] for b in PromptSource(records(12), batch_size=3, seed=7)]
    assert a != [b["answer"] for b in PromptSource(records(12), batch_size=3, seed=8)]
    src = PromptSource(records(12), batch_size=3, seed=7, epochs=3)
    it = iter(src)
    seen = [next(it)["answer"] for _ in range(5)]  # into the second epoch
    state = src.state_dict()
    rest = [b["answer"] for b in it]
    again = PromptSource(records(12), batch_size=3, seed=7, epochs=3)
    again.load_state_dict(state)
    assert [b["answer"] for b in again] == rest
    assert seen[:4] == a
    other = PromptSource(records(11), batch_size=3, seed=7)
    with pytest.raises(ValueError, match="saved for other prompts \\(records 12 there, 11 "
                                         "here; digest '[0-9a-f]+' there"):
        other.load_state_dict(state)
    # the same count in another order, or other records of the same count, went on at an
    # index into another order: prompts repeated and skipped without a word
    for unlike, said in ((PromptSource(records(12), batch_size=3, seed=7, shuffle=False),
                          "shuffle True there, False here"),
                         (PromptSource(records(12)[::-1], batch_size=3, seed=7), "digest")):
        with pytest.raises(ValueError, match=f"saved for other prompts \\(.*{said}.*resume "
                                             f"with the prompt data, seed and shuffle"):
            unlike.load_state_dict(state)
    old = {k: state[k] for k in ("epoch", "index", "seed", "records")}  # before session 28
    PromptSource(records(12), batch_size=3, seed=7).load_state_dict(old)



def test_a_position_saved_under_another_shuffle_is_refused(monkeypatch):
    """The seed was saved, not the order it gave: torch.randperm shuffling otherwise (another
    torch release) resumed at an index into another order, without a word."""
    import torch

    src = PromptSource(records(12), batch_size=3, seed=7, epochs=2)
    for _ in range(5):  # into the second epoch
        src.next_batch()
    state = src.state_dict()
    PromptSource(records(12), batch_size=3, seed=7, epochs=2).load_state_dict(state)
    monkeypatch.setattr(torch, "randperm", lambda n, generator=None: torch.arange(n).flip(0))
    with pytest.raises(ValueError, match="saved for another order of the prompts: epoch 1's "
                                         "shuffle differs here"):
        PromptSource(records(12), batch_size=3, seed=7, epochs=2).load_state_dict(state)
    unshuffled = PromptSource(records(12), batch_size=3, shuffle=False)  # randperm unused
    unshuffled.load_state_dict(unshuffled.state_dict())


def test_a_prompt_sources_order_is_made_once_an_epoch_not_at_every_state_dict(monkeypatch):
    """state_dict() (which the controller takes at every step) made the epoch's whole
    randperm for its order digest, as each batch did: ~50 ms a step at a million prompts."""
    src = PromptSource(records(12), batch_size=3, seed=7, epochs=2)
    made, real = [], src._order
    monkeypatch.setattr(src, "_order", lambda epoch: (made.append(epoch), real(epoch))[1])
    src.next_batch()
    first = src.state_dict()
    src.next_batch()
    assert src.state_dict()["order"] == first["order"] and made == [0]
    for _ in range(3):  # into the second epoch: its own order, its own digest
        src.next_batch()
    second = src.state_dict()
    assert made == [0, 1] and second["epoch"] == 1 and second["order"] != first["order"]
    fresh = PromptSource(records(12), batch_size=3, seed=7, epochs=2)
    assert fresh._order_digest(1) == second["order"] and fresh._order_digest(0) == first["order"]


def ids(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


def test_text_and_chat_prompts_become_token_ids_through_the_tokenizer(tmp_path):
    """verl's data: a chat goes through the chat template with the assistant's turn opened;
    text is tokenized as it is; ids stay ids. What was given travels as "raw_prompt"."""
    tok = word_tokenizer(tmp_path / "tok")
    chat = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w5 w6"}]
    rows = [{"question": "w3 w7", "answer": 1}, {"question": chat, "answer": 2},
            {"question": [9, 10], "answer": 3}]
    write_jsonl(tmp_path / "q.jsonl", rows)
    src = PromptSource(tmp_path / "q.jsonl", batch_size=3, shuffle=False, repeat=2,
                       tokenizer=str(tok), prompt_key="question")
    batch = next(iter(src))
    assert sorted(batch.keys()) == ["answer", "prompt", "raw_prompt", "seed"]
    assert batch["prompt"][::2] == [ids("w3 w7"),
                                    ids("<s> system w1 </s> <s> user w5 w6 </s> <s> assistant"),
                                    [9, 10]]
    assert batch["raw_prompt"][::2] == [r["question"] for r in rows]
    assert batch["prompt"][0] == batch["prompt"][1]  # a GRPO group: the same prompt twice
    # a loaded tokenizer does as well as its directory
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tok, local_files_only=True)
    again = PromptSource(rows, batch_size=3, shuffle=False, tokenizer=loaded,
                         prompt_key="question")
    assert next(iter(again))["prompt"] == batch["prompt"][::2]


def test_prompts_longer_than_the_limit_are_left_out_and_counted(tmp_path, caplog):
    tok = word_tokenizer(tmp_path / "tok")
    rows = [{"prompt": " ".join(f"w{i}" for i in range(n)), "n": n} for n in (2, 9, 4, 12, 6)]
    src = PromptSource(rows, batch_size=8, shuffle=False, tokenizer=str(tok),
                       max_prompt_length=6)
    assert [len(p) for p in next(iter(src))["prompt"]] == [2, 4, 6]
    assert "2 of the 5 prompts of the given sequence are longer than max_prompt_length=6 " \
           "tokens (the longest: 12)" in caplog.text
    assert src.state_dict()["records"] == 3  # a resume checks against the kept records
    # token ids are counted without a tokenizer
    assert len(PromptSource([{"prompt": [1] * 3}, {"prompt": [1] * 8}], batch_size=2,
                            max_prompt_length=4).records) == 1
    with pytest.raises(ValueError, match="every prompt of the given sequence is longer than "
                                         "max_prompt_length=1 tokens \\(the shortest: 2\\)"):
        PromptSource(rows, batch_size=2, tokenizer=str(tok), max_prompt_length=1)
    with pytest.raises(ValueError, match="counts the token ids of 'prompt', but record 0 of "
                                         "the given sequence has 'w0 w1'; give token ids, or "
                                         "text with tokenizer="):
        PromptSource(rows, batch_size=2, max_prompt_length=4)


def test_prompts_a_tokenizer_cannot_take_are_refused_naming_the_record(tmp_path):
    from transformers import AutoTokenizer

    tok = str(word_tokenizer(tmp_path / "tok"))
    plain = str(word_tokenizer(tmp_path / "plain", chat=False))
    refusing = AutoTokenizer.from_pretrained(tok, local_files_only=True)
    refusing.chat_template = ("{% for m in messages %}{% if loop.index0 and m['role'] == "
                              "messages[loop.index0 - 1]['role'] %}{{ raise_exception('roles "
                              "must alternate') }}{% endif %}{{ m['content'] }} {% endfor %}")
    chat = [{"role": "user", "content": "w1"}]
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w1"}, {"prompt": chat}])
    cases = [
        (dict(data=tmp_path / "p.jsonl", tokenizer=plain),
         f"{tmp_path / 'p.jsonl'}:2 is a chat .* but the tokenizer has no chat template"),
        (dict(data=[{"prompt": [{"role": "user"}]}], tokenizer=tok),
         "record 0 of the given sequence: chat message .* needs a 'role' and a 'content'"),
        (dict(data=[{"prompt": 3.5}], tokenizer=tok),
         "record 0 of the given sequence: the prompt is '3.5' \\(float\\); give text, chat"),
        (dict(data=[{"text": "w1"}], tokenizer=tok),
         "have no 'prompt' key .* name the key that holds the prompt with prompt_key="),
        (dict(data=[{"prompt": "w1", "raw_prompt": "x"}], tokenizer=tok),
         "have a 'raw_prompt' key, where PromptSource puts"),
        (dict(data=[{"text": "w1", "prompt": "x"}], tokenizer=tok, prompt_key="text"),
         "have a 'prompt' key, where PromptSource puts"),
        (dict(data=[{"text": "w1"}], prompt_key="text"),
         "prompt_key='text' names the key to tokenize: give tokenizer= too"),
        (dict(data=[{"prompt": "w1"}], tokenizer=str(tmp_path / "none")),
         "tokenizer '.*none' is not a directory; give the local folder"),
        (dict(data=[{"prompt": "w1"}, {"prompt": ""}], tokenizer=tok),
         "record 1 of the given sequence: the prompt '' is blank"),
        (dict(data=[{"prompt": []}], max_prompt_length=4),
         "record 0 of the given sequence: the prompt \\[\\] has no tokens"),
        (dict(data=[{"prompt": [{"role": "user", "content": "w1"}] * 2}], tokenizer=refusing),
         "record 0 of the given sequence: the tokenizer's chat template refused this chat: "
         "roles must alternate"),
        (dict(data=[{"prompt": "w1"}], tokenizer=tok, max_prompt_length="512"),
         "max_prompt_length must be an int >= 1, got '512'"),
        (dict(data=[{"prompt": "w1"}], tokenizer=tok, max_prompt_length=0),
         "max_prompt_length must be an int >= 1, got 0"),
        # a run of no step, float sampling seeds, a shuffle asked off that shuffled
        (dict(data=[{"prompt": [1]}], epochs=0), "epochs must be an int >= 1, or None"),
        (dict(data=[{"prompt": [1]}], seed=1.5), "seed must be an int, got 1.5"),
        (dict(data=[{"prompt": [1]}], shuffle="no"), "shuffle must be True or False"),
    ]
    for kwargs, message in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            PromptSource(kwargs.pop("data"), batch_size=1, **kwargs)
    with pytest.raises(TypeError, match="give a local tokenizer directory or a Hugging Face "
                                        "tokenizer, got int"):
        PromptSource([{"prompt": "w1"}], batch_size=1, tokenizer=7)


def test_a_prompt_sources_digest_is_the_same_in_another_process():
    """The digest was of the records' repr: a set's order changes with each process's hash
    seed (every resume of such records was refused), numpy's scalars print otherwise in
    numpy 2."""
    import os
    import subprocess
    import sys

    code = ("import numpy as np\nfrom asyncrl.rl import PromptSource\n"
            "rows = [{'prompt': f'p{i}', 'answer': np.int64(i), 'tags': {'a', 'b', 'c', 'd'}}"
            " for i in range(9)]\nprint(PromptSource(rows, batch_size=3).digest())\n")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONHASHSEED": seed},
                              check=True).stdout.strip() for seed in ("1", "2", "3")}
    assert len(digests) == 1 and len(next(iter(digests))) == 16, digests


def test_text_the_chat_template_made_gets_no_second_bos(tmp_path):
    """Prompts stored as text the chat template rendered (OpenRLHF's data, verl's after
    rendering) start with the BOS: a tokenizer that adds one gave two."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(word_tokenizer(tmp_path / "tok"), local_files_only=True)
    bos = tok.convert_tokens_to_ids("<s>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", bos)])
    src = PromptSource([{"prompt": "<s> user w5 </s> <s> assistant"}, {"prompt": "w3 w7"}],
                       batch_size=2, shuffle=False, tokenizer=tok)
    rendered, plain = next(iter(src))["prompt"]
    assert rendered == ids("<s> user w5 </s> <s> assistant")  # one BOS
    assert plain == [bos, *ids("w3 w7")]  # added where it is not there


def test_records_as_pandas_gives_them_and_keys_generation_writes(tmp_path, caplog):
    """Token ids as numpy arrays or tuples (pandas' read_parquet records) were refused; a
    list of files failed as 'a str, not a dict'; a record key generation writes ('versions')
    was replaced by generation's column without a word; a seed from time.time_ns() failed
    the first batch; a source read again after its epochs gave nothing without a word."""
    import numpy as np

    src = PromptSource([{"prompt": np.array([3, 4]), "a": 1}, {"prompt": (5,), "a": 2}],
                       batch_size=2, shuffle=True, seed=2**62, max_prompt_length=4)
    assert sorted(map(tuple, next(iter(src))["prompt"])) == [(3, 4), (5,)]
    with pytest.raises(ValueError, match=r"is a path \('a.parquet'\), not a record"):
        PromptSource(["a.parquet", "b.parquet"], batch_size=1)
    with pytest.raises(ValueError, match=r"the key\(s\) \['versions'\], which generation "
                                         r"writes"):
        PromptSource([{"prompt": [1], "versions": "v2"}], batch_size=1)
    assert list(src) == []  # its one epoch given: said
    assert "was read again and gives nothing" in caplog.text


def test_token_id_prompts_are_checked_in_every_record_without_a_tokenizer(tmp_path):
    """Without a tokenizer a prompt was checked only with max_prompt_length: an empty one,
    one of floats, or text among token ids failed generation when its batch came, hours
    in. Text alone, or records without 'prompt' (a source of other data), stay accepted:
    the first generate refuses them (test_bad_input)."""
    import numpy as np

    write_jsonl(tmp_path / "p.jsonl", [{"prompt": [1, 2]}, {"prompt": "hello"}])
    cases = [
        ([{"prompt": [1]}, {"prompt": []}],
         "record 1 of the given sequence: the prompt [] has no tokens; generation needs at "
         "least one"),
        ([{"prompt": [1.5]}],
         "record 0 of the given sequence: the prompt '[1.5]' is not a list of token ids "
         "(ints); give every record token ids, or give text or chats with tokenizer="),
        ([{"prompt": [True]}], "the prompt '[True]' is not a list of token ids"),
        ([{"prompt": [{"role": "user", "content": "hi"}]}], "or give text or chats with "
                                                            "tokenizer="),
        (tmp_path / "p.jsonl", f"{tmp_path / 'p.jsonl'}:2: the prompt 'hello' is not a list "
                               f"of token ids (ints), as {tmp_path / 'p.jsonl'}:1's is"),
        # an array of another shape: numpy's broadcast error, naming no record
        ([{"prompt": [1, 2]}, {"prompt": np.array([[3, 4]])}],
         "record 1 of the given sequence: the prompt '[[3 4]]' is a ndarray, not a list of "
         "token ids"),
        ([{"prompt": np.array([[3, 4]])}],  # every record so: taken, failed at generate
         "record 0 of the given sequence: the prompt '[[3 4]]' is a ndarray, not a list of "
         "token ids"),
        ([{"prompt": [1, 2]}, {"prompt": None}],
         "record 1 of the given sequence: the prompt 'None' is a NoneType, not a list of "
         "token ids"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError) as info:
            PromptSource(data, batch_size=1)
        assert message in str(info.value)
    assert PromptSource([{"prompt": "hello"}], batch_size=1).records == [{"prompt": "hello"}]
    assert PromptSource([{"x": 1}], batch_size=1).records == [{"x": 1}]


def test_numpy_and_torch_token_ids_are_taken_and_negative_ones_refused(tmp_path):
    """With a tokenizer, token ids given as numpy integers (records built from arrays) were
    refused ("give a list of token ids"); with or without one, a negative id was taken and
    failed in the embedding at the first forward pass, far from its record."""
    import numpy as np
    import torch

    tok = str(word_tokenizer(tmp_path / "tok"))
    given = [np.int64(9), np.int32(10), torch.tensor(11)]
    for tokenizer in (tok, None):
        src = PromptSource([{"prompt": list(given)}], batch_size=1, tokenizer=tokenizer)
        (prompt,) = next(iter(src))["prompt"]
        assert prompt == [9, 10, 11] and all(type(t) is int for t in prompt)
        for bad in ([9, -1], [np.int64(-3)], [torch.tensor(-3)]):
            with pytest.raises(ValueError) as info:
                PromptSource([{"prompt": [1]}, {"prompt": bad}], batch_size=1,
                             tokenizer=tokenizer)
            assert f"record 1 of the given sequence: the prompt's token id {int(bad[-1])} " \
                   f"(position {len(bad) - 1}) is negative; token ids are >= 0" in str(info.value)
    with pytest.raises(ValueError, match="give text, chat messages"):  # (bools are no ids)
        PromptSource([{"prompt": [np.bool_(True)]}], batch_size=1, tokenizer=tok)


def test_pandas_object_arrays_become_lists(tmp_path):
    """pandas.read_parquet(...).to_dict("records") holds numpy object arrays (a chat, a
    list<string> column): they travelled as given, and the codec refused them at the first
    generate ("a numpy array of Python objects cannot be sent"), naming no record."""
    import numpy as np

    from asyncrl.comm import codec

    chat = np.array([{"role": "user", "content": "w5 w6"}], dtype=object)
    answers = np.array(["7", "seven"], dtype=object)
    nested = {"tags": np.array(["a"], dtype=object), "score": np.float32(0.5)}
    src = PromptSource([{"prompt": chat, "answers": answers, "extra": nested}], batch_size=1,
                       tokenizer=str(word_tokenizer(tmp_path / "tok")))
    batch = next(iter(src))
    assert codec.decode(codec.encode(batch))["prompt"] == [ids("<s> user w5 w6 </s> "
                                                               "<s> assistant")]
    assert batch["raw_prompt"] == [[{"role": "user", "content": "w5 w6"}]]
    assert batch["answers"] == [["7", "seven"]] and type(batch["answers"][0]) is list
    assert batch["extra"] == [{"tags": ["a"], "score": 0.5}]
    assert type(batch["extra"][0]["score"]) is float
    # without a tokenizer too
    ids_only = PromptSource([{"prompt": np.array([3, 4]), "answers": answers}], batch_size=1)
    codec.encode(next(iter(ids_only)))
    # numeric arrays and tensors stay as given (lists of a reward's features: 8-30x the
    # memory, and `feat @ w` broke)
    import torch

    kept = PromptSource([{"prompt": [3, 4], "feat": np.arange(3, dtype=np.float32),
                          "t": torch.tensor([1.5, 2.5])}], batch_size=1)
    got = codec.decode(codec.encode(next(iter(kept))))
    assert got["feat"][0].dtype == np.float32 and isinstance(got["t"][0], torch.Tensor)


def test_blank_text_prompts_are_refused(tmp_path):
    """A tokenizer that adds a BOS made "" or "   " the prompt [BOS], trained on."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(word_tokenizer(tmp_path / "tok"), local_files_only=True)
    bos = tok.convert_tokens_to_ids("<s>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", bos)])
    for blank in ("", "   "):
        with pytest.raises(ValueError, match=re.escape(
                f"record 1 of the given sequence: the prompt {blank!r} is blank (empty or "
                f"only whitespace)")):
            PromptSource([{"prompt": "w3"}, {"prompt": blank}], batch_size=1, tokenizer=tok)
    assert next(iter(PromptSource([{"prompt": " w3 "}], batch_size=1,
                                  tokenizer=tok)))["prompt"] == [[bos, *ids("w3")]]


def test_token_ids_past_the_tokenizers_vocabulary_are_refused(tmp_path):
    """Another model's ids: taken, and failed at generate, naming no record."""
    tok = str(word_tokenizer(tmp_path / "tok"))
    size = len(WORDS)
    with pytest.raises(ValueError, match=re.escape(
            f"record 0 of the given sequence: the prompt's token id {size} (position 1) is "
            f"past the tokenizer's vocabulary of {size} tokens")):
        PromptSource([{"prompt": [5, size]}], batch_size=1, tokenizer=tok)
    last = PromptSource([{"prompt": [size - 1]}], batch_size=1, tokenizer=tok)
    assert next(iter(last))["prompt"] == [[size - 1]]


def test_record_keys_the_rl_step_writes_are_refused():
    """A dataset with a 'reward' field failed at the first actor.update (its column beside
    the scores' in one batch)."""
    for key in ("reward", "ref_logprobs", "values", "loss_mask", "overlong_penalty",
                "timed_out", "crashed"):
        with pytest.raises(ValueError, match=rf"the key\(s\) \['{key}'\], which the RL step "
                                             rf"writes .*: rename them"):
            PromptSource([{"prompt": [1], key: 1.0}], batch_size=1)


def test_record_values_the_wire_cannot_carry_are_refused_naming_the_record(tmp_path):
    """An int past 64 bits (a JSONL "answer": 1234...890) failed hours in, at the generate of
    its batch ("can't serialize ints", no record named), or at the first checkpoint."""
    with pytest.raises(ValueError, match=r"record 1 of the given sequence: its 'answer' value "
                                         r"cannot be sent .*store numbers past 64 bits as "
                                         r"strings"):
        PromptSource([{"prompt": [1], "answer": 1}, {"prompt": [1], "answer": 10**30}],
                     batch_size=1)
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": [1], "answer": 2}] * 5000 +
                [{"prompt": [1], "answer": 123456789012345678901234567890}])
    with pytest.raises(ValueError, match=r"p.jsonl:5001: its 'answer' value"):
        PromptSource(tmp_path / "p.jsonl", batch_size=1)
    with pytest.raises(ValueError, match=r"record 0 .* its 'when' value cannot be sent"):
        PromptSource([{"prompt": [1], "when": object()}], batch_size=1)


def test_a_dict_or_a_dataframe_is_refused_naming_the_list_of_records():
    """Read as a sequence, a dict or a DataFrame gives its keys: 'record 0 ... is a str'."""
    class Frame:  # a DataFrame's shape: read, its column names; to_dict makes records
        def __iter__(self):
            return iter(["prompt", "answer"])

        def to_dict(self, orient="dict"):
            return [{"prompt": [1], "answer": 2}]

    said = "which gives its keys or columns when read, not records: pass a list of records"
    for data in ({"prompt": [[1]], "answer": [2]}, {}, Frame()):
        with pytest.raises(ValueError, match=f"data= is a {type(data).__name__}, {said}"):
            PromptSource(data, batch_size=1)
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"prompt": [[1, 2]], "answer": [3]})
    with pytest.raises(ValueError, match=r"df.to_dict\('records'\) for a DataFrame"):
        PromptSource(frame, batch_size=1)
    assert PromptSource(frame.to_dict("records"), batch_size=1).records[0]["prompt"] == [1, 2]


def test_an_empty_parquet_file_gets_parquet_advice(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.list_(pa.int64()))}), path)
    with pytest.raises(ValueError) as info:
        PromptSource(path, batch_size=1)
    assert f"no prompts in {path}: it is empty; write at least one row, with a \"prompt\" " \
           f"column" in str(info.value) and "JSON" not in str(info.value)


def test_a_jsonl_file_with_a_byte_order_mark_is_read(tmp_path):
    """Saved by an editor that writes a UTF-8 BOM: line 1 was 'not valid JSON'."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": [1, 2]}\n{"prompt": [3]}\n')
    assert PromptSource(path, batch_size=2).records == [{"prompt": [1, 2]}, {"prompt": [3]}]
