"""Where a run's metrics go besides metrics.jsonl: TensorBoard (when installed) and Weights &
Biases (`asyncrl launch --wandb PROJECT`). Each takes a step's row, a rewind (a recovery
went back to a checkpoint: the steps after it run again), a flush and a close; its notices go
to `say`: stderr, or the controller's console once it runs (a thread of its own writes it: a
console that does not read must not stop the controller's loop)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from asyncrl.controller.logs import replace_json
from asyncrl.errors import AsyncRLError

WANDB_STATE = "wandb.json"  # in the run directory: the wandb run's id, for --resume


class TrackerError(AsyncRLError, RuntimeError):
    """A tracker asked for cannot start (said before any group starts)."""


def stderr(text: str) -> None:
    """A tracker's notice on stderr (no controller's console yet, or none any more)."""
    with contextlib.suppress(OSError, ValueError):  # a console gone: the run goes on
        sys.stderr.write(text)
        sys.stderr.flush()


class TensorBoard:
    """Scalars under run_dir/tensorboard, the writer made with the first row (a run that never
    got one leaves none). Event files are append-only: the steps a rewind or a resume runs
    again are hidden by a purge, and show once, with their new values."""

    def __init__(self, run_dir: Path, first_step: int = 0):
        self.dir = Path(run_dir) / "tensorboard"
        self.writer: Any = None
        self._purge: int | None = first_step or None
        self._missing = find_spec("tensorboard") is None
        self.say: Callable[[str], None] = stderr

    def log(self, step: int, row: dict[str, float]) -> None:
        if self.writer is None and not self._missing:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.dir), purge_step=self._purge)
                self._purge = None
            except Exception as e:  # noqa: BLE001 - TensorBoard is optional: said, and off
                self._off(f"could not start its writer in {self.dir}", e)
        if self.writer is not None:
            try:
                for k, v in row.items():
                    self.writer.add_scalar(k, v, step)
            except Exception as e:  # noqa: BLE001 - the training goes on without it
                self._off(f"logging step {step} failed", e)

    def _off(self, what: str, e: Exception) -> None:
        self.say(f"tensorboard: {what} ({type(e).__name__}: {e}); no more rows go to "
                 f"TensorBoard in this run (metrics.jsonl has them all)\n")
        writer, self._missing, self.writer = self.writer, True, None
        if writer is not None:
            with contextlib.suppress(Exception):  # (its thread and file: what it can)
                writer.close()

    def rewind(self, step: int) -> None:
        if self.writer is not None:  # the next writer purges from the first step run again
            writer, self.writer = self.writer, None
            try:
                writer.close()
            except Exception as e:  # noqa: BLE001 - optional: never ends a run that recovered
                self._off("closing its writer for a rewind failed", e)
        self._purge = step + 1 if self._purge is None else min(self._purge, step + 1)

    def flush(self) -> None:
        if self.writer is not None:
            try:
                self.writer.flush()
            except Exception as e:  # noqa: BLE001 - as in log
                self._off("flushing failed", e)

    def close(self, failed: bool = False) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception as e:  # noqa: BLE001 - as in log
                self.writer = None
                self._off("closing failed", e)


class Wandb:
    """One wandb run per asyncrl run, named after the run directory, its id kept in
    run_dir/wandb.json so that `--resume` goes on in the same wandb run. A resume logs the
    steps after its checkpoint again: a killed controller's last rows may never have reached
    wandb, which buffers them (where it has them, it refuses the repeats: its steps only
    increase). Within a run, the steps a rewind runs again keep their first values there
    (metrics.jsonl and TensorBoard show the new ones), and the run says so. WANDB_MODE=offline
    runs without a network (`wandb sync` uploads later); WANDB_ENTITY and the like apply.
    A wandb failure mid-run is said and ends wandb's logging, not the run."""

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any],
                 resumed_after: int | None = None):
        """`resumed_after`: the step of the checkpoint a resume starts after."""
        require_wandb()
        import wandb

        self.say: Callable[[str], None] = stderr

        state = Path(run_dir) / WANDB_STATE
        saved = _read_state(state) if resumed_after is not None else {}
        if saved.get("project") != project:
            saved = {}  # another project: a new wandb run there
        # the console is ours (the progress line; ranks' output is in logs/): not captured,
        # unless WANDB_CONSOLE says otherwise
        settings = wandb.Settings() if "WANDB_CONSOLE" in os.environ else \
            wandb.Settings(console="off")
        try:
            self.run: Any = wandb.init(
                project=project, name=Path(run_dir).name, config=config, dir=str(run_dir),
                id=saved.get("id"), resume="allow", settings=settings)
        except Exception as e:  # noqa: BLE001 - said before any group starts
            wandb.teardown()  # its service process, started for the run
            raise TrackerError(
                f"wandb could not start a run in project {project!r}: {type(e).__name__}: "
                f"{e}. Log in (`wandb login` or WANDB_API_KEY), or set WANDB_MODE=offline "
                f"to keep the run on disk (`wandb sync` uploads it later); "
                f"WANDB_INIT_TIMEOUT bounds the wait for its server") from e
        self.logged = -1 if resumed_after is None else resumed_after  # the last step given
        self._said_through = -1  # the steps skipped were said up to here
        replace_json(state, {"id": self.run.id, "project": project})  # a resume reads it

    def log(self, step: int, row: dict[str, float]) -> None:
        if self.run is None:
            return
        if step <= self.logged:
            if step > self._said_through:
                self.say(f"wandb: step {step} ran again; wandb keeps the values it was "
                         f"given first (through step {self.logged}); metrics.jsonl has the "
                         f"new ones\n")
                self._said_through = self.logged
            return
        try:
            self.run.log(row, step=step)
        except Exception as e:  # noqa: BLE001 - the training goes on without wandb
            self.say(f"wandb: logging step {step} failed ({type(e).__name__}: {e}); no "
                     f"more rows go to wandb in this run (metrics.jsonl has them all)\n")
            try:  # (a dead wandb service fails its finish too: still not the run's end)
                self.close(failed=True)
            except Exception as e:  # noqa: BLE001 - said; the training goes on
                self.say(f"wandb: closing its run failed too ({type(e).__name__}: {e})\n")
            return
        self.logged = step

    def rewind(self, step: int) -> None:
        """Nothing to take back (wandb refuses the steps up to `logged` when they come);
        the first of them is said again."""
        self._said_through = min(self._said_through, step)

    def flush(self) -> None:
        """wandb writes as it goes."""

    def close(self, failed: bool = False) -> None:
        import wandb

        run, self.run = self.run, None
        try:
            if run is not None:
                run.finish(exit_code=1 if failed else 0)
        finally:
            wandb.teardown()  # its service process too: a run leaves none behind


def require_wandb() -> None:
    """Refuse --wandb where wandb is not installed, before anything starts."""
    if find_spec("wandb") is None:
        raise TrackerError("--wandb needs the wandb package: pip install 'asyncrl[wandb]'")


def wandb_project_of(run_dir: Path) -> str | None:
    """The wandb project a run logged to (None: it did not), for its resume."""
    project = _read_state(Path(run_dir) / WANDB_STATE).get("project")
    return project if isinstance(project, str) else None


def _read_state(path: Path) -> dict[str, Any]:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # an earlier run without wandb: a new wandb run
    return saved if isinstance(saved, dict) else {}
