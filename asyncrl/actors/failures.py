"""A rank's failure, as it goes back to the controller in a Result or a Ready."""

from __future__ import annotations

from asyncrl.comm.messages import Failure
from asyncrl.compat import format_exception
from asyncrl.errors import InputLostError, TransferTimeout


def failure(e: BaseException) -> Failure:
    """The failure to send back; never raises, or the call would get no Result at all.
    asyncrl's own data-plane errors go under their full names: the controller raises them
    as themselves (a user's exception of the same name stays a RemoteError)."""
    name = type(e).__qualname__
    if type(e) in (TransferTimeout, InputLostError):
        name = f"asyncrl.{name}"
    try:
        message = str(e)
    except BaseException as broken:  # noqa: BLE001 - a user exception's own __str__ failed
        message = (f"<str() of the {name} raised {type(broken).__qualname__}; its message "
                   f"is lost>")
    try:  # from `e` itself, not the exception being handled: a failure found outside its
        # except block (a concurrent call's thread that failed) has its own traceback too
        tb = format_exception(e)
    except BaseException:  # noqa: BLE001 - e.g. a broken __repr__ / __str__ deeper down
        tb = f"{name}: {message}\n(the traceback could not be formatted)\n"
    return Failure(type=name, message=sendable(message), traceback=sendable(tb))


def sendable(text: str) -> str:
    """`text` without lone surrogates (os.fsdecode'd names carry them): msgpack refuses them."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
