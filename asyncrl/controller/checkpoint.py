"""Checkpoint directories: everything a DataFlow run needs to continue exactly where it stopped.

    RUN_DIR/checkpoints/step_000003.tmp/   written first: <group>/ (each rank's RNG states and
                                           what its Worker.save_state wrote), controller_rng.pt,
                                           and meta.json last
    RUN_DIR/checkpoints/step_000003/       then renamed: only a complete checkpoint has this name

meta.json: {"step": the last finished step index, "flow": identity(flow), "inputs":
flow.positions(), "sizes": each group's ranks, "overrides": the run's key=value settings
(a resume takes them again, under its own), "launch_options": --steps, --checkpoint-every
and --keep-checkpoints as given (a resume goes on with them unless given others) and the
flow's own steps (flow_steps: where they changed since, they replace a saved --steps)
and the flow file's real path (flow_file: what --resume without --run-dir looks for),
"time": when}.
A `.tmp` folder is a save that died half-way: never resumed from, removed by the next save.
The newest `keep` checkpoints are kept (None: all).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import re
import shutil
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from asyncrl.actors.worker import not_yours, rng_state, set_rng_state, sync_dir, sync_tree
from asyncrl.controller.declare import OVERRIDES_ENV
from asyncrl.controller.flow import DataFlow
from asyncrl.controller.logs import say
from asyncrl.errors import AsyncRLError, CheckpointError, GroupDeadError, RemoteError

CHECKPOINTS = "checkpoints"
KEEP = 3  # the default number of checkpoints kept: enough to step back past a bad one
_NAME = re.compile(r"step_(\d+)")


def identity(flow: DataFlow) -> dict[str, Any]:
    """What a checkpoint must match to be resumed by `flow`: its file, nodes and groups."""
    files = sorted({os.path.basename(getattr(sys.modules.get(n.fn.__module__), "__file__", None)
                                     or n.fn.__module__) for n in flow.nodes.values()})
    return {"file": ", ".join(files), "nodes": sorted(flow.nodes),
            "groups": {g.name: g.worker_cls.__qualname__ for g in flow.groups}}


def complete(run_dir: Path) -> list[Path]:
    """The complete checkpoints in `run_dir`, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    found = [(int(m.group(1)), p) for p in root.glob("step_*")
             if (m := _NAME.fullmatch(p.name)) and (p / "meta.json").is_file()]
    return [p for _, p in sorted(found)]


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint in `run_dir`, or None."""
    found = complete(run_dir)
    return found[-1] if found else None


def read_meta(path: Path) -> dict[str, Any]:
    """The meta.json of checkpoint `path`."""
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as e:  # (a disk's fault, a hand's edit)
        raise CheckpointError(f"{file} cannot be read ({e}); {_aside(path)}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"{file} is not a checkpoint's meta.json (no step in it); "
                              f"{_aside(path)}")
    return meta


def _aside(path: Path) -> str:
    """What to do with a damaged checkpoint."""
    return (f"move {Path(path).name} out of {Path(path).parent} to resume from the "
            f"checkpoint before it")


def refuse_existing(run_dir: Path) -> None:
    """A fresh run must not mix its checkpoints and metrics with an earlier run's."""
    found = latest(run_dir)
    if found is not None:
        raise CheckpointError(
            f"{run_dir} already holds checkpoints of an earlier run (newest: {found.name}); "
            f"choose another --run-dir, or continue that run with `asyncrl launch ... "
            f"--resume`")
    run_dir = Path(run_dir)
    rows, board, recoveries = (run_dir / "metrics.jsonl", run_dir / "tensorboard",
                               run_dir / "recoveries.jsonl")
    held = [p.name for p in (rows, recoveries) if p.is_file() and p.stat().st_size]
    if board.is_dir() and any(board.iterdir()):
        held.append(f"{board.name}/")
    if held:
        raise CheckpointError(
            f"{run_dir} already holds {', '.join(held)} of an earlier run (with no checkpoint "
            f"to resume from); choose another --run-dir, or remove "
            f"{'them' if len(held) > 1 else 'it'} to start afresh there (they would be "
            f"mixed with this run's)")


LOCK_FILE = ".lock"  # in the run directory: held by the launch running there (launch.py)
TRUST_RUN_DIR = "ASYNCRL_TRUST_RUN_DIR"  # "1": a run's folders are taken as its own
PRIVATE_DIR = 0o775  # the mode of the folders a run makes (no write for others, whatever
# the umask: a folder every user can write is refused, see not_yours)
PRIVATE_FILE = 0o664  # and of the files it makes


def open_to_all(run_dir: Path) -> str | None:
    """Why `run_dir` may not be used, where every user can write it (and TRUST_RUN_DIR does
    not say its mode lies): the Controller refuses it, and a launch before its cleanup."""
    if run_dir.stat().st_mode & 0o002 and os.environ.get(TRUST_RUN_DIR) != "1":
        return (f"run_dir {run_dir} is writable by every user: another user could redirect "
                f"its logs or replace its checkpoints (loaded with pickle on --resume); "
                f"choose a folder only you (or your group) can write (chmod o-w), or set "
                f"{TRUST_RUN_DIR}=1 where its mode says so falsely (some FUSE mounts)")
    return None


def _own(path: Path, use: str = "--resume", done: str = "resumed") -> None:
    """A checkpoint is code as well as data (torch's distributed checkpoints and DeepSpeed's
    are read with pickle, meta.json holds settings): refuse one that another user wrote, or
    could have: its folders above it and every folder and file in it (a few per group).
    `use`, `done`: the command that reads it, what it does (`asyncrl export`, "exported")."""
    tree = _tree(path)
    # the run dir above its checkpoints/ too (a step_* folder moved out of its run, given to
    # export: only the folder holding it)
    above = [path.parent.parent] if path.parent.name == CHECKPOINTS else []
    for where in (*above, path.parent, *tree):
        try:
            whose = not_yours(where)
        except OSError as e:  # (a link to nothing)
            whose = f"not checkable ({e.strerror})"
        if whose is not None and os.environ.get(TRUST_RUN_DIR) != "1":
            fix = "copy it into a run directory of yours"
            if _own_but_shared(where):  # (an earlier asyncrl's run under umask 0 wrote
                # its ranks' files so: a copy keeps the mode)
                fix = f"`chmod -R o-w {path if where in tree else where}` if you trust " \
                      f"its contents"
            raise CheckpointError(
                f"{use}: {where} is {whose}; "
                f"a checkpoint is loaded with pickle (torch's distributed checkpoints, "
                f"DeepSpeed's), so only one that you wrote, in folders only you (or your "
                f"group) can write, is {done}: {fix} (or set {TRUST_RUN_DIR}=1 where "
                f"that is false: root on NFS, a FUSE mount)")


def _own_but_shared(path: Path) -> bool:
    """`path` is this user's, and only others' write permission makes it refused."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and bool(st.st_mode & stat.S_IWOTH)


def _tree(path: Path) -> list[Path]:
    """`path` and every folder and file under it."""
    found = [path]
    for root, folders, files in os.walk(path):
        found += [Path(root, name) for name in (*folders, *files)]
    return found


def _unshared(path: Path) -> None:
    """Take others' write permission off every folder and file of this user's under `path`
    (ranks and torch make theirs as the umask says: under umask 0, writable by every user,
    which --resume refuses); links are left alone (a chmod would follow them), and another
    user's entries to --resume's check (root's, squashed on NFS: ASYNCRL_TRUST_RUN_DIR)."""
    for where in _tree(path):
        st = where.lstat()
        if st.st_uid == os.getuid() and not stat.S_ISLNK(st.st_mode) and \
                st.st_mode & stat.S_IWOTH:
            try:
                os.chmod(where, stat.S_IMODE(st.st_mode) & ~stat.S_IWOTH)
            except OSError:  # a mount that shows 0777 and refuses a chmod (vfat, exfat,
                pass  # some FUSE): the save goes on (--resume still refuses it, unless
                # ASYNCRL_TRUST_RUN_DIR=1)


def resumable(run_dir: Path, flow: DataFlow) -> tuple[Path, dict[str, Any]]:
    """The newest complete checkpoint in `run_dir` and its meta, checked against `flow`."""
    path = latest(run_dir)
    inside = _inside_a_run(Path(run_dir)) if path is None else None
    if inside is not None:  # (the advice below would have it removed: the checkpoints)
        raise CheckpointError(f"--resume: {inside}")
    if path is None:  # (a run stopped before its first checkpoint left files: a fresh run
        # there is refused, so another folder)
        held = Path(run_dir).is_dir() and any(p.name != LOCK_FILE
                                              for p in Path(run_dir).iterdir())
        afresh = "start afresh in another --run-dir (or remove this one)" if held else \
            "run without --resume to start afresh"
        raise CheckpointError(
            f"--resume: no complete checkpoint was found in {Path(run_dir) / CHECKPOINTS}; "
            f"{afresh}, or point --run-dir at a run that wrote checkpoints (every run "
            f"writes one at its end, and more with --checkpoint-every)")
    _own(path)
    meta = read_meta(path)
    mine = identity(flow)
    theirs = meta.get("flow", {})
    differ = [f"{key}: {theirs.get(key)!r} there, {mine[key]!r} here"
              for key in mine if theirs.get(key) != mine[key]]
    if differ:
        if differ == [f"file: {theirs.get('file')!r} there, {mine['file']!r} here"]:
            # the same nodes and groups: a renamed copy, or another recipe of the same shape
            differ.append(f"if {mine['file']!r} is a renamed copy of {theirs.get('file')!r}, "
                          f"resume under that name")
        raise CheckpointError(
            f"checkpoint {path} was written by another flow ({'; '.join(differ)}); resume "
            f"it with the flow file that wrote it, or run this flow in another --run-dir")
    here = sizes(flow)
    resized = [f"{name}: {n} there, {here.get(name)} here"
               for name, n in meta.get("sizes", {}).items() if here.get(name) != n]
    if resized:  # each rank loads its own state: another count would lose or lack some
        raise CheckpointError(
            f"checkpoint {path} was written by groups of other sizes (ranks of "
            f"{'; '.join(resized)}); resume with the settings that sized them (the "
            f"checkpoint's key=value overrides are taken again unless the command line "
            f"gives others: {meta.get('overrides', {})})")
    flow.feed.check(meta.get("inputs", {}))  # (not after every group loaded its weights)
    return path, meta


def _inside_a_run(folder: Path) -> str | None:
    """Why `folder`, a run's checkpoints folder or a checkpoint, is no run folder, and what
    to give --run-dir instead (None: it is neither)."""
    run: Path | None
    if (folder / "meta.json").is_file():
        what, run = "a checkpoint", folder.parent.parent
        if folder.parent.name != CHECKPOINTS:  # (moved out of its run)
            what, run = f"a checkpoint outside a run's {CHECKPOINTS}/ folder", None
    elif folder.name == CHECKPOINTS and any(folder.glob("step_*")):
        what, run = "a run's checkpoints folder", folder.parent
    else:
        return None
    fix = f"resume with --run-dir {run}" if run is not None else \
        f"move it into RUN/{CHECKPOINTS}/ and resume with --run-dir RUN"
    return f"{folder} is {what}; --run-dir is the run's folder (the one holding " \
           f"{CHECKPOINTS}/): {fix}"


def sizes(flow: DataFlow) -> dict[str, int]:
    return {g.name: g.nprocs for g in flow.groups}


def launch_options(run_dir: Path) -> dict[str, Any]:
    """The options (steps, checkpoint_every, keep) the command line gave the run
    whose newest checkpoint is in `run_dir` ({}: none, or a checkpoint of before session
    25); what the flow file sets is the flow file's."""
    path = latest(run_dir)
    return dict(read_meta(path).get("launch_options", {})) if path is not None else {}


def checkpoint_overrides(run_dir: Path) -> dict[str, Any]:
    """The key=value settings of the run whose newest checkpoint is in `run_dir` ({}: none,
    or a checkpoint of before session 14)."""
    path = latest(run_dir)
    return dict(read_meta(path).get("overrides", {})) if path is not None else {}


async def save(flow: DataFlow, run_dir: Path, step: int, keep: int | None = KEEP) -> Path:
    """Checkpoint `flow` (open, its steps up to `step` finished) as step `step`."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step:06d}"
    tmp = root / f"{final.name}.tmp"
    inputs = positions(flow)  # first: an input whose position cannot be saved fails the
    # save before any group wrote
    # deletes and fsyncs (maybe gigabytes, on NFS) off the loop: heartbeats go on meanwhile
    with writing(flow, run_dir, step):
        if not root.is_dir():  # (0o775: under umask 0, one every user could write, which
            root.mkdir(PRIVATE_DIR, parents=True)  # --resume would refuse)
            await asyncio.to_thread(sync_dir, root.parent)  # the first checkpoint's folder
            # survives a power cut
        for notice in await asyncio.to_thread(_remove_stale, root, tmp):
            say(flow._ctl, notice)
        tmp.mkdir(PRIVATE_DIR)
    # every save ends before one's failure is raised: a live group's (a long FSDP save)
    # must not still write when a resave respawns the dead ones and makes the save again
    await _on_every_group([_handle(g) for g in flow.groups], "save_checkpoint", tmp)
    with writing(flow, run_dir, step):  # for nodes that draw random numbers:
        torch.save(rng_state(), tmp / "controller_rng.pt")
        await asyncio.to_thread(_unshared, tmp)  # (before the sync: the modes on disk too)
        # (the ranks synced what they wrote: here, the folders and the rest; off the loop)
        await asyncio.to_thread(sync_tree, tmp)
        meta = {"step": step, "flow": identity(flow), "inputs": inputs, "sizes": sizes(flow),
                "overrides": json.loads(os.environ.get(OVERRIDES_ENV, "{}")),
                # how the command line said to checkpoint, which a resume goes on with
                "launch_options": flow.launch_options,
                "restarts": dict(flow.recovery.restarts),  # the run's budget, resumes too
                "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        # last: marks it complete
        await asyncio.to_thread(_write_synced, tmp / "meta.json", json.dumps(meta, indent=1))
        # one thread call: a cancel (Ctrl-C) between them would lose the superseded
        # checkpoint and never install the new one
        await asyncio.to_thread(_install, tmp, final)
    if keep is not None:
        try:
            for old in complete(run_dir)[:-keep]:
                await asyncio.to_thread(_discard, old)
        except OSError as e:  # the new checkpoint is complete: the run goes on, and the
            # next save prunes again (a renamed-away one is removed as stale then)
            say(flow._ctl, f"asyncrl: could not remove an old checkpoint ({e}); the next "
                           f"checkpoint tries again")
    return final


@contextlib.contextmanager
def writing(flow: DataFlow, run_dir: Path, step: int) -> Iterator[None]:
    """The controller's own writes of checkpoint `step`: one that fails (a full disk: an
    OSError, torch.save's RuntimeError) is a CheckpointError saying what to do (the groups'
    errors are their own: a dead group's is recovered from)."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if isinstance(e, AsyncRLError):  # (a TransferTimeout is an OSError too)
            raise
        newest = latest(run_dir)
        flow_file = flow.launch_options.get("flow_file", "FLOW")  # (its real path: any cwd)
        then = (f"then continue from {newest.name}, its newest complete checkpoint: `asyncrl "
                f"launch {flow_file} --resume --run-dir {run_dir}`" if newest is not None else
                f"then launch again in another --run-dir ({run_dir} holds no complete "
                f"checkpoint to resume from)")
        raise CheckpointError(
            f"the checkpoint of step {step} could not be written into {run_dir}/{CHECKPOINTS} "
            f"({type(e).__name__}: {e}); free space on its file system (or lift what refused "
            f"the write: a quota, a file size limit), {then}") from e


def positions(flow: DataFlow) -> dict[str, Any]:
    """The flow's inputs' positions as meta.json gives them back, each checked to come back
    unchanged: what a rewind from the origin loads, a resume loads too."""
    return {name: _as_saved(name, state) for name, state in flow.positions().items()}


def _as_saved(name: str, state: Any) -> Any:
    """Input `name`'s `state` through JSON; CheckpointError where JSON cannot hold it, or
    would give back another value (int keys as strings, tuples as lists: a source loading
    {"0": 3} for {0: 3} restarts its shards at 0, silently). Not by comparing the value
    that comes back: NaN (a "best" score not yet set) is unequal to itself."""
    try:
        kept = json.loads(json.dumps(state))
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"input {name!r}: its state_dict() cannot go into a checkpoint's meta.json "
            f"({e}); return plain numbers, strings, lists and dicts (a tensor as "
            f".tolist())") from e
    changed = _changed_by_json(state, "state_dict()")
    if changed is not None:
        raise CheckpointError(
            f"input {name!r}: its state_dict() comes back from a checkpoint's meta.json "
            f"changed ({_shown(state)} as {_shown(kept)}): JSON keeps dict keys as strings "
            f"and tuples as lists ({changed}); return string keys and lists (and convert "
            f"them back in load_state_dict)")
    return kept


def _changed_by_json(value: Any, where: str) -> str | None:
    """Where in `value` (JSON-able) JSON would give back something else, and what; None:
    nowhere."""
    if isinstance(value, tuple):
        return f"{where} is a tuple"
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has the key {key!r}"
            found = _changed_by_json(item, f"{where}[{key!r}]")
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _changed_by_json(item, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:117]}..."


def _install(tmp: Path, final: Path) -> None:
    sync_dir(tmp)  # meta.json's name, written after sync_tree: on disk before the rename
    if final.exists():  # superseded: a run resumed from an older checkpoint passed it again;
        _discard(final)  # renamed away first: a half-deleted one is never taken as complete
    os.replace(tmp, final)
    sync_dir(final.parent)


def _remove_stale(root: Path, tmp: Path) -> list[str]:
    """Remove what saves or removals that died half-way left; what cannot go yet (a reader
    holds files open: NFS's "busy" .nfs* files) stays for the next save, the run goes on
    (the notices to say, returned). A leftover named as this save's own folder is renamed
    away first."""
    notices = []
    for stale in [*root.glob("*.tmp"), *root.glob(".*.discarded")]:
        try:
            shutil.rmtree(stale)
        except OSError as e:
            notices.append(f"asyncrl: could not remove {stale} ({e}); the next checkpoint "
                           f"tries again")
    if tmp.exists():
        _set_aside(tmp)
    return notices


def _write_synced(path: Path, text: str) -> None:
    """`path` written with `text` and fsynced; no write for others, whatever the umask."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _set_aside(path: Path) -> Path:
    """Rename `path` to a hidden name of its own (a leftover of an earlier removal, held
    busy, is not in the way), which the next save's `_remove_stale` removes if this does
    not."""
    gone = path.with_name(f".{path.name}.{time.time_ns()}.discarded")
    os.replace(path, gone)
    return gone


def _discard(path: Path) -> None:
    """Remove a checkpoint folder: renamed out of the step_* names at once, then deleted."""
    shutil.rmtree(_set_aside(path))


async def restore(flow: DataFlow, path: Path, meta: dict[str, Any],
                  rewind: bool = False) -> int:
    """Load checkpoint `path` into the open `flow` (no step run yet; `rewind`: a recovery
    within the run); the step to run next."""
    handles = [_handle(g) for g in flow.groups]
    try:
        await _on_every_group(handles, "load_checkpoint", path)
        rng = torch.load(path / "controller_rng.pt", weights_only=True)
    except (RemoteError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        # a file damaged or missing, maybe; or a death (a rewind's to recover from), which
        # a rank whose peer died reports before the supervisor declares it
        if any(h.dead is not None for h in handles) or (
                isinstance(e, RemoteError) and await flow.recovery.dead_groups(wait=True)):
            raise
        raise CheckpointError(f"loading {path} failed: {type(e).__name__}: {e}\nif its "
                              f"files are damaged, {_aside(path)}") from e
    start = int(meta["step"]) + 1
    # off the loop: an input without state_dict() is skipped item by item (a DataLoader
    # collating thousands of batches: seconds without heartbeats, and the ranks exit); no
    # step runs meanwhile. Before the RNG state is set: the skip draws from the global RNG
    # as the first run did at step 0 (a DataLoader(shuffle=True) seeded by the flow file's
    # torch.manual_seed draws its shuffle's seed at its first item: with the checkpoint's
    # state, another order, and the resume was refused)
    await asyncio.to_thread(flow.resume_at, start, meta.get("inputs", {}), rewind)
    try:  # then as at the checkpoint, for the steps to come
        set_rng_state(rng)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"loading {path} failed: controller_rng.pt: "
                              f"{type(e).__name__}: {e}\nif its files are damaged, "
                              f"{_aside(path)}") from e
    return start


async def _on_every_group(handles: list[Any], method: str, path: Path) -> None:
    """`method(path)` on every group, each to its end before a failure is raised (a dead
    group's call raises as it is made: the live groups' saves or loads went on past it, as
    a resave or rewind respawned the dead one and began again); a death first: it explains
    the others, and a resave or rewind recovers from it."""
    async def one(handle: Any) -> Any:
        return await getattr(handle, method)(str(path))
    ended = await asyncio.gather(*(one(h) for h in handles), return_exceptions=True)
    errors = [e for e in ended if isinstance(e, BaseException)]
    if errors:
        raise next((e for e in errors if isinstance(e, GroupDeadError)), errors[0])


def _handle(group: Any) -> Any:
    if group.handle is None:
        raise RuntimeError(f"group {group.name!r} is not running: open the flow first")
    return group.handle
