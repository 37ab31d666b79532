"""TensorBatch: every operation checked row by row, on tensor, list and mixed columns."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

import asyncrl
from asyncrl.comm import codec
from asyncrl.comm.batch import PAD_KEY, RowOps, TensorBatch
from asyncrl.comm.messages import Column
from asyncrl.comm.remote import Piece, RemoteBatch, Shard


def rows(b: TensorBatch) -> list[dict]:
    """The batch as a list of rows, each {column: python value}, for exact comparisons."""
    return [{k: (v[i].tolist() if isinstance(v, torch.Tensor) else v[i]) for k, v in b.items()}
            for i in range(len(b))]


def mixed(n: int = 5, meta: dict | None = None) -> TensorBatch:
    """Row i: x=i, m=[[i, 10i, 100i]] (2-d rows), s='s{i}', l=[i, -i]."""
    i = torch.arange(n)
    return TensorBatch({
        "x": i,
        "m": torch.stack([i, 10 * i, 100 * i], dim=1).reshape(n, 1, 3),
        "s": [f"s{j}" for j in range(n)],
        "l": [[j, -j] for j in range(n)],
    }, meta)


def row(i: int) -> dict:
    return {"x": i, "m": [[i, 10 * i, 100 * i]], "s": f"s{i}", "l": [i, -i]}


def test_rowops_is_the_base_of_tensorbatch():
    assert issubclass(TensorBatch, RowOps) and PAD_KEY == "dp_pad"
    assert not hasattr(mixed(), "__dict__")  # slots all the way down


# -- existing behaviour ----------------------------------------------------------------------
def test_slice_take_concat_keep_rows_and_copy_meta():
    b = mixed(5, {"step": 3})
    assert rows(b.slice(1, 4)) == [row(1), row(2), row(3)]
    assert rows(b.take([4, 0, 4])) == [row(4), row(0), row(4)]
    assert rows(TensorBatch.concat([b.slice(3, 5), b.slice(0, 1)])) == [row(3), row(4), row(0)]
    for out in (b.slice(0, 2), b.take([1]), TensorBatch.concat([b, b]), b.pad_to(5)):
        assert out.meta == {"step": 3} and out.meta is not b.meta  # (pad_to: was b itself)


def test_meta_keys_are_names():
    """A batch with meta {0: "step"} came back to the driver, but failed to decode on the
    ranks of any group it was passed to, naming neither the argument nor meta."""
    with pytest.raises(TypeError, match=r"TensorBatch meta keys must be str, got \[0\]"):
        TensorBatch({"x": [1]}, {0: "step"})


def test_chunk_without_pad_is_unchanged():
    b = mixed(7)
    chunks = b.chunk(3)
    assert [[r["x"] for r in rows(c)] for c in chunks] == [[0, 1, 2], [3, 4], [5, 6]]
    assert rows(chunks[1]) == [row(3), row(4)]
    assert all(PAD_KEY not in c.meta for c in chunks)
    assert [len(c) for c in mixed(2).chunk(4)] == [1, 1, 0, 0]
    assert [len(c) for c in mixed(0).chunk(3)] == [0, 0, 0]


# -- chunk(pad=True) -------------------------------------------------------------------------
def test_chunk_pad_repeats_each_chunks_last_row_and_marks_it():
    b = mixed(5, {"step": 1})
    chunks = b.chunk(3, pad=True)
    assert [rows(c) for c in chunks] == [
        [row(0), row(1)], [row(2), row(3)], [row(4), row(4)]]
    assert [c.meta.get(PAD_KEY) for c in chunks] == [None, None, 1]
    assert all(c.meta["step"] == 1 and c.meta is not b.meta for c in chunks)
    assert PAD_KEY not in b.meta


def test_chunk_pad_fills_empty_chunks_with_the_batchs_last_row():
    chunks = mixed(2).chunk(4, pad=True)
    assert [rows(c) for c in chunks] == [[row(0)], [row(1)], [row(1)], [row(1)]]
    assert [c.meta.get(PAD_KEY) for c in chunks] == [None, None, 1, 1]
    chunks = mixed(5).chunk(4, pad=True)  # 2,1,1,1 -> every chunk 2 rows
    assert [rows(c) for c in chunks] == [
        [row(0), row(1)], [row(2), row(2)], [row(3), row(3)], [row(4), row(4)]]
    assert [c.meta.get(PAD_KEY) for c in chunks] == [None, 1, 1, 1]


def test_chunk_pad_several_rows_and_even_split():
    chunks = mixed(1).chunk(3, pad=True)
    assert [rows(c) for c in chunks] == [[row(0)]] * 3
    assert [c.meta.get(PAD_KEY) for c in chunks] == [None, 1, 1]
    even = mixed(6).chunk(3, pad=True)
    assert [rows(c) for c in even] == [[row(0), row(1)], [row(2), row(3)], [row(4), row(5)]]
    assert all(PAD_KEY not in c.meta for c in even)


def test_chunk_pad_marks_describe_the_chunk_not_the_parent():
    b = mixed(3, {PAD_KEY: 2, "k": "v"})  # re-chunking a chunk whose last 2 rows are padding
    chunks = b.chunk(2, pad=True)
    # chunk 0 holds real row 0 and padding row 1; chunk 1 padding row 2 plus one new
    assert [c.meta for c in chunks] == [{"k": "v", PAD_KEY: 1}, {"k": "v", PAD_KEY: 2}]
    assert b.meta == {PAD_KEY: 2, "k": "v"}


def test_micro_batches_of_a_padded_chunk_mark_only_their_own_padding():
    b = mixed(5, {PAD_KEY: 2})  # rows 3 and 4 are padding
    assert [c.meta for c in b.split(2)] == [{}, {PAD_KEY: 1}, {PAD_KEY: 1}]
    assert b.slice(0, 3).meta == {} and b.slice(2, 5).meta == {PAD_KEY: 2}
    assert PAD_KEY not in b.take([4, 0]).meta
    assert TensorBatch.concat(b.split(2)).meta == {PAD_KEY: 2}
    assert PAD_KEY not in TensorBatch.concat([b, mixed(1)]).meta  # a real row after padding


def test_chunk_pad_on_an_empty_batch_gives_n_empty_chunks():
    chunks = mixed(0, {"k": 1}).chunk(3, pad=True)
    assert len(chunks) == 3
    for c in chunks:
        assert len(c) == 0 and c.keys() == ["x", "m", "s", "l"] and c.meta == {"k": 1}
        assert c["m"].shape == (0, 1, 3) and c["s"] == []


def test_chunk_pad_multi_dim_tensor_keeps_shape_and_dtype():
    b = TensorBatch({"h": torch.arange(24, dtype=torch.float32).reshape(3, 2, 4)})
    c = b.chunk(2, pad=True)[1]
    assert c["h"].shape == (2, 2, 4) and c["h"].dtype == torch.float32
    assert torch.equal(c["h"][0], b["h"][2]) and torch.equal(c["h"][1], b["h"][2])


# -- split -----------------------------------------------------------------------------------
def test_padding_rows_own_copies_of_list_items():
    """A padding row's list items are copies (take keeps them the same objects): a DP method
    appending to each row's list appended twice to the real row it repeats."""
    b = TensorBatch({"m": [[i] for i in range(5)], "x": torch.arange(5)})
    chunk = b.chunk(2, pad=True)[1]  # rows 3, 4 and a padding row repeating row 4
    assert chunk["m"] == [[3], [4], [4]] and chunk["m"][1] is b["m"][4]
    assert chunk["m"][2] is not chunk["m"][1]
    one = TensorBatch({"m": [[0]]})
    empty = one.chunk(2, pad=True)[1]  # all padding: repeats another chunk's row
    assert empty["m"] == [[0]] and empty["m"][0] is not one["m"][0]
    two = TensorBatch({"m": [[{"k": [1]}]]}).pad_to(3)  # each padding row its own, deeply
    assert two["m"][1] is not two["m"][2] and two["m"][1][0]["k"] is not two["m"][0][0]["k"]


def test_split_is_consecutive_micro_batches():
    b = mixed(5, {"k": 1})
    parts = b.split(2)
    assert [rows(p) for p in parts] == [[row(0), row(1)], [row(2), row(3)], [row(4)]]
    assert all(p.meta == {"k": 1} and p.meta is not b.meta for p in parts)
    assert [rows(p) for p in b.split(5)] == [[row(i) for i in range(5)]]
    assert [rows(p) for p in b.split(9)] == [[row(i) for i in range(5)]]
    assert [rows(p) for p in b.split(1)] == [[row(i)] for i in range(5)]
    assert mixed(0).split(3) == []


# -- repeat ----------------------------------------------------------------------------------
def test_repeat_interleaved_and_tiled():
    b = mixed(3, {"k": 1})
    assert rows(b.repeat(2)) == [row(0), row(0), row(1), row(1), row(2), row(2)]
    assert rows(b.repeat(2, interleave=False)) == [row(0), row(1), row(2)] * 2
    assert rows(b.repeat(1)) == rows(b) and rows(b.repeat(1, interleave=False)) == rows(b)
    assert torch.equal(b.repeat(3)["m"], b["m"].repeat_interleave(3, dim=0))
    for out in (b.repeat(2), b.repeat(2, interleave=False)):
        assert out.meta == {"k": 1} and out.meta is not b.meta
    assert len(mixed(0).repeat(4)) == 0 and len(mixed(0).repeat(4, interleave=False)) == 0
    # a padded DP chunk's k samples per row: the padding rows' copies stay marked (they
    # counted as real rows), and trailing; tiled, they would sit among real rows: refused
    chunk = mixed(3).chunk(2, pad=True)[1]  # row 2 and its padding copy
    out = chunk.repeat(3)
    assert rows(out) == [row(2)] * 6 and out.meta[PAD_KEY] == 3
    assert rows(out.slice(0, len(out) - out.meta[PAD_KEY])) == [row(2)] * 3
    with pytest.raises(ValueError, match="1 padding row.* repeat interleaved, or drop"):
        chunk.repeat(2, interleave=False)


def test_repeat_copies_rather_than_aliasing():
    b = TensorBatch({"x": torch.zeros(2), "l": [[1], [2]]})
    r = b.repeat(2)
    r["x"][0] = 5.0
    assert b["x"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("interleave", [True, False])
def test_repeat_gives_each_copy_its_own_list_items(interleave):
    """The k copies shared a row's messages list with each other and the source: appending
    a turn to one sample's conversation appended it to its siblings' too."""
    b = TensorBatch({"m": [[{"role": "user"}]], "s": ["p"]})
    r = b.repeat(2, interleave=interleave)
    r["m"][0].append("turn")
    r["m"][0][0]["role"] = "x"
    assert r["m"][1] == [{"role": "user"}] and b["m"] == [[{"role": "user"}]]
    assert r["s"] == ["p", "p"]


# -- select / union / to_dict ----------------------------------------------------------------
def test_select_keeps_named_columns_in_order():
    b = mixed(3, {"k": 1})
    s = b.select(["s", "x"])
    assert s.keys() == ["s", "x"] and len(s) == 3
    assert rows(s) == [{"s": f"s{i}", "x": i} for i in range(3)]
    assert s.meta == {"k": 1} and s.meta is not b.meta
    assert s["x"] is b["x"]  # columns are shared, not copied
    assert b.select(iter(["m"])).keys() == ["m"]


def test_union_puts_columns_side_by_side():
    a = TensorBatch({"x": torch.arange(3), "s": ["a", "b", "c"]}, {"k": 1, "both": "a"})
    b = TensorBatch({"y": torch.ones(3, 2), "x": torch.arange(3), "s": ["a", "b", "c"]},
                    {"both": "b", "j": 2})
    u = a.union(b)
    assert u.keys() == ["x", "s", "y"]
    assert rows(u) == [{"x": i, "s": "abc"[i], "y": [1.0, 1.0]} for i in range(3)]
    assert u.meta == {"k": 1, "both": "b", "j": 2}
    assert u.meta is not a.meta and u.meta is not b.meta
    assert a.meta == {"k": 1, "both": "a"}  # inputs untouched
    empty = TensorBatch({"x": torch.arange(0)}).union(TensorBatch({"s": []}))
    assert len(empty) == 0 and empty.keys() == ["x", "s"]


def test_to_dict_is_a_shallow_copy():
    b = mixed(2)
    d = b.to_dict()
    assert list(d) == ["x", "m", "s", "l"] and d["x"] is b["x"] and d["s"] is b["s"]
    d["new"] = [1, 2]
    assert "new" not in b


# -- one-pass pieces (chunk and split of many pieces) ----------------------------------------
def remote(sizes: list[int], meta: dict | None = None) -> RemoteBatch:
    """One piece of `sizes[r]` rows (from row 2 on) per shard r."""
    return RemoteBatch([Piece(Shard("g", r, 1, "addr", "host"), 2, 2 + n)
                        for r, n in enumerate(sizes)], [], meta)


def described(b: TensorBatch | RemoteBatch) -> tuple:
    if isinstance(b, RemoteBatch):
        return [(p.shard.rank, p.start, p.stop) for p in b.pieces], b.meta
    return rows(b), b.meta


@pytest.mark.parametrize("batch", [mixed(7, {PAD_KEY: 3}), mixed(0), remote([]),
                                   remote([3, 1, 4, 0, 2], {"step": 1, PAD_KEY: 4})])
def test_one_pass_pieces_match_slicing_piece_by_piece(batch):
    for n in range(1, 12):
        base, extra = divmod(len(batch), n)
        for sizes in ([base + 1] * extra + [base] * (n - extra),  # chunk(n)
                      [n] * base + ([extra] if extra else [])):  # split(n)
            got, want = batch._pieces(sizes), RowOps._pieces(batch, sizes)
            assert [described(b) for b in got] == [described(b) for b in want]
            assert all(b.meta is not batch.meta for b in got)


# -- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("call, exc, message", [
    (lambda b: b.chunk(0), ValueError, r"chunk\(n\) needs n >= 1, got 0"),
    (lambda b: b.chunk(0, pad=True), ValueError, r"chunk\(n\) needs n >= 1, got 0"),
    (lambda b: b.chunk(1.5), TypeError, r"chunk\(n\) needs an int, got float"),
    (lambda b: b.split(0), ValueError,
     r"split\(micro_batch_size\) needs micro_batch_size >= 1, got 0"),
    (lambda b: b.split("2"), TypeError, r"split\(micro_batch_size\) needs an int, got str"),
    (lambda b: b.repeat(0), ValueError, r"repeat\(k\) needs k >= 1, got 0"),
    (lambda b: b.repeat(-1, interleave=False), ValueError, r"repeat\(k\) needs k >= 1, got -1"),
    (lambda b: b.select(["x", "nope", "zz"]), KeyError,
     r"no column\(s\) \['nope', 'zz'\]; columns: \['x', 'm', 's', 'l'\]"),
    (lambda b: b.select("x"), TypeError, r"got the str 'x'; write select\(\['x'\]\)"),
    (lambda b: b.select([]), ValueError, r"at least one column; columns: \['x', 'm', 's', 'l'\]"),
    (lambda b: b["q"], KeyError, r"no column 'q'; columns: \['x', 'm', 's', 'l'\]"),
])
def test_errors_name_the_argument_and_the_fix(call, exc, message):
    with pytest.raises(exc, match=message):
        call(mixed(3))



# -- take, concat and union edge cases -------------------------------------------------------
@pytest.mark.parametrize("mask", [
    torch.tensor([True, False, True]), [True, False, True],
    list(torch.tensor([True, False, True]).unbind())])  # 0-d tensors: took rows 1, 0, 1
def test_take_refuses_a_boolean_mask(mask):
    """A pulled batch (RemoteBatch, which a user's protocol splits) took any mask as rows
    1 and 0, and a TensorBatch a list of 0-d bool tensors."""
    with pytest.raises(TypeError, match=r"boolean mask; pass mask.nonzero\(\).flatten\(\)"):
        mixed(3).take(mask)
    remote = RemoteBatch([Piece(Shard("g", 0, 1, "tcp://a:1", "h"), 0, 3)], [], {})
    with pytest.raises(TypeError, match="boolean mask"):
        remote.take(mask)


def test_take_refuses_fractional_and_out_of_range_rows_as_a_remote_batch_does():
    """Floats were truncated (a 0/1 mask as floats took rows 0 and 0), and a list column
    took -1 as its last row where a tensor column, and a pulled batch, refuse it."""
    b = mixed(3)
    for rows in ([1.7], torch.tensor([0.9]), np.array([0.0, 1.0])):
        with pytest.raises(TypeError, match="needs whole row indices"):
            b.take(rows)
    with pytest.raises(TypeError, match="boolean mask"):
        b.take(np.array([True, False, True]))
    for rows in ([-1], [3], [0, 5]):
        with pytest.raises(IndexError, match=r"row indices run from 0 to 2"):
            TensorBatch({"s": ["a", "b", "c"]}).take(rows)
    words = TensorBatch({"s": ["a", "b", "c"]})
    assert words.take(np.array([2, 0])).to_dict() == {"s": ["c", "a"]}  # numpy's ints


def test_take_accepts_any_iterable_of_indices_once():
    b = TensorBatch({"s": ["a", "b", "c"]})
    assert b.take(i for i in (2, 0)).to_dict() == {"s": ["c", "a"]}  # a generator
    assert rows(mixed(3).take(torch.tensor([2, 0]))) == [row(2), row(0)]


def test_concat_refuses_columns_of_different_dtypes():
    ids = TensorBatch({"x": torch.tensor([(1 << 24) + 1])})  # not exact in float32
    with pytest.raises(ValueError, match=r"column 'x' has different dtypes \(batch 0: "
                                         r"torch.int64; batch 1: torch.float32\)"):
        TensorBatch.concat([ids, TensorBatch({"x": torch.tensor([1.0])})])


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_row_ops_on_dtypes_index_select_lacks(dtype):
    """torch's CPU index_select has no uint16/32/64: take, chunk(pad=True), pad_to, repeat
    (and a DP call whose rows do not divide) raised NotImplementedError on nanoGPT-style
    uint16 token ids."""
    ids = torch.tensor([7, 65535, 3]).to(dtype)
    b = TensorBatch({"ids": ids})
    assert b.take([2, 0])["ids"].tolist() == [3, 7]
    assert [c["ids"].tolist() for c in b.chunk(2, pad=True)] == [[7, 65535], [3, 3]]
    assert b.repeat(2)["ids"].dtype == dtype and b.repeat(2)["ids"].tolist() == [
        7, 7, 65535, 65535, 3, 3]
    assert len(b.pad_to(5)) == 5 and b.pad_to(5)["ids"].dtype == dtype
    assert b.union(TensorBatch({"ids": ids.clone()})).keys() == ["ids"]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", [torch.bits16, torch.complex32])
def test_union_and_take_of_dtypes_torch_equal_lacks(dtype):
    bits = torch.tensor([1, -2, 3, 4], dtype=torch.int16)
    col = bits.view(dtype)
    b = TensorBatch({"c": col})
    assert b.union(TensorBatch({"c": col.clone()})).keys() == ["c"]
    with pytest.raises(ValueError, match="different values"):
        b.union(TensorBatch({"c": (bits + 1).view(dtype)}))
    assert torch.equal(b.take([1, 0])["c"].view(torch.int16), bits.view(len(col), -1)[[1, 0]]
                       .flatten())


def test_union_of_a_column_holding_nan_with_itself_or_a_copy():
    t = torch.tensor([float("nan"), 1.0])
    assert TensorBatch({"x": t}).union(TensorBatch({"x": t})).keys() == ["x"]
    assert TensorBatch({"x": t}).union(TensorBatch({"x": t.clone()})).keys() == ["x"]
    with pytest.raises(ValueError, match="different values"):
        TensorBatch({"x": t}).union(TensorBatch({"x": torch.tensor([float("nan"), 2.0])}))


def test_union_of_list_columns_holding_tensors_arrays_or_nan_with_their_wire_copy():
    """A list column's items were compared with ==: tensors raised (the truth of a tensor is
    ambiguous), and NaN made a batch's own wire copy "different"."""
    b = TensorBatch({"seq": [torch.tensor(3), torch.tensor([1.0, float("nan")])],
                     "f": [float("nan"), 1.0], "a": [np.array([1.0, np.nan]), np.array([2.0])],
                     "d": [{"k": [float("nan")]}, {"k": []}]})
    assert b.union(codec.decode(codec.encode(b))).keys() == ["seq", "f", "a", "d"]
    for key, other in [("seq", [torch.tensor(3), torch.tensor([1.0, 2.0])]),
                       ("seq", [torch.tensor(3.0), torch.tensor([1.0, float("nan")])]),
                       ("f", [float("nan"), 2.0]), ("a", [np.array([1.0, 9.0]), np.array([2.0])]),
                       ("d", [{"k": [1.0]}, {"k": []}])]:
        with pytest.raises(ValueError, match=f"column '{key}' is in both batches"):
            b.union(TensorBatch({key: other}))


# -- rows pulled once (repeated or reordered rows of remote batches) ----------------------
def held_rows(rb: RemoteBatch) -> list[tuple[int, int]]:
    return [(p.shard.rank, r) for p in rb.pieces for r in range(p.start, p.stop)]


def test_compacted_pulls_each_held_row_once_in_one_piece_per_shard():
    repeated = remote([3, 4]).repeat(8)  # a piece per row: 56 pulls uncompacted
    held, order = repeated.compacted()
    assert [(p.shard.rank, p.start, p.stop) for p in held.pieces] == [(0, 2, 5), (1, 2, 6)]
    assert [held_rows(held)[i] for i in order] == held_rows(repeated)
    assert remote([3, 4]).compacted() is None  # nothing to merge: pulled as it is
    rng = random.Random(0)
    for _ in range(200):
        batch = remote([rng.randrange(4) for _ in range(rng.randrange(1, 5))])
        if not len(batch):
            continue
        picked = batch.take([rng.randrange(len(batch)) for _ in range(rng.randrange(1, 20))])
        compact, want = picked.compacted(), held_rows(picked)
        if compact is None:  # no row twice, no two pieces to join
            assert len(set(want)) == len(want)
            continue
        held, order = compact
        got = held_rows(held)
        assert len(held.pieces) < len(picked.pieces) and sorted(set(want)) == sorted(got)
        assert [got[i] for i in order] == want


def test_remote_take_accepts_numpy_and_tensor_indices_as_ints():
    import numpy as np

    for rows in (np.array([2, 0]), torch.tensor([2, 0]), [np.int64(2), torch.tensor(0)]):
        picked = remote([3]).take(rows)
        assert [(p.start, p.stop) for p in picked.pieces] == [(4, 5), (2, 3)]
        assert all(type(p.start) is int for p in picked.pieces)


def test_remote_batches_on_other_devices_name_the_device_when_concatenated():
    """Columns alike but for their device: the message said they differed in "order"."""
    shard = Shard("g", 0, 1, "tcp://a:1", "h")
    cpu = RemoteBatch([Piece(shard, 0, 2)], [Column("x", "float32", (2,), "cpu")], {})
    gpu = RemoteBatch([Piece(shard, 0, 2)], [Column("x", "float32", (2,), "cuda")], {})
    with pytest.raises(ValueError, match=r"\('x', 'float32', \(2,\), 'cuda'\)"):
        RemoteBatch.concat([cpu, gpu])


def test_decode_concat_decodes_tensors_nested_in_meta_and_list_columns():
    part = asyncrl.TensorBatch({"x": torch.arange(2), "l": [torch.tensor([1]), torch.tensor([2])]},
                               {"stats": {"loss": torch.tensor(1.0)}, "h": [[torch.ones(1)]]})
    raws = [codec.encode(part)] * 2
    got = codec.decode_concat(raws, lambda i, rows: None) or \
        asyncrl.TensorBatch.concat([codec.decode(r) for r in raws])
    assert all(isinstance(t, torch.Tensor) for t in got["l"])
    assert isinstance(got.meta["stats"]["loss"], torch.Tensor)
    assert isinstance(got.meta["h"][0][0], torch.Tensor)
    assert codec.decode_concat([codec.encode(asyncrl.TensorBatch({"x": torch.arange(2)}))] * 2,
                               lambda i, rows: None) is not None  # the fast path still runs
    # keys that are not str: the one-by-one decode refuses them, the fast path took them
    for columns, meta in (({"x": [1, 2]}, {1: "x"}), ({3: [1, 2]}, {})):
        raw = msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_BATCH,
                                                         msgspec.msgpack.encode([columns, meta])))
        with pytest.raises(TypeError):
            codec.decode(raw)
        assert codec.decode_concat([raw] * 2, lambda i, rows: None) is None
