"""Exceptions that say who failed. A leaf module: every layer may import it."""

from __future__ import annotations


class AsyncRLError(Exception):
    """Base class of every error asyncrl raises on purpose."""


class RemoteError(AsyncRLError):
    """User code raised on a rank; the remote traceback is attached."""

    def __init__(self, group: str, rank: int, method: str, exc_type: str, message: str,
                 remote_traceback: str):
        self.group, self.rank, self.method = group, rank, method
        self.exc_type, self.remote_message = exc_type, message
        self.remote_traceback = remote_traceback
        super().__init__(
            f"{group}[rank {rank}].{method} raised {exc_type}: {message}\n"
            f"--- remote traceback (group {group!r}, rank {rank}) ---\n{remote_traceback}")

    def __reduce__(self):  # keep the exception copyable although __init__ takes many args
        return (type(self), (self.group, self.rank, self.method, self.exc_type,
                             self.remote_message, self.remote_traceback))


class GroupDeadError(AsyncRLError):
    """A rank of the group died or stopped answering; the group cannot run calls any more."""

    def __init__(self, group: str, rank: int | None, exit_code: int | None, reason: str,
                 log_tail: str = ""):
        self.group, self.rank, self.exit_code, self.reason = group, rank, exit_code, reason
        self.log_tail = log_tail
        who = f"rank {rank}" if rank is not None else "a rank"
        code = "" if exit_code is None else (
            f" (killed by signal {-exit_code})" if exit_code < 0 else f" (exit code {exit_code})")
        tail = f"\n--- last lines of its output ---\n{log_tail}" if log_tail else ""
        super().__init__(f"group {group!r}: {who} is dead{code}: {reason}{tail}")

    def __reduce__(self):
        return (type(self), (self.group, self.rank, self.exit_code, self.reason, self.log_tail))


class SpawnError(AsyncRLError):
    """A group could not be started: torchrun failed, or a rank never said hello or got ready."""


class SpawnTimeout(SpawnError, TimeoutError):
    """Start-up or construction of a group took longer than its timeout."""


class ClosedError(AsyncRLError):
    """The controller or group was closed by you; calls on it are refused."""


class EncodeError(AsyncRLError, TypeError):
    """An argument or result cannot cross the wire (nothing is ever pickled)."""


class RecoveryError(AsyncRLError, RuntimeError):
    """A flow cannot recover from a group's death (a one-shot input iterator, no state to go
    back to, a re-run that changed its futures)."""


class SettingError(AsyncRLError, ValueError):
    """A key=value setting on the command line that the flow does not declare, or whose
    value is not of its default's type. `unknown`: the undeclared keys."""

    def __init__(self, message: str, unknown: list[str] | None = None):
        super().__init__(message)
        self.unknown = unknown or []


class CheckpointError(AsyncRLError, ValueError):
    """A checkpoint cannot be written or resumed: none is there, it belongs to another flow,
    or a run directory would be overwritten. The message names the directory and the fix."""


class TransferTimeout(AsyncRLError, TimeoutError):
    """A data-plane peer did not answer in time; the message names the peer and operation."""


class InputsExhausted(AsyncRLError):
    """A node drew inputs of its own beside the flow's (DAPO's dynamic sampling: more prompt
    batches) and they ran out: a DataFlow ends the run there, as when an input runs out."""


class InputLostError(AsyncRLError):
    """A call's input was held by a group that died or was closed before the call's ranks
    pulled all of it: those rows are gone. The message names the group and why."""
