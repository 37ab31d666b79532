"""Shared by the tests (importable on ranks too: test files are loaded there by path)."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any

import asyncrl
from asyncrl.actors.procs import kill_pids
from asyncrl.controller.launcher import pid_alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class NoLogFolder(asyncrl.Controller):
    """Its agents (one, or one per host of a cluster) cannot open their log files: a start
    that fails before any process runs. Set `blocker` to a file, where the folder would be."""

    blocker = "/dev/null"

    def _make_agent(self, name, nprocs, extra):
        agent = super()._make_agent(name, nprocs, extra)
        for a in getattr(agent, "agents", [agent]):
            a.log_path = Path(self.blocker) / f"{name}.log"
        return agent


def run(coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
    """Run a test coroutine with a bound: a hang fails the test instead of the suite."""
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll a condition with a bound (for process exits, which have no event to await)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def poll_until(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    """`wait_until` for code on the controller's loop: polls without blocking it (the loop
    receives what the condition waits for, e.g. drop counters or streamed log lines)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():  # noqa: ASYNC110 - these conditions have no event: a bounded poll
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m asyncrl ARGS` from the repository root, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "asyncrl", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def launch_example(example: str, run_dir: Path, steps: int, *overrides: str) -> list[dict]:
    """`asyncrl launch examples/<example>` for `steps` steps in all (its data sized for at
    least 3 steps, the same whether a run is stopped early or resumed); the metrics rows."""
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl", "launch", f"examples/{example}", "--steps",
         str(steps), "--run-dir", str(run_dir), f"steps={max(steps, 3)}", *overrides],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"run_dir: {run_dir}" in out.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    return rows


def assert_gone(pids: Iterable[int], timeout: float = 15) -> None:
    pids = list(pids)
    assert pids, "no pids to check"
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout,
               f"processes {[p for p in pids if pid_alive(p)]} to exit")


def kill_left(pid_file: Path, mark: str) -> None:
    """SIGKILL the process whose pid `pid_file` holds (one a failing test left running), if
    it is still that one: `mark` ("NAME=value", naming the test's own tmp_path) is in its
    environment, which a later process given the same pid lacks. No file or no such
    process (the test passed): nothing."""
    try:
        pid = int(pid_file.read_text())
        with open(f"/proc/{pid}/environ", "rb") as f:  # (a zombie's reads empty)
            ours = mark.encode() in f.read().split(b"\0")
    except (OSError, ValueError):  # (no file, one half written; the process gone)
        return
    if ours and pid_alive(pid):
        kill_pids([pid])


def group_pids(group: asyncrl.GroupHandle) -> list[int]:
    """The torchrun agent and every rank of a group."""
    assert group.agent.pid is not None
    return [group.agent.pid, *group.pids.values()]


class BackgroundController:
    """A Controller running on its own thread's loop, driven from sync test code: the way
    sync programs use asyncrl (calls from another thread, ``fut.result(timeout)``)."""

    def __init__(self, **kwargs: Any):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ctl = asyncrl.Controller(**kwargs)
        self.run(self.ctl.start())

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, *args: Any, **kwargs: Any) -> asyncrl.GroupHandle:
        return self.run(self.ctl.spawn(*args, **kwargs))

    def close(self) -> None:
        try:
            self.run(self.ctl.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one scalar as TensorBoard shows it (purged steps hidden)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return sorted((e.step, e.value) for e in acc.Scalars(tag))


def wandb_history(run_dir: Path) -> tuple[list[tuple[int, dict[str, Any]]], dict[str, Any],
                                           set[str]]:
    """What offline wandb wrote under run_dir/wandb, oldest run first: (step, row) of each
    history record, the config, and the run ids. The .wandb files are leveldb logs of
    protobuf Records (32 KiB blocks, a 7-byte header per chunk, after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    history: list[tuple[int, dict[str, Any]]] = []
    config: dict[str, Any] = {}
    ids: set[str] = set()
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, chunks = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            left = (1 << 15) - pos % (1 << 15)
            if left < 7:  # a block's tail too short for a header: padding
                pos += left
                continue
            _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunks += data[pos + 7:pos + 7 + size]
            pos += 7 + size
            if kind not in (1, 4):  # not FULL nor LAST: the record goes on
                continue
            record, chunks = pb.Record.FromString(chunks), b""
            which = record.WhichOneof("record_type")
            if which == "history":
                row = {_key(item): json.loads(item.value_json) for item in record.history.item}
                history.append((record.history.step.num, row))
            elif which == "config":
                config.update({_key(item): json.loads(item.value_json)
                               for item in record.config.update})
            elif which == "run":  # (with the config wandb.init was given)
                ids.add(record.run.run_id)
                config.update({_key(item): json.loads(item.value_json)
                               for item in record.run.config.update})
    return history, config, ids


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)  # ("train/loss" comes as a nested key)


# a word-level vocabulary of 128 (the tiny presets' size): specials, chat roles, a final
# answer's mark and digits, w0..w110
WORDS = ["<pad>", "<s>", "</s>", "user", "assistant", "system", "####", *"0123456789",
         *(f"w{i}" for i in range(111))]
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> "
                 "{% endfor %}{% if add_generation_prompt %}<s> assistant {% endif %}")


def word_tokenizer(folder: Path, chat: bool = True) -> Path:
    """A Hugging Face tokenizer saved in `folder` (whitespace-split words of WORDS, with a
    chat template unless not `chat`), as a model directory holds one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder


# a flow file of one node and no groups: what the CLI does before a flow runs
NO_GROUPS_FLOW = ("import asyncrl\n\n\n@asyncrl.node\ndef echo(x):\n    return x\n\n\n"
                  "flow = asyncrl.DataFlow(nodes=[echo], inputs={'x': [1]})\n")
