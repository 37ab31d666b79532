"""The codec without processes: tensors, arrays and values on the wire, exactly; what it
refuses and why; sizes counted without encoding."""

from __future__ import annotations

import dataclasses
import random
import textwrap
import warnings

import msgspec
import numpy as np
import pytest
import torch

import asyncrl
from asyncrl.comm import codec, messages
from asyncrl.comm.refs import make_ref, resolve_ref


# -- codec ---------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [
    torch.randn(3, 4), torch.arange(5), torch.randn(2, 2).bfloat16(), torch.tensor(3.0),
    torch.empty(0, 3), torch.tensor([True, False]), torch.randn(4, 6)[:, ::2]])
def test_tensors_round_trip_exactly(t):
    out = codec.decode(codec.encode(t))
    assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)


def test_decoded_tensors_own_writable_memory():
    # 1-d and n-d, of a dtype numpy has and of one it lacks
    sent = [torch.arange(3), torch.ones(2, 2),
            torch.ones(2).bfloat16(), torch.ones(1, 2).bfloat16()]
    buf = bytearray(codec.encode(sent))
    out = codec.decode(buf)
    buf[:] = bytes(len(buf))  # the receive buffer is reused
    for t in out:
        t += 1
    assert [t.tolist() for t in out] == [[1, 2, 3], [[2, 2], [2, 2]], [2, 2], [[2, 2]]]


def test_values_round_trip():
    batch = asyncrl.TensorBatch({"x": torch.randn(4, 2), "s": ["a", "b", "c", "d"]}, {"k": 1})
    value = {"b": batch, "n": np.arange(3.0), "cls": asyncrl.TensorBatch, "f": codec.encode,
             "nested": [1, "two", None, {"3": 4.5}], "np_scalar": np.float32(2.5)}
    out = codec.decode(codec.encode(value))
    assert torch.equal(out["b"]["x"], batch["x"]) and out["b"]["s"] == batch["s"]
    assert out["b"].meta == {"k": 1}
    assert np.array_equal(out["n"], value["n"])
    assert out["cls"] is asyncrl.TensorBatch and out["f"] is codec.encode
    assert out["nested"] == value["nested"] and out["np_scalar"] == 2.5


def _sent_apart(value):
    """encode_oob, its left-out arrays copied into fresh writable frames (as received)."""
    body, out = codec.encode_oob(value)
    return body, out, [bytearray(a.tobytes()) for a in out]


def test_large_arrays_travel_out_of_band_and_decode_as_views_of_their_frames():
    big = codec.OOB_MIN_BYTES // 4
    value = {"w": torch.randn(big, 2), "bf": torch.randn(2 * big).bfloat16(),
             "half": torch.randn(4, big // 2)[:, ::2],  # not contiguous: sent as a copy
             "np": np.arange(big, dtype=np.int64), "small": torch.arange(3),
             "batch": asyncrl.TensorBatch({"x": torch.ones(big, 1), "s": ["a"] * big})}
    body, out, frames = _sent_apart(value)
    assert len(out) == 5 and len(body) < 2 * codec.OOB_MIN_BYTES  # the small one inline
    got = codec.decode_oob(body, frames)
    for key in ("w", "bf", "half", "small"):
        assert got[key].dtype == value[key].dtype and torch.equal(got[key], value[key])
    assert np.array_equal(got["np"], value["np"])
    assert torch.equal(got["batch"]["x"], value["batch"]["x"])
    assert got["batch"]["s"] == value["batch"]["s"]
    got["w"] += 1  # writable, and the frame's own memory: no copy was made
    assert bytes(frames[0][:4]) == (value["w"].flatten()[:1] + 1).numpy().tobytes()


def test_out_of_band_frames_off_a_dtypes_alignment_are_copied_others_used_in_place():
    # libzmq's large frames start 8 bytes past a 16-byte boundary: complex128 wants 16
    n = codec.OOB_MIN_BYTES // 8
    value = [torch.randn(n, dtype=torch.complex128), torch.randn(n, dtype=torch.float64)]
    body, out, _ = _sent_apart(value)
    frames = []
    for a in out:
        raw = bytearray(a.nbytes + 8)
        raw[8:] = a.tobytes()
        frames.append(memoryview(raw)[8:])  # malloc'd (16-aligned) + 8
    got = codec.decode_oob(body, frames)
    assert all(torch.equal(g, v) for g, v in zip(got, value, strict=True))
    assert got[0].data_ptr() % 16 == 0  # a copy, aligned
    assert got[1].data_ptr() == np.frombuffer(frames[1], np.uint8).ctypes.data  # in place


@pytest.mark.parametrize("frames, message", [
    (None, "0 buffers came with it"), ([], "0 buffers came with it"),
    ([bytearray(8)], "needs .* bytes but the message carries 8")])
def test_out_of_band_arrays_without_their_frames_are_refused(frames, message):
    body, _, _ = _sent_apart(torch.ones(codec.OOB_MIN_BYTES))
    with pytest.raises(ValueError, match=message):
        codec.decode_oob(body, frames) if frames is not None else codec.decode(body)


def test_call_arguments_travel_out_of_band_copied_unless_gigabytes_would_be(monkeypatch):
    small, big = torch.ones(codec.OOB_MIN_BYTES), torch.zeros(codec.OOB_MIN_BYTES // 4)
    payload, frames = codec.encode_call_oob((small, 7), {"w": big}, ["a", "b"])
    assert len(frames) == 2 and len(payload) < 1024  # the bytes are in the frames
    codec.own_unless_large([frames])
    small += 1  # the caller may change its tensors once the call is made: copies were sent
    args, kwargs = codec.decode_call(payload, [bytearray(f.tobytes()) for f in frames])
    assert torch.equal(args[0], torch.ones(codec.OOB_MIN_BYTES)) and args[1] == 7
    assert torch.equal(kwargs["w"], big)
    monkeypatch.setattr(codec, "IN_PLACE_MIN", codec.OOB_MIN_BYTES)  # "gigabytes": in place
    _, frames = codec.encode_call_oob((small,), {}, ["a"])
    codec.own_unless_large([frames])
    assert frames[0].ctypes.data == small.data_ptr()  # the tensor's own memory, no copy
    with pytest.raises(ValueError, match="0 buffers came with it"):
        codec.decode_call(payload)  # frames announced but missing: refused, not guessed


def test_an_out_of_band_frame_named_twice_is_refused():
    # a few signed bytes naming one large frame many times could make its receiver copy it
    # (misaligned) as many times: an encoder names each frame once
    spec = msgspec.msgpack.encode([0, "complex128", [8], 0])
    twice = msgspec.msgpack.encode([msgspec.msgpack.Ext(codec.EXT_OUT_OF_BAND, spec)] * 2)
    with pytest.raises(ValueError, match="named twice"):
        codec.decode_oob(twice, [bytearray(128)])


def test_plain_encode_keeps_every_array_in_the_message():
    t = torch.ones(codec.OOB_MIN_BYTES)
    assert torch.equal(codec.decode(codec.encode(t)), t)


def _made_quietly(make):
    """What `make()` gives, without the warnings torch gives for prototype and deprecated
    tensor kinds (nested, quantized)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


NESTED = _made_quietly(lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))
JAGGED = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)


@pytest.mark.parametrize("value, message", [
    (lambda: 0, "lambda"), (object(), "builtins.object cannot be sent"),
    (np.array([object()]), "numpy array of Python objects"),
    # (they failed inside torch: RuntimeError, NotImplementedError, never a TypeError)
    (NESTED, "nested tensor cannot be sent; send its tensors as a list"),
    (JAGGED, "nested tensor cannot be sent"),
    (torch.empty(2, device="meta"), r"meta tensor cannot be sent \(it has no values\)")])
def test_unsendable_values_are_refused_never_pickled(value, message):
    with pytest.raises(TypeError, match=message):
        codec.encode(value)


def test_call_encoding_names_the_failing_argument():
    with pytest.raises(codec.ArgEncodeError) as info:
        codec.encode_call((1, 2), {"fn": lambda: 0}, ["a", "b"])
    assert info.value.name == "fn"
    cyclic: dict = {}
    cyclic["self"] = cyclic  # (a RecursionError got through, naming no argument)
    with pytest.raises(codec.ArgEncodeError) as info:
        codec.encode_call((1, cyclic), {}, ["a", "config"])
    assert info.value.name == "config" and isinstance(info.value.cause, RecursionError)
    args, kwargs = codec.decode_call(codec.encode_call((1, [2]), {"k": "v"}, ["a", "b"]))
    assert args == [1, [2]] and kwargs == {"k": "v"}


def test_classes_from_a_script_resolve_by_path(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent("""
        import asyncrl
        class Mine(asyncrl.Worker):
            pass
        if __name__ == "__main__":
            raise SystemExit("the guard must stay off when loaded by path")
    """))
    cls = resolve_ref("user_script", "Mine", str(script))  # not importable by name here
    assert cls.__name__ == "Mine" and issubclass(cls, asyncrl.Worker)
    assert resolve_ref(*make_ref(cls)) is cls


def test_malformed_messages_raise_decode_errors_not_crashes():
    for junk in (b"", b"\xc1", b"\x93\x01\x02", messages.encode(messages.Heartbeat())[:-1]):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            messages.decode(junk)


# -- codec and store edge cases ----------------------------------------------------------------
def _ext(code: int, header: list, raw: bytes) -> msgspec.msgpack.Ext:
    """An array as the codec puts it on the wire: header length, msgpack header, bytes."""
    head = msgspec.msgpack.encode(header)
    return msgspec.msgpack.Ext(code, len(head).to_bytes(4, "big") + head + raw)


SHAPE_ERROR = r"bad array shape .* ints >= 0|needs \d+ bytes but the message carries \d+"


@pytest.mark.parametrize("shape, raw", [
    ([1 << 40], b""), ([1 << 40], b"\0" * 8), ([-1], b"\0" * 8), ([3], b"\0" * 8),
    ([2, "2"], b"\0" * 16)])
def test_array_headers_must_match_the_bytes_sent(shape, raw):
    """A small message must not make the receiver allocate what it never sent."""
    for ext in (_ext(codec.EXT_TENSOR, ["float32", shape], raw),
                _ext(codec.EXT_NDARRAY, ["<f4", shape], raw)):
        with pytest.raises(ValueError, match=SHAPE_ERROR):
            codec.decode(msgspec.msgpack.encode(ext))
    good = codec.encode(asyncrl.TensorBatch({"t": torch.zeros(2)}))
    bad = msgspec.msgpack.encode(msgspec.msgpack.Ext(codec.EXT_BATCH, msgspec.msgpack.encode(
        [{"t": _ext(codec.EXT_TENSOR, ["float32", shape], raw)}, {}])))
    with pytest.raises(ValueError, match=SHAPE_ERROR):  # also where DP parts are joined
        codec.decode_concat([good, bad], lambda i, rows: None)


def test_numpy_arrays_keep_their_shape_and_structured_ones_are_refused():
    for a in (np.array(3.5), np.zeros((0, 3), np.int16), np.arange(6.0).reshape(2, 3).T):
        got = codec.decode(codec.encode(a))
        assert got.shape == a.shape and got.dtype == a.dtype and np.array_equal(got, a)
    with pytest.raises(TypeError, match="structured dtype .* send one array per field"):
        codec.encode(np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]))
    # no buffer to hand over: a large one went out of band and failed half-way through a
    # send (the next message, to any rank, was appended to it); a long double recursed
    for big in (np.zeros(10000, "M8[s]"), np.zeros(3, "m8[ms]")):
        with pytest.raises(codec.ArgEncodeError, match=r"numpy array of (datetime|timedelta)"
                                                       r"64\[m?s\] cannot be sent; send "
                                                       r"\.astype\('int64'\)"):
            codec.encode_call_oob((big,), {}, ["when"])
    with pytest.raises(codec.ArgEncodeError, match=r"numpy float\d+ scalar cannot be sent"):
        codec.encode_call_oob((np.longdouble(1.5),), {}, ["x"])
    if np.dtype(np.longdouble).itemsize > 8:  # (not where a long double is a float64)
        for wide in (np.zeros(2, np.longdouble), np.zeros(2, np.clongdouble)):
            with pytest.raises(TypeError, match=r"(float|complex)\d+ cannot be sent \(a long "
                                                r"double's bytes differ by machine\); send "
                                                r"\.astype\(np\.float64\)"):
                codec.encode(wide)  # (its raw bytes were sent: other values on aarch64)
    # their scalars changed type on the way (an int of nanoseconds, a str by unit)
    for scalar in (np.datetime64("2020-01-01T00:00:00.123456789"), np.datetime64("2020-01-01"),
                   np.timedelta64(3, "D")):
        with pytest.raises(codec.ArgEncodeError, match=r"numpy (datetime|timedelta)64\[\w+\] "
                                                       r"scalar cannot be sent; send \.astype"):
            codec.encode_call_oob((scalar,), {}, ["when"])
    # a masked array lost its mask; a DTensor failed in numpy(), naming no argument
    with pytest.raises(codec.ArgEncodeError, match="masked array cannot be sent"):
        codec.encode_call((np.ma.masked_array([1, 2], mask=[0, 1]),), {}, ["a"])

    class Sub(torch.Tensor):  # (as a DTensor is)
        pass
    with pytest.raises(codec.ArgEncodeError, match=r"Sub cannot be sent; send a plain tensor "
                                                   r"\(a DTensor's .full_tensor\(\)") as e:
        codec.encode_call((1, torch.ones(2).as_subclass(Sub)), {}, ["a", "w"])
    assert e.value.name == "w"


def test_conjugated_negated_and_sparse_tensors():
    z = torch.tensor([1 + 2j, 3 - 1j])
    for t in (z.conj(), z._neg_view(), torch.stack([z, z]).conj().T):
        assert torch.equal(codec.decode(codec.encode(t)), t.resolve_conj().resolve_neg())
    with pytest.raises(codec.ArgEncodeError) as info:
        codec.encode_call((1, torch.eye(2).to_sparse()), {}, ["a", "grad"])
    assert info.value.name == "grad" and isinstance(info.value.cause, TypeError)
    assert "to_dense()" in str(info.value.cause)


def test_a_batch_column_that_cannot_be_sent_is_refused_naming_it():
    """A large batch is stored, not encoded: its quantized column reached the consumer's
    data plane as bare bytes (its scale lost: broken at first use), a sparse one failed
    deep inside the producer. Refused when the result is kept, naming the column."""
    from asyncrl.futures.store import schema_of

    q = _made_quietly(lambda: torch.quantize_per_tensor(torch.ones(70000), 0.1, 0, torch.qint8))
    for column, message in [(q, r"qint8 tensor cannot be sent .* t.dequantize\(\)"),
                            (torch.eye(3).to_sparse(), "sparse_coo tensor cannot be sent")]:
        batch = asyncrl.TensorBatch({"ok": torch.zeros(len(column)), "bad": column})
        with pytest.raises(TypeError, match=f"column 'bad' of the TensorBatch: a torch.{message}"):
            schema_of(batch)
    assert schema_of(asyncrl.TensorBatch({"ok": torch.zeros(3, 2)})).nbytes == 24


def test_an_int_past_64_bits_in_a_stored_value_is_refused_as_it_is_kept():
    """Checked by type only, it was found when the value was sent: at a consumer's pull,
    blamed on the consumer, or the driver's fetch."""
    from asyncrl.futures.store import schema_of

    big = 1 << 64
    for value, path in [({"ids": [1, 2, big]}, r"\['ids'\]\[2\]"), ([1.0, -big], r"\[1\]"),
                        (asyncrl.TensorBatch({"n": [[0], ["a", big]]}), r"\['n'\]\[1\]\[1\]"),
                        ({big: 1}, rf"\[{big}\]")]:
        with pytest.raises(TypeError, match=rf"value{path}: the int -?{big} is past 64 bits"):
            schema_of(value)
    assert schema_of([-(1 << 63), big - 1]).nbytes == 0  # msgpack's whole range


def test_builtins_travel_by_module_and_name_or_are_refused():
    """torch.mean's qualname is "_VariableFunctionsClass.mean", which never resolved on the
    ranks; a bound builtin method (random.random) was refused as "defined inside a function"."""
    args, _ = codec.decode_call(codec.encode_call((torch.mean,), {}, ["f"]))
    assert args[0] is torch.mean
    assert codec.decode(codec.encode(torch.cat)) is torch.cat
    assert codec.decode(codec.encode(len)) is len
    with pytest.raises(codec.ArgEncodeError, match="random") as info:
        codec.encode_call((random.random,), {}, ["f"])
    assert "send a module-level function (def) that calls it" in str(info.value.cause)


def test_object_store_counts_an_overwritten_object_once():
    from asyncrl.futures.store import ObjectStore
    store = ObjectStore()
    store.put(1, "a", 10)
    store.put(1, "b", 30)
    assert store.nbytes == 30 and store.get(1) == "b"
    store.free([1])
    assert store.nbytes == 0


def test_a_call_whose_exception_cannot_be_shown_still_gets_a_result():
    from types import SimpleNamespace

    from asyncrl.actors.rank_main import _Executor

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    class Fails:
        def unprintable(self):
            raise Unprintable()

        def surrogate(self):  # os.fsdecode'd file names carry lone surrogates
            raise FileNotFoundError("no file b'\udcff'")

    sent: list = []
    ex = object.__new__(_Executor)  # no sockets: the Results land in `sent`, encoded as sent
    ex.main = SimpleNamespace(worker=Fails(), rank=3, call_starts=lambda: True,
                              call_ended=lambda: None)
    ex.sock = SimpleNamespace(send=lambda m: sent.append(messages.decode(messages.encode(m))))
    ex.data = SimpleNamespace(materialize=lambda x: x)
    payload = msgspec.Raw(codec.encode_call((), {}, []))
    ex.run_call(messages.Call(1, "unprintable", payload))
    ex.run_call(messages.Call(2, "surrogate", payload))
    assert [(r.call_id, r.rank) for r in sent] == [(1, 3), (2, 3)]
    assert sent[0].error.type.endswith("Unprintable")
    assert "Unprintable raised RuntimeError; its message is lost" in sent[0].error.message
    assert "Unprintable" in sent[0].error.traceback
    assert sent[1].error.message == "no file b'\\udcff'"


def test_a_user_protocols_split_is_checked_before_anything_is_sent():
    from asyncrl.actors.protocols import Split, check_split

    check_split("mine", Split({0: ((), {}), 1: ((), {})}, [1]), 2)  # fine
    with pytest.raises(ValueError, match="protocol 'mine': split called no rank .* never"):
        check_split("mine", Split({}, []), 2)
    with pytest.raises(ValueError, match=r"split calls ranks \['2 \(int\)'\], but the "
                                         r"group's ranks are the ints 0..1"):
        check_split("mine", Split({0: ((), {}), 2: ((), {})}, [0]), 2)
    import numpy as np  # said with its type (it read "ranks ['0', '1'] ... are 0..1")

    with pytest.raises(ValueError, match=r"\['0 \(int64\)', '1 \(int64\)'\], but the "
                                         r"group's ranks are the ints"):
        check_split("mine", Split({np.int64(0): ((), {}), np.int64(1): ((), {})}, []), 2)
    with pytest.raises(ValueError, match=r"\['True \(bool\)'\]"):
        check_split("mine", Split({True: ((), {})}, []), 2)
    with pytest.raises(ValueError, match=r"collect names ranks \['1'\] that split does not "
                                         r"call \(calls \[0\]\)"):
        check_split("mine", Split({0: ((), {})}, [0, 1]), 2)
    with pytest.raises(TypeError, match="split returned dict, not an asyncrl.Split"):
        check_split("mine", {0: ((), {})}, 2)


def test_a_future_failed_by_a_timeout_of_its_own_says_so_not_that_it_is_pending():
    """`fut.result(t)` took a call's TransferTimeout (a TimeoutError, as concurrent.futures'
    is since 3.11) for its own wait running out: "not done", the cause dropped, and a retry
    loop spun forever on a future that had failed."""
    import asyncio
    import threading

    from asyncrl.futures.future import DistFuture

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        pending = DistFuture._new(loop, "rollout.generate")
        with pytest.raises(TimeoutError, match="rollout.generate not done after 0.05 s"):
            pending.result(0.05)
        failed = DistFuture._new(loop, "rollout.generate")
        cause = asyncrl.TransferTimeout("no answer from g:0 within 60 s")
        loop.call_soon_threadsafe(failed._set_exception, cause)
        for timeout in (None, 5.0):
            with pytest.raises(asyncrl.TransferTimeout, match="no answer from g:0"):
                failed.result(timeout)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_only_asyncrls_own_data_plane_errors_are_raised_as_themselves():
    """Matched by class name alone, a user's exception named InputLostError became asyncrl's
    (its traceback lost, and recovery took it for a dead group and rewound)."""
    from asyncrl.actors.rank_main import _failure
    from asyncrl.controller.group import _DATA_PLANE_ERRORS

    for own in (asyncrl.TransferTimeout, asyncrl.InputLostError):
        assert _DATA_PLANE_ERRORS[_failure(own("x")).type] is own

    theirs = type("InputLostError", (Exception,), {})  # a user's, by chance of the name
    assert _failure(theirs("y")).type == "InputLostError"
    assert _failure(theirs("y")).type not in _DATA_PLANE_ERRORS


def test_gather_groups_are_sized_by_the_parameters_not_their_freed_targets():
    """A GPU engine's weights are freed while training (0 elements) and a ZeRO-3 partition's
    numel() is 0 too: grouped by those, the first switch gathered the whole model at once."""
    from asyncrl.hybrid.gather import plan_gather

    plain = [torch.nn.Parameter(torch.zeros(4096)) for _ in range(4)]  # 16 KiB each
    zero3 = [torch.nn.Parameter(torch.empty(0)) for _ in range(6)]
    for p in zero3:
        p.ds_numel = 4096  # what DeepSpeed gives a partitioned parameter
    freed = [(p, torch.empty(0)) for p in plain + zero3]
    plan = plan_gather(freed, 32 << 10, together=True)
    assert [len(group) for group in plan] == [2, 2, 2, 2, 2]
    assert [len(group) for group in plan_gather(freed, 32 << 10)] == [1] * 10


def test_a_file_that_fails_to_load_leaves_the_import_path_as_it_was(tmp_path):
    """Loading a flow file (or a function's, named in a message) put its folder first on
    sys.path for good, even when the file was missing or raised."""
    import sys

    from asyncrl.comm.refs import _load_file

    broken = tmp_path / "broken_flow.py"
    broken.write_text("raise RuntimeError('a flow that fails')\n")
    before = list(sys.path)
    with pytest.raises(RuntimeError, match="a flow that fails"):
        _load_file(str(broken))
    with pytest.raises(FileNotFoundError):
        _load_file(str(tmp_path / "missing.py"))
    assert sys.path == before


def test_encodes_past_is_a_lower_bound_that_stops_early():
    """A rank measured whether a result could come inline by encoding it whole: a list of
    millions of numbers held its GIL for seconds (one C call: no heartbeat went) only to be
    dropped. encodes_past says so without encoding, and never of a value that fits."""
    rng = random.Random(0)

    def value(depth: int) -> object:
        kind = rng.randrange(7 if depth < 3 else 4)
        if kind == 0:
            return rng.randrange(-2**40, 2**40)
        if kind == 1:
            return "x" * rng.randrange(3000)
        if kind == 2:
            return torch.ones(rng.randrange(400))
        if kind == 3:
            return rng.random()
        if kind == 4:
            return [value(depth + 1) for _ in range(rng.randrange(40))]
        if kind == 5:
            return {f"k{i}": value(depth + 1) for i in range(rng.randrange(40))}
        n = rng.randrange(1, 9)
        return asyncrl.TensorBatch({"t": torch.ones(n, 50), "l": ["y" * 200] * n})
    seen = set()
    for _ in range(400):
        v = value(0)
        size = len(codec.encode(v))
        past = codec.encodes_past(v, 4096)
        assert not past or size > 4096, (size, v)  # never says so of one that fits
        seen.add((past, size > 4096))
    assert (True, True) in seen and (False, False) in seen
    huge = [list(range(4096))] * 1_000_000  # 4 billion numbers: said at once
    assert codec.encodes_past(huge, 64 * 1024)


@dataclasses.dataclass
class _Held:
    t: torch.Tensor


class _HeldStruct(msgspec.Struct):
    t: torch.Tensor


def test_sizes_count_what_structs_dataclasses_and_batch_meta_hold():
    """A dataclass holding 400 MB counted 0 bytes: the rank encoded it whole to find it did
    not fit inline, and its store schema said 0 bytes (no time allowed to move them)."""
    for v in (_Held(torch.zeros(10**6)), _HeldStruct(torch.zeros(10**6)),
              [{"k": _Held(torch.zeros(10**6))}]):
        assert codec.encodes_past(v, 64 << 10) and codec.array_bytes(v) == 4_000_000
    assert not codec.encodes_past(_Held(torch.zeros(10)), 64 << 10)
    assert not codec.encodes_past(_Held, 64 << 10) and codec.array_bytes(_Held) == 0  # a class
    meta = asyncrl.TensorBatch({"x": [1]}, {"ref": torch.zeros(10**6)})
    assert codec.encodes_past(meta, 64 << 10)


class _Defaults(msgspec.Struct, omit_defaults=True):
    a: int = 1
    b: str = "x"


class _Row(msgspec.Struct, array_like=True):
    a: int
    b: str


def test_structs_and_dataclasses_arrive_as_plain_values():
    """As the codec's docstring says: no type is sent; msgspec.convert gives it back."""
    got = codec.decode(codec.encode(_Held(torch.arange(3))))
    assert list(got) == ["t"] and torch.equal(got["t"], torch.arange(3))
    assert codec.decode(codec.encode(_Defaults())) == {}  # the defaults left out
    assert codec.decode(codec.encode(_Defaults(b="y"))) == {"b": "y"}
    assert codec.decode(codec.encode(_Row(1, "z"))) == [1, "z"]
    assert msgspec.convert(codec.decode(codec.encode(_Defaults(b="y"))), _Defaults) == \
        _Defaults(b="y")


def test_numpy_void_arrays_still_pass():
    a = np.frombuffer(b"abcdef", dtype="V2")
    got = codec.decode(codec.encode(a))
    assert got.dtype == a.dtype and got.tobytes() == b"abcdef"


def test_numpy_extension_dtypes_are_refused_not_sent_as_raw_bytes():
    """ml_dtypes' bfloat16 arrays (dtype kind 'V', not np.void) arrived as '|V2' byte blobs,
    their type lost, when large (out of band); small ones failed in numpy, unexplained.
    (Skipped without ml_dtypes: numpy alone makes no such dtype.)"""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dt in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
        for n, encode in ((3, codec.encode), (codec.OOB_MIN_BYTES, codec.encode_oob)):
            with pytest.raises(TypeError, match=rf"numpy array of {np.dtype(dt)} cannot be "
                                                r"sent \(it would arrive as raw .V\d bytes.*send "
                                                r"a torch tensor .*view\(np\.uint"):
                encode(np.ones(n, dtype=dt))
