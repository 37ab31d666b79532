"""The `asyncrl` command: parse, build, run, close.

    asyncrl launch FILE [--steps N] [--run-dir DIR] [--save-inputs] [key=value ...]
                        [--checkpoint-every N] [--keep-checkpoints K] [--resume] [--encrypt]
                        [--heartbeat-interval S] [--heartbeat-timeout S]
                        [--transfer-timeout S] [--collective-timeout S]
                        [--startup-timeout S] [--construct-timeout S] [--transport T]
                        [--relay | --no-relay] [--hosts FILE] [--controller-address A]
                        [--wandb PROJECT | --no-wandb]
                                          run FILE's `flow` (a DataFlow), or its `main()`
    asyncrl run FILE --node NAME --inputs FILE     run one node alone with saved inputs
    asyncrl timeline RUN_DIR [--out PNG]           draw RUN_DIR/timeline.json as a PNG
    asyncrl export RUN_DIR OUT [--group G] [--dtype D]   the trained policy as a HF model
    asyncrl logs RUN_DIR --group G [--rank R] [--tail N]   one rank's output
    asyncrl attach [RUN_DIR] [--group G] [--rank R] [--thread T] [--list]
                                                         pdb on a rank in breakpoint()
    asyncrl bench FILE [--steps N] [--run-dir DIR] [key=value ...] (and launch's
                       --hosts, --controller-address and Controller settings)
                                          run FILE's flow and say where the time went
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from asyncrl.cli_cluster import launch_cluster
from asyncrl.cli_export import export
from asyncrl.cli_resume import RUNS, run_to_resume
from asyncrl.compat import format_exception
from asyncrl.controller.logs import visible
from asyncrl.controller.nodes import NodeError
from asyncrl.controller.runner import Terminated, run
from asyncrl.controller.trackers import TrackerError
from asyncrl.errors import AsyncRLError, CheckpointError
from asyncrl.flow_file import flow_of, key_values, load_flow


def launch(args: argparse.Namespace) -> int:
    from asyncrl.controller.checkpoint import KEEP
    from asyncrl.controller.launch import default_run_dir, launch_flow

    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise SystemExit(f"asyncrl launch: --checkpoint-every must be >= 1, got "
                         f"{args.checkpoint_every}")
    if args.keep_checkpoints is not None and args.keep_checkpoints < 0:
        raise SystemExit(f"asyncrl launch: --keep-checkpoints must be >= 0 (0 keeps all), "
                         f"got {args.keep_checkpoints}")
    for option, value in (("--wandb", args.wandb), ("--run-dir", args.run_dir)):
        if value and re.match(r"[A-Za-z_][\w.]*=", value):  # (the shell's next word)
            raise SystemExit(f"asyncrl launch: {option} {value}: that is a key=value "
                             f"override, taken as {option}'s value; give {option} its own "
                             f"value first (or ./{value} for a folder of that name)")
    if args.resume and not args.run_dir:  # the newest run of this flow file under runs/
        args.run_dir = str(run_to_resume(args.script))
    settings = _settings(args)  # (checked before the flow's file is imported)
    sys.argv = [args.script, *[a for a in args.args if "=" not in a], *args.passed]  # (k=v:
    overrides = now = key_values("launch", args.args)  # settings, never main()'s arguments)
    if args.resume:  # the run's own settings, under those given now (steps=... to go on)
        from asyncrl.controller.launch import resumed_overrides

        try:  # (once the checkpoint is known to be this user's)
            saved = resumed_overrides(Path(args.run_dir))
        except CheckpointError as e:
            raise SystemExit(f"asyncrl launch: {e}") from None
        if saved:
            print(f"asyncrl launch: resuming with the run's settings "
                  f"{json.dumps(saved)}, under those given now", file=sys.stderr)
        overrides = {**saved, **overrides}
    module = load_flow(args.script, overrides, {k: v for k, v in saved.items() if k not in now}
                   if args.resume else None)
    flow = flow_of(module, args.script)
    if flow is None:
        main = getattr(module, "main", None)
        if main is None:
            raise SystemExit(f"asyncrl launch: {args.script} defines no `flow` and no main(); "
                             f"declare `flow = asyncrl.DataFlow(...)` or write `async def "
                             f"main():` that opens `async with asyncrl.Controller()`")
        _refuse_flow_options(args)
        result = main()  # a coroutine from an async def, or from a wrapper of one too
        result = run(result) if inspect.iscoroutine(result) else result
        return int(result) if isinstance(result, int) and not isinstance(result, bool) else 0
    stray = [a for a in args.args if "=" not in a] + args.passed  # a flow takes key=value
    if stray:                                                     # overrides only
        raise SystemExit(f"asyncrl launch: unrecognized arguments: {' '.join(stray)}; "
                         f"{args.script} defines a flow, which takes key=value overrides "
                         f"after the options, and no '--' (see `asyncrl launch --help`)")
    cluster, host = launch_cluster(args)  # (refused before a run directory is made)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    print(f"run_dir: {run_dir}", flush=True)
    given = {k: v for k, v in (("steps", args.steps), ("checkpoint_every", args.checkpoint_every),
                               ("keep", args.keep_checkpoints)) if v is not None}
    if args.resume:  # the options the run was launched with (where it was to stop too: a
        # resume without --steps ran on until an input ran out), unless given others now
        from asyncrl.controller.checkpoint import launch_options

        saved_options = launch_options(run_dir)
        saved_options.pop("flow_file", None)  # (this launch's own is noted below)
        began = saved_options.pop("flow_steps", flow.steps)  # the flow's own steps then
        # the flow's steps changed since (steps=... given now, or the file): asked for now,
        # over the run's --steps
        if "steps" in saved_options and "steps" not in given and flow.steps != began:
            print(f"asyncrl launch: the flow's steps are {flow.steps} now ({began} when the "
                  f"run began): they replace the run's --steps {saved_options.pop('steps')}",
                  file=sys.stderr)
        taken = {k: v for k, v in saved_options.items() if k not in given}
        if taken:
            print(f"asyncrl launch: resuming with the run's "
                  f"{', '.join(f'--{OPTION_NAMES[k]} {v}' for k, v in taken.items())}",
                  file=sys.stderr)
        given = {**taken, **given}
    flow.launch_options = {**given, "flow_steps": flow.steps,  # noted in its checkpoints;
                           "flow_file": os.path.realpath(args.script)}  # (found by --resume)
    if "checkpoint_every" in given:
        flow.checkpoint_every = given["checkpoint_every"]
    keep = given.get("keep", KEEP) or None  # 0: all
    return _run_flow("launch", run_dir, launch_flow(
        flow, given.get("steps"), run_dir, args.save_inputs, resume=args.resume, keep=keep,
        cluster=cluster, host=host, controller=settings, wandb=_wandb(args, run_dir)))


OPTION_NAMES = {"steps": "steps", "checkpoint_every": "checkpoint-every",
                "keep": "keep-checkpoints"}


def _wandb(args: argparse.Namespace, run_dir: Path) -> str | None:
    """The wandb project of the run: --wandb, or on --resume the one the run logged to."""
    from asyncrl.controller.trackers import require_wandb, wandb_project_of

    project = args.wandb or (wandb_project_of(run_dir) if args.resume else None)
    if project is not None and not args.no_wandb:
        try:
            require_wandb()
        except TrackerError as e:  # (on --resume, not asked for: the run's wandb.json)
            raise SystemExit(f"asyncrl launch: {e}" if args.wandb else f"asyncrl launch: the "
                             f"run logged to wandb project {project!r}: install wandb (pip "
                             f"install 'asyncrl[wandb]'), or pass --no-wandb to resume "
                             f"without it") from None
    if project is not None and not args.wandb:  # the run's (--no-wandb: its id stays in the
        print("asyncrl launch: " + (f"not logging to wandb project {project!r} (--no-wandb)"
              if args.no_wandb else f"logging to wandb project {project!r} as the run did"),
              file=sys.stderr)  # run directory, for a later resume)
    return None if args.no_wandb else project


def _run_flow(command: str, run_dir: Path, running: Any) -> int:
    """Run a flow to its end: 0, or the exit code after saying what failed."""
    try:
        run(running)
    except (KeyboardInterrupt, Terminated):
        from asyncrl.controller.checkpoint import latest, refuse_existing

        try:  # metrics of finished steps and no checkpoint: a dead end, unless said
            if command == "launch" and latest(run_dir) is None:
                refuse_existing(run_dir)
        except CheckpointError:
            print(f"asyncrl: stopped before its first checkpoint, so {run_dir} cannot be "
                  f"resumed: launch again in another --run-dir, or remove it (--checkpoint-"
                  f"every N saves along the way)", file=sys.stderr)
        raise
    except (CheckpointError, TrackerError) as e:
        print(visible(f"asyncrl {command}: {e}"), file=sys.stderr)
        return 2
    except AsyncRLError as e:  # a failed node (NodeError: step, group, a rank's traceback);
        # a group that could not start, be placed, or died outside a node; recoveries used up
        node = isinstance(e, NodeError)
        cause = e.__cause__ if node else None  # a bug in the node's own code: its line
        where = "" if cause is None or isinstance(cause, AsyncRLError) else format_exception(
            cause)  # (its notes in it)
        said = f"asyncrl: {e}\n{where}" if node else f"asyncrl {command}: {type(e).__name__}: {e}"
        said = f"{said}{_notes(None if where else cause, e)}".rstrip()
        # escaped, as the console escapes the ranks' lines: a rank's error, its log's tail
        print(visible(said) + f"\nrun_dir: {run_dir} (logs/ has every group's output)",
              file=sys.stderr)
        return 1
    return 0


def _notes(*errors: BaseException | None) -> str:
    """The notes on `errors`, once each: 4 of the ranks that raised too, then the others."""
    notes = list(dict.fromkeys(n for e in errors for n in getattr(e, "__notes__", [])))
    ranks = [n for n in notes if " raised too: " in n]
    more = [f"... and {len(ranks) - 4} more ranks"] if len(ranks) > 4 else []
    return "".join(f"\n{n}" for n in ranks[:4] + more + [n for n in notes if n not in ranks])


# launch's options that set up a flow's run or its Controller: a driver's main() makes its
# own Controller, so each would be ignored there; what to do instead
_FLOW_OPTIONS = {
    "steps": "run as many steps as main() asks for",
    "run_dir": "pass asyncrl.Controller(run_dir=...)",
    "hosts": "pass asyncrl.Controller(cluster=Cluster.from_file(...)), from "
             "asyncrl.controller.cluster",
    "controller_address": "pass asyncrl.Controller(host=...)",
    "save_inputs": "save what main() needs itself",
    "checkpoint_every": "save its state in main()",
    "keep_checkpoints": "keep what main() saves itself",
    "resume": "resume in main()",
    "encrypt": "pass asyncrl.Controller(encrypt=True)",
    "wandb": "call wandb.init and wandb.log in main()",
    "no_wandb": "leave wandb out of main()",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _refuse_flow_options(args: argparse.Namespace) -> None:
    """A driver's main() makes its own Controller: refuse what would be silently ignored."""
    given = [name for name in _FLOW_OPTIONS  # (0 is given: --keep-checkpoints 0)
             if getattr(args, name) is not None and getattr(args, name) is not False]
    given += [name for name in _settings(args) if name != "encrypt"]
    if given:
        flags = ", ".join(_flag(name) for name in given)
        hints = "; ".join(f"{_flag(name)}: " + _FLOW_OPTIONS.get(
            name, f"pass asyncrl.Controller({name}=...)") for name in given)
        raise SystemExit(f"asyncrl launch: {flags} set up a DataFlow's run; {args.script} "
                         f"defines main(), which makes its own Controller ({hints}). "
                         f"Arguments for main() go after '--'")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The Controller settings given on the command line (its defaults for the others)."""
    names = ("heartbeat_interval", "heartbeat_timeout", "transfer_timeout",
             "collective_timeout", "startup_timeout", "construct_timeout", "transport", "relay")
    settings: dict[str, Any] = {n: getattr(args, n) for n in names
                                if getattr(args, n) is not None}
    if args.encrypt:
        settings["encrypt"] = True
    from asyncrl.controller.controller import Controller, check_heartbeats

    given = {**{n: p.default for n, p in inspect.signature(Controller).parameters.items()},
             **settings}
    try:  # (before anything starts)
        check_heartbeats(given["heartbeat_interval"], given["heartbeat_timeout"])
    except ValueError as e:
        raise SystemExit(f"asyncrl: {e}; see --heartbeat-timeout, --heartbeat-interval") \
            from None
    return settings


def _seconds(text: str) -> float:
    """A command line's number of seconds: > 0 and finite."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise ValueError(text)
    return value


_seconds.__name__ = "number of seconds > 0"  # (argparse says "invalid <name> value")


def run_node(args: argparse.Namespace) -> int:
    from asyncrl.controller.launch import load_inputs, run_one_node, saved_overrides

    stray = [a for a in args.args if "=" not in a] + args.passed
    if stray:
        raise SystemExit(f"asyncrl run: unrecognized arguments: {' '.join(stray)}; after the "
                         f"options it takes key=value overrides only")
    inputs = Path(args.inputs)
    if not inputs.is_file():
        raise SystemExit(f"asyncrl run: --inputs {inputs} is not a file; pass one that "
                         f"`asyncrl launch FLOW --save-inputs` wrote: "
                         f"RUN_DIR/inputs/step<t>/{args.node}.msgpack")
    # the groups are built as in the run that saved the inputs, unless told otherwise
    given = key_values("run", args.args)
    try:  # (checked to be this user's, before they reach the flow file's import)
        overrides = {**saved_overrides(inputs), **given}
    except CheckpointError as e:
        raise SystemExit(f"asyncrl run: {e}") from None
    if overrides:
        print(f"asyncrl run: overrides {json.dumps(overrides)}", file=sys.stderr)
    module = load_flow(args.script, overrides,  # (those saved alone: dropped if not declared)
                       {k: v for k, v in overrides.items() if k not in given})
    flow = flow_of(module, args.script)
    if flow is None:
        raise SystemExit(f"asyncrl run: {args.script} defines no `flow`")
    try:  # damaged inputs, a mistyped node (a FlowError): before its groups load models
        saved, futures = load_inputs(inputs)
        flow.node_inputs(args.node, saved)
    except ValueError as e:
        raise SystemExit(f"asyncrl run: {e}") from None
    value = run(run_one_node(flow, args.node, saved, futures))
    print(repr(value))
    return 0


def timeline(args: argparse.Namespace) -> int:
    from asyncrl.controller.timeline import SPANS_FILE, build_trace, draw

    trace = Path(args.run_dir) / "timeline.json"
    if (Path(args.run_dir) / SPANS_FILE).is_file():  # rebuilt: a run killed as it wrote
        try:  # a checkpoint's spans has them in timeline.jsonl, not yet in timeline.json
            build_trace(Path(args.run_dir))
        except OSError as e:  # (a run directory this user cannot write: its trace as it is)
            print(f"asyncrl timeline: cannot rebuild {trace} ({e}); drawing it as it is",
                  file=sys.stderr)
    if not trace.is_file():
        raise SystemExit(f"asyncrl timeline: {trace} does not exist; it is written by "
                         f"`asyncrl launch FLOW --run-dir {args.run_dir}`")
    png = Path(args.out) if args.out else Path(args.run_dir) / "timeline.png"
    try:
        print(draw(trace, png))
    except (ImportError, ValueError) as e:
        raise SystemExit(f"asyncrl timeline: {e}") from None
    except OSError as e:  # (a run directory this user cannot write: another user's run)
        raise SystemExit(f"asyncrl timeline: drawing {trace} into {png} failed ({e}); give "
                         f"--out FILE.png, a file you can write") from None
    return 0


def attach(args: argparse.Namespace) -> int:
    from asyncrl.controller.attach import attach as bridge
    from asyncrl.controller.attach import choose, connect, describe, newest_waiting, waiting

    if args.run_dir is None:
        if (found := newest_waiting(RUNS)) is None:
            raise SystemExit(f"asyncrl attach: no run under {RUNS}/ has a rank waiting in "
                             f"breakpoint(); give RUN_DIR, the folder `asyncrl launch` "
                             f"printed as run_dir:")
        print(f"asyncrl attach: {found}, the newest run under {RUNS}/ with a rank waiting",
              file=sys.stderr)
        args.run_dir = str(found)
    if not Path(args.run_dir).is_dir():
        raise SystemExit(f"asyncrl attach: no run directory {args.run_dir} (the folder "
                         f"`asyncrl launch` printed as run_dir:)")
    sessions = waiting(Path(args.run_dir))
    if args.list:
        for s in sessions:
            print(describe(s))
        if not sessions:
            print(f"no rank waits for a debugger in {args.run_dir}")
        return 0
    try:
        session = choose(sessions, args.group, args.rank, args.thread,
                         ask=input if sys.stdin.isatty() else None)  # a terminal: asked
    except LookupError as e:
        raise SystemExit(f"asyncrl attach: {e}") from None
    try:  # (once connected, a reset is the session's end: the rank continued)
        sock = connect(session)
    except OSError as e:
        raise SystemExit(f"asyncrl attach: {session['group']}:{session['rank']} no longer "
                         f"waits at {session['where']} ({e}); `asyncrl attach {args.run_dir} "
                         f"--list` shows the ranks that do") from None
    bridge(session, sock=sock)
    return 0


def logs(args: argparse.Namespace) -> int:
    from asyncrl.controller.logs import read_log, visible

    if args.tail is not None and args.tail < 0:
        raise SystemExit(f"asyncrl logs: --tail takes a number of lines >= 0, got {args.tail}")
    try:
        lines = read_log(Path(args.run_dir), args.group, args.rank, args.tail)
    except FileNotFoundError as e:
        raise SystemExit(f"asyncrl logs: {e}") from None
    shown = visible if sys.stdout.isatty() else str  # a terminal would obey a rank's escapes
    try:
        sys.stdout.writelines(f"{shown(line)}\n" for line in lines)
        sys.stdout.flush()
    except BrokenPipeError:  # its reader had enough (`| head`): not an error; and the
        # interpreter's own flush at exit must not meet the closed pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def bench(args: argparse.Namespace) -> int:
    from asyncrl.controller.bench import analyse, report
    from asyncrl.controller.launch import default_run_dir, launch_flow
    from asyncrl.controller.timeline import draw

    if args.warmup < 0 or (args.steps is not None and args.warmup >= args.steps):
        raise SystemExit(f"asyncrl bench: --warmup {args.warmup} leaves no step to measure; "
                         f"give 0 <= N" + ("" if args.steps is None else
                                           f" < --steps ({args.steps})"))
    stray = [a for a in args.args if "=" not in a] + args.passed
    if stray:
        raise SystemExit(f"asyncrl bench: unrecognized arguments: {' '.join(stray)}; a flow "
                         f"takes key=value overrides after the options (`asyncrl bench --help`)")
    settings = _settings(args)  # (checked before the flow's file is imported)
    module = load_flow(args.script, key_values("bench", args.args))
    flow = flow_of(module, args.script)
    if flow is None:
        raise SystemExit(f"asyncrl bench: {args.script} defines no `flow` (a DataFlow)")
    if args.steps is None and flow.steps is not None and args.warmup >= flow.steps:
        raise SystemExit(f"asyncrl bench: --warmup {args.warmup} leaves none of the flow's "
                         f"{flow.steps} steps to measure; give a smaller --warmup")
    cluster, host = launch_cluster(args, "bench")  # (refused before a run dir is made)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    print(f"run_dir: {run_dir}", flush=True)
    # no checkpoint: its saves would count in the figures, and `launch --resume` (which
    # looks for runs with one) took the bench for the flow's training run
    failed = _run_flow("bench", run_dir, launch_flow(
        flow, args.steps, run_dir, checkpoints=False, cluster=cluster, host=host,
        controller=settings))
    if failed:
        return failed
    deps = {name: [src[1] for src in d.values() if src is not None and src[0] == "node"]
            for name, d in flow.deps.items()}
    try:
        figures = analyse(run_dir, deps, warmup=args.warmup)
    except ValueError as e:  # e.g. --warmup as long as the run
        raise SystemExit(f"asyncrl bench: {e}") from None
    (run_dir / "bench.json").write_text(json.dumps(figures, indent=1))
    print(report(figures))
    try:
        print(f"timeline: {draw(run_dir / 'timeline.json', run_dir / 'timeline.png')}")
    except ImportError as e:  # the figures are written: the picture is optional
        print(f"timeline: not drawn: {e}", file=sys.stderr)
    return 0


def _cluster_flags(p: argparse.ArgumentParser) -> None:
    """Where a flow's groups run (read back by `launch_cluster`)."""
    p.add_argument("--hosts", default=None, metavar="FILE",
                   help="spread groups over the hosts of FILE (JSON: {\"hosts\": [{\"name\", "
                        "\"address\", \"gpus\", \"cpus\", \"via\": ssh|srun|local|netns}]}); "
                        "inside a SLURM allocation its nodes are used without it")
    p.add_argument("--controller-address", default=None,
                   help="the address ranks on other hosts reach the controller at (default: "
                        "this machine's)")


def _controller_flags(p: argparse.ArgumentParser) -> None:
    """The Controller settings a command line may give (read back by `_settings`)."""
    from asyncrl.controller.controller import RELAY_MIN_RANKS

    p.add_argument("--heartbeat-interval", type=_seconds, default=None, metavar="S",
                   help="seconds between heartbeats, both ways (default 0.5)")
    p.add_argument("--heartbeat-timeout", type=_seconds, default=None, metavar="S",
                   help="a rank silent this long is hung; ranks exit when the controller "
                   "is silent this long and its process is gone (default 3)")
    p.add_argument("--transfer-timeout", type=_seconds, default=None, metavar="S",
                   help="how long a rank waits for a peer's data (default 60)")
    p.add_argument("--collective-timeout", type=_seconds, default=None, metavar="S",
                   help="how long a collective inside a group waits for a peer (default 600)")
    p.add_argument("--startup-timeout", type=_seconds, default=None, metavar="S",
                   help="from torchrun's start until every rank said hello (default 120)")
    p.add_argument("--construct-timeout", type=_seconds, default=None, metavar="S",
                   help="until every worker's __init__ returned (default 600)")
    p.add_argument("--transport", choices=("auto", "tcp", "nccl"), default=None,
                   help="how ranks move data: auto (shared memory on one host, TCP between "
                   "hosts; CUDA IPC or NCCL for GPU rows), or force tcp or nccl")
    p.add_argument("--relay", action=argparse.BooleanOptionalAction, default=None,
                   help="send a group's control messages through one relay per host "
                   f"(default: for groups of {RELAY_MIN_RANKS} ranks or more)")
    p.add_argument("--encrypt", action="store_true",
                   help="encrypt every control and data-plane socket with CurveZMQ (for "
                   "untrusted networks; frames are HMAC-signed either way)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl", description=(
        "asyncrl: RL post-training on an asyncio single controller with torchrun worker "
        "groups, no Ray."))
    sub = p.add_subparsers(dest="command", required=True)
    lp = sub.add_parser("launch", help="run a flow file's DataFlow, or a driver's main()",
                        description="Run SCRIPT's `flow` (a DataFlow) or its `main()` (an "
                                    "`async def` runs on uvloop). key=value arguments "
                                    "override the flow's asyncrl.config(...) settings.")
    lp.add_argument("script", help="a Python file defining `flow` or main()")
    lp.add_argument("--steps", type=int, default=None, help="run up to this step count, "
                    "counted from the run's start also when resumed (default: the flow's "
                    "steps=, else until an input is exhausted)")
    lp.add_argument("--run-dir", default=None, help="where logs, metrics.jsonl and "
                    "timeline.json go (default: runs/<time>)")
    _cluster_flags(lp)
    lp.add_argument("--save-inputs", action="store_true",
                    help="save every node's inputs, for `asyncrl run --node`")
    lp.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                    help="checkpoint into RUN_DIR/checkpoints every N steps (a run always "
                    "checkpoints after its last step)")
    lp.add_argument("--keep-checkpoints", type=int, default=None, metavar="K",
                    help="keep the newest K checkpoints (default 3; 0 keeps all)")
    lp.add_argument("--resume", action="store_true",
                    help="continue the run in --run-dir (default: the newest run under runs/ "
                    "with a checkpoint of this flow file) from its newest complete checkpoint")
    tracking = lp.add_mutually_exclusive_group()
    tracking.add_argument("--wandb", default=None, metavar="PROJECT",
                          help="log the metrics to this Weights & Biases project too (pip "
                          "install 'asyncrl[wandb]'; WANDB_MODE=offline keeps the run on disk)")
    tracking.add_argument("--no-wandb", action="store_true",
                          help="with --resume: do not log to the wandb run the run logged to "
                          "(this time only: a later --resume without it logs there again)")
    _controller_flags(lp)
    lp.add_argument("args", nargs="*", help="key=value overrides, or arguments passed on "
                    "to a driver's main() (after --)")
    lp.set_defaults(func=launch)
    rp = sub.add_parser("run", help="run one node of a flow alone with saved inputs",
                        description="Spawn the flow's groups and run one node with inputs "
                                    "saved by `asyncrl launch --save-inputs`.")
    rp.add_argument("script")
    rp.add_argument("--node", required=True)
    rp.add_argument("--inputs", required=True, help="RUN_DIR/inputs/step<t>/<node>.msgpack")
    rp.add_argument("args", nargs="*", help="key=value overrides, laid over those of the run "
                    "that saved the inputs")
    rp.set_defaults(func=run_node)
    ap = sub.add_parser("attach", help="reach a rank waiting in breakpoint() with pdb",
                        description="List the ranks of a run waiting in breakpoint() and open "
                                    "pdb on one (type c to let it continue).")
    ap.add_argument("run_dir", nargs="?", default=None, help="the run's folder (default: the "
                    "newest under runs/ where a rank waits)")
    ap.add_argument("--group", default=None)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--thread", default=None,
                    help="one of the rank's threads stopped in breakpoint() (see --list); "
                         "default: the one waiting longest")
    ap.add_argument("--list", action="store_true", help="only list the waiting ranks")
    ap.set_defaults(func=attach)
    gp = sub.add_parser("logs", help="print one rank's output from a run directory",
                        description="Print what a rank printed (stdout and stderr), kept in "
                                    "RUN_DIR/logs/<group>/rank<r>.log while the run streamed it.")
    gp.add_argument("run_dir")
    gp.add_argument("--group", required=True)
    gp.add_argument("--rank", type=int, default=0)
    gp.add_argument("--tail", type=int, default=None, help="only the last N lines")
    gp.set_defaults(func=logs)
    bp = sub.add_parser("bench", help="run a flow and report busy/idle time per node and "
                        "group, the critical path, overlap efficiency and tokens/s",
                        description="Run SCRIPT's flow, then analyse its timeline: per node "
                        "and per group busy and idle time, the critical path, overlap "
                        "efficiency and tokens/s; writes RUN_DIR/bench.json and timeline.png "
                        "(and no checkpoint: a bench is no run to resume).")
    bp.add_argument("script")
    bp.add_argument("--steps", type=int, default=None)
    bp.add_argument("--run-dir", default=None)
    bp.add_argument("--warmup", type=int, default=0, metavar="N",
                    help="leave the first N steps out of the figures (start-up, first calls)")
    _cluster_flags(bp)
    _controller_flags(bp)
    bp.add_argument("args", nargs="*", help="key=value overrides")
    bp.set_defaults(func=bench)
    ep = sub.add_parser("export", help="write a run's trained policy as a Hugging Face model",
                        description="Write the policy group of a run's newest checkpoint (or "
                        "of the checkpoints/step_* folder given) as a Hugging Face model "
                        "directory OUT: config.json, model.safetensors and the tokenizer "
                        "files of the model it started from. Runs alone: no group starts.")
    ep.add_argument("path", help="a run directory, or one of its checkpoints/step_* folders")
    ep.add_argument("out", help="the model directory to write (new, or an empty folder)")
    ep.add_argument("--group", default=None,
                    help="the policy group to export (default: the only one)")
    ep.add_argument("--dtype", default=None, help="the weights' dtype, e.g. bfloat16 (default: "
                    "the model's own)")
    ep.set_defaults(func=export)
    tp = sub.add_parser("timeline", help="draw a run's timeline as a PNG Gantt chart")
    tp.add_argument("run_dir")
    tp.add_argument("--out", default=None, help="the PNG to write (RUN_DIR/timeline.png)")
    tp.set_defaults(func=timeline)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[1:2] == ["--"]:  # `asyncrl launch -- script.py`: the end of the options
        del argv[1]
    passed: list[str] = []  # after '--': a driver's own arguments, never settings
    if "--" in argv:
        cut = argv.index("--")
        argv, passed = argv[:cut], argv[cut + 1:]
    args, extra = parser().parse_known_args(argv)
    if (extra or passed) and args.command not in ("launch", "bench", "run"):
        parser().error(f"unrecognized arguments: {' '.join(extra + passed)}")
    args.args = [*getattr(args, "args", []), *extra]  # key=value overrides after the options
    args.passed = passed
    if getattr(args, "steps", None) is not None and args.steps < 1:
        parser().error(f"--steps must be >= 1 (a step count), got {args.steps}")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("asyncrl: interrupted; every group was shut down", file=sys.stderr)
        return 130
    except Terminated:
        print("asyncrl: terminated (SIGTERM); every group was shut down", file=sys.stderr)
        return 143
