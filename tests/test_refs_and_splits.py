"""What is refused on the controller before it goes wrong on the ranks: a user protocol's
calls that are not (args, kwargs), a result holding a tensor that cannot be sent (and a
fetched one that could not: the rank's failure), a class or function from an interactive
session's __main__."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import sys
import types
import uuid
import warnings
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

import asyncrl
from asyncrl.actors.protocols import Split, check_split
from asyncrl.comm.refs import make_ref
from asyncrl.futures.store import schema_of


def _quantized(n: int) -> torch.Tensor:
    with warnings.catch_warnings():  # (torch deprecates quantized tensors: still made)
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.zeros(n), 0.1, 0, torch.qint8)


@dataclasses.dataclass
class Point:
    y: object
    z: object


# -- a user protocol's calls -----------------------------------------------------------------
@pytest.mark.parametrize("call, got", [
    ((asyncrl.TensorBatch({"x": [1, 2]}), {}), r"tuple of 2: \(TensorBatch, dict\)"),
    (((1,),), r"tuple of 1: \(tuple\)"),
    ([(1,), {}, {}, 4], r"list of 4: \(tuple, dict, dict, \.\.\.\)"),
    (None, "NoneType")])
def test_a_user_splits_calls_must_be_args_and_kwargs(call, got):
    """`((chunk), {})` (a 1-tuple without its comma) ran fn(*chunk) on every rank and failed
    there as "TensorBatch has no column 0"; `(args,)` failed unpacking inside asyncrl."""
    split = Split({0: ((1,), {}), 1: call}, [0, 1])
    with pytest.raises(TypeError, match=r"protocol 'mine': split's calls\[1\] must be a pair "
                                        r"\(args, kwargs\).*1-tuple needs its comma.*got " + got):
        check_split("mine", split, 2)
    check_split("mine", Split({0: ((1,), {}), 1: ([1], {"k": 2})}, [0, 1]), 2)  # fine


# -- a result's tensors ----------------------------------------------------------------------
def test_tensors_inside_a_non_batch_result_are_checked_where_they_are():
    """A large result is stored, not encoded: a quantized tensor in a dict resolved the call,
    then its await failed as LookupError (the fetch's encoding), naming no method."""
    q = _quantized(70_000)
    with pytest.raises(TypeError, match=r"value\['q'\]: a torch.qint8 tensor cannot be sent"):
        schema_of({"q": q})
    with pytest.raises(TypeError, match=r"value\[1\]\['s'\]: a torch.sparse_coo tensor"):
        schema_of([1, {"s": torch.eye(3).to_sparse()}])
    with pytest.raises(TypeError, match=r"^a torch.qint8 tensor cannot be sent"):
        schema_of(q)
    assert schema_of({"a": torch.zeros(10), "b": [1, (torch.zeros(2, 2), "x")]}).nbytes == 56



def test_what_the_codec_cannot_send_in_a_stored_result_is_refused_where_it_is():
    """A large result is stored, not encoded: a batch's list column of Fractions, a list of
    complex numbers passed its call and failed at a consumer's pull (blamed on the consumer)
    or at the driver's fetch. Checked by type, as cheaply as the tensors."""
    with pytest.raises(TypeError, match=r"value\['f'\]\[0\]: an object of type "
                                        r"fractions.Fraction cannot be sent"):
        schema_of(asyncrl.TensorBatch({"x": torch.zeros(70_000), "f": [Fraction(1, 3)] * 70_000}))
    with pytest.raises(TypeError, match=r"value\['c'\]\[0\]: an object of type builtins.complex"):
        schema_of({"c": [1j] * 70_000})
    with pytest.raises(TypeError, match=r"value\[0\].z: a numpy array of Python objects"):
        schema_of([Point(np.zeros(2), np.array([None]))])
    with pytest.raises(TypeError, match=r"value\[1\]: a numpy datetime64\[s\] scalar"):
        schema_of([1, np.datetime64(1, "s")])
    fine = {"ints": list(range(70_000)), "strs": ["ab"] * 70_000, "rows": [{"a": 1.0}] * 70_000,
            "others": [Point(np.float32(1), (uuid.uuid4(), datetime.date.today(), {1, 2})),
                       Decimal(1), enum.Enum("E", "a").a, np.zeros(3), make_ref, bytearray(2)]}
    assert schema_of(fine).nbytes == 24

class Quantizer(asyncrl.Worker):
    @asyncrl.register
    def quantized(self) -> dict:
        return {"q": _quantized(70_000)}  # > 64 KiB: stored, not encoded with its Result


@pytest.fixture(scope="module")
def quantizer(bg):
    return bg.spawn(Quantizer, nprocs=1, name="quantizer")


def test_a_large_result_holding_a_quantized_tensor_fails_its_call(quantizer):
    with pytest.raises(asyncrl.RemoteError, match=r"quantized returned a value that cannot be "
                                                  r"sent: value\['q'\]: a torch.qint8 tensor"):
        quantizer.quantized().result(timeout=60)



def test_a_fetch_the_rank_could_not_send_is_its_failure_not_a_lookup_error():
    """Fetches.answered made every failed fetch a LookupError, as if the rank had let the
    object go: a value the rank holds but could not encode is its failure (RuntimeError)."""
    import asyncio

    from asyncrl.comm.messages import Fetched
    from asyncrl.controller.fetches import Fetches

    async def main():
        fetches = Fetches("g", asyncio.get_running_loop(), lambda rank, msg: None, timeout=30)
        got = []
        for obj_id, answer in ((1, Fetched(1, 0, error="object 1 is not held by g:0",
                                           missing=True)),
                               (2, Fetched(2, 0, error="TypeError: cannot encode object"))):
            asyncio.get_running_loop().call_soon(fetches.answered, answer)
            with pytest.raises(Exception) as e:
                await fetches.get(0, obj_id)
            got.append((type(e.value), str(e.value)))
        return got
    (missing, unsent) = asyncio.run(main())
    assert missing[0] is LookupError and "not held by g:0" in missing[1]
    assert unsent[0] is RuntimeError and "g:0: TypeError: cannot encode" in unsent[1]

# -- refs ------------------------------------------------------------------------------------
def _defined_in(main: types.ModuleType) -> types.FunctionType:
    def main_fn() -> None:
        pass
    main_fn.__module__, main_fn.__qualname__ = "__main__", "main"
    main.main = main_fn  # type: ignore[attr-defined]
    return main_fn


def test_a_function_from_an_interactive_main_is_refused(monkeypatch):
    """A __main__ with no file (a notebook, python -c) gave file "": the ranks, whose
    __main__ is another program, took their own `main` for it, or failed after the launch."""
    interactive = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", interactive)
    with pytest.raises(TypeError, match="'main' is defined in an interactive session.*define "
                                        "it in a .py file and import it"):
        make_ref(_defined_in(interactive))
    script = types.ModuleType("__main__")
    script.__file__ = __file__
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert make_ref(_defined_in(script)) == ("__main__", "main", __file__)
