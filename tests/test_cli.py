"""The `asyncrl` command, as a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import NO_GROUPS_FLOW, cli


def test_help_from_the_module_and_the_console_script():
    out = cli("--help")
    assert out.returncode == 0 and "launch" in out.stdout
    script = subprocess.run([f"{sys.prefix}/bin/asyncrl", "launch", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "main()" in script.stdout


def test_launch_runs_the_example_driver():
    out = cli("launch", "examples/driver.py")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("spawned 2 groups")
    assert sum(line.startswith("prompt ") for line in lines) == 6
    assert "(rank 0)" in out.stdout and "(rank 1)" in out.stdout
    means = next(line for line in lines if line.startswith("mean reward"))
    a, b = means.split(": ", 1)[1].strip("[]").split(", ")
    assert a == b  # the all-reduce gave both ranks the same value


def test_launch_errors_are_clear(tmp_path):
    out = cli("launch", str(tmp_path / "missing.py"))
    assert out.returncode != 0 and "no such file" in out.stderr
    script = tmp_path / "nomain.py"
    script.write_text("x = 1\n")
    out = cli("launch", str(script))
    assert out.returncode != 0 and "defines no `flow` and no main()" in out.stderr
    out = cli("launch", "examples/driver.py", "--resume", "--run-dir", str(tmp_path))
    assert out.returncode != 0 and "--run-dir, --resume set up a DataFlow's run; " \
        "examples/driver.py defines main(), which makes its own Controller" in out.stderr
    out = cli("launch", "examples/driver.py", "--keep-checkpoints", "0")
    assert out.returncode != 0 and "--keep-checkpoints: keep what main() saves" in out.stderr
    out = cli("launch", "examples/flow.py", "--checkpoint-every", "0")
    assert out.returncode != 0 and "--checkpoint-every must be >= 1, got 0" in out.stderr


def test_launch_passes_a_driver_the_arguments_after_dash_dash_without_it(tmp_path,
                                                                          monkeypatch):
    import re

    from asyncrl.cli import main

    seen = tmp_path / "argv.json"
    driver = tmp_path / "argv_driver.py"
    driver.write_text(f"import asyncrl, json, pathlib, sys\nasyncrl.config(lr=0.1)\ndef main():\n"
                      f"    pathlib.Path({str(seen)!r}).write_text(json.dumps(sys.argv[1:]))\n")
    monkeypatch.setattr(sys, "argv", sys.argv[:])  # launch sets the driver's; after '--':
    for before, passed in ((["lr=0.5", "-f"], ["--foo", "bar"]), ([], ["--out=res.json", "k=v"])):
        assert main(["launch", str(driver), *before, "--", *passed]) == 0  # never settings;
        assert json.loads(seen.read_text()) == [*before[1:], *passed]  # a setting: not main's
    # options that set up a flow's run would be ignored by a main(): refused, with the way
    for argv, said in ((["--steps", "3"], "--steps: run as many steps as main() asks for"),
                       (["--run-dir", "r", "--transfer-timeout", "5"],
                        "--run-dir: pass asyncrl.Controller(run_dir=...); --transfer-timeout: "
                        "pass asyncrl.Controller(transfer_timeout=...)")):
        with pytest.raises(SystemExit, match=re.escape(said)):
            main(["launch", str(driver), *argv, "--", "--foo"])
    with pytest.raises(SystemExit, match="nor a setting; arguments for a driver's main"
                                         "\\(\\) go after '--'"):  # (before '--': said)
        main(["launch", str(driver), "--out=res.json"])


def test_launch_refuses_what_a_flow_cannot_take(tmp_path, monkeypatch):
    import asyncrl.cli
    from asyncrl.controller.declare import OVERRIDES_ENV

    def never(*args, **kwargs):
        raise AssertionError("the flow ran despite a mistyped option")

    flow = tmp_path / "typo_flow.py"
    flow.write_text("import asyncrl\n\ncfg = asyncrl.config(lr=0.0)\n"
                    + NO_GROUPS_FLOW)
    monkeypatch.setattr(asyncrl.cli, "run", never)
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    monkeypatch.setenv(OVERRIDES_ENV, "{}")  # launch sets the overrides for the import
    with pytest.raises(SystemExit, match=r"unrecognized arguments: --stpes 3; .*key=value"):
        asyncrl.cli.main(["launch", str(flow), "lr=0.1", "--stpes", "3"])
    # `run` takes key=value overrides too, and names what it cannot take
    with pytest.raises(SystemExit, match=r"unrecognized arguments: --stpes; .*key=value"):
        asyncrl.cli.main(["run", str(flow), "--node", "x", "--inputs", str(flow), "--stpes"])
    with pytest.raises(SystemExit, match=r"--inputs .*missing.msgpack is not a file; .*"
                                         r"RUN_DIR/inputs/step<t>/x.msgpack"):
        asyncrl.cli.main(["run", str(flow), "--node", "x", "--inputs",
                          str(tmp_path / "missing.msgpack"), "lr=0.1"])
    with pytest.raises(SystemExit, match=r"--warmup 2 leaves no step to measure; give 0 <= N "
                                         r"< --steps \(2\)"):
        asyncrl.cli.main(["bench", str(flow), "--steps", "2", "--warmup", "2"])
    with pytest.raises(SystemExit, match=r"bench: unrecognized arguments: stray; a flow takes "
                                         r"key=value"):
        asyncrl.cli.main(["bench", str(flow), "--steps", "2", "stray", "lr=0.1"])
    with pytest.raises(SystemExit) as e:  # argparse's error: the message on stderr
        asyncrl.cli.main(["launch", str(flow), "--steps", "-3"])
    assert e.value.code == 2
    # the command line's mistakes are blamed on it, not on the flow file, and before it runs
    with pytest.raises(SystemExit, match=r"launch: override '=0.1' is not key=value; write "
                                         r"overrides as key=value, with no space around"):
        asyncrl.cli.main(["launch", str(flow), "lr", "=0.1"])
    fresh = tmp_path / "typo_flow2.py"  # a file imported before is not run again
    fresh.write_text(flow.read_text())
    with pytest.raises(SystemExit, match=r"unknown setting\(s\) \['lrr'\] on the command "
                                         r"line; .* fix the key=value arguments"):
        asyncrl.cli.main(["launch", str(fresh), "lrr=0.1"])
    with pytest.raises(SystemExit, match=r"unrecognized arguments: lr=0.1; .* and no '--'"):
        asyncrl.cli.main(["launch", str(flow), "--", "lr=0.1"])


def test_run_node_builds_the_groups_with_the_saved_overrides_as_given(tmp_path, monkeypatch):
    """Saved overrides are text: they were JSON-encoded again, so backend=zero2 reached the
    flow as '"zero2"' (with the quotes) and a list as a string, refused."""
    import asyncrl.cli
    import asyncrl.controller.launch

    seen = tmp_path / "cfg.json"
    flow = tmp_path / "settings_flow.py"
    flow.write_text(f"import json, pathlib\nimport asyncrl\n\n"
                    f"cfg = asyncrl.config(backend='fsdp2', dims=[1], lr=0.1, steps=3)\n"
                    f"pathlib.Path({str(seen)!r}).write_text(json.dumps(cfg))\n"
                    f"@asyncrl.node\ndef x(p):\n    return p\n"
                    f"flow = asyncrl.DataFlow(nodes=[x], inputs={{'p': [1]}})\n")
    inputs = tmp_path / "run" / "inputs"
    (inputs / "step0").mkdir(parents=True)
    (inputs / "overrides.json").write_text(json.dumps(  # lr: as runs before session 13;
        {"backend": "zero2", "dims": "[3,4]", "lr": 0.5, "gone": "1"}))  # gone: a setting
    # the flow no longer declares (dropped, said; it was blamed on the command line)
    saved = inputs / "step0" / "x.msgpack"
    saved.write_bytes(b"")
    monkeypatch.setattr(asyncrl.controller.launch, "load_inputs",
                        lambda path: ({"p": 1}, {}))
    ran = []
    monkeypatch.setattr(asyncrl.cli, "run", lambda running: ran.append(running.close()))
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    asyncrl.cli.main(["run", str(flow), "--node", "x", "--inputs", str(saved), "steps=5"])
    assert json.loads(seen.read_text()) == {"backend": "zero2", "dims": [3, 4], "lr": 0.5,
                                            "steps": 5}
    # a mistyped node is refused before any group starts (and loads its model)
    with pytest.raises(SystemExit, match=re.escape("asyncrl run: no node named 'y'; nodes: "
                                                   "['x']; pass --node with one of them")):
        asyncrl.cli.main(["run", str(flow), "--node", "y", "--inputs", str(saved)])
    assert len(ran) == 1


def test_overrides_take_their_defaults_types_and_need_a_flow_that_reads_them(tmp_path,
                                                                             monkeypatch):
    """`use_ref=False` was the string "False" (true); `path=None` the string "None"."""
    import asyncrl.cli
    from asyncrl.controller.declare import OVERRIDES_ENV, config, parse_overrides

    def given(*pairs):
        monkeypatch.setenv(OVERRIDES_ENV, json.dumps(parse_overrides(list(pairs))))

    given("use_ref=False", "path=None", "lr=.5", "steps=1_000", "name=7", "tags=[1,2]",
          "flag=0", "coef=0.25", "rev=1.10", "dims=[2,3]", "scale=+1")
    assert config(use_ref=True, path="/m", lr=1e-3, steps=5, name="a", tags=[], flag=True,
                  coef=0, rev="1.0", dims=(1,), scale=0.5) == {
        "use_ref": False, "path": None, "lr": 0.5, "steps": 1000, "name": "7", "tags": [1, 2],
        "flag": False, "coef": 0.25, "rev": "1.10", "dims": (2, 3), "scale": 1.0}
    given("batch=1e3", "procs=2.0", "coef=0.5")
    settings = config(batch=8, procs=1, coef=0)
    assert settings == {"batch": 1000, "procs": 2, "coef": 0.5}
    assert type(settings["batch"]) is int and type(settings["procs"]) is int
    given("use_ref=maybe")
    with pytest.raises(ValueError, match=r"setting use_ref='maybe' on the command line: "
                                         r"expected a bool, as its default True is \(true/fal"):
        config(use_ref=True)
    given("steps=many")
    with pytest.raises(ValueError, match="expected a int, as its default 5 is"):
        config(steps=5)
    # a None default takes True/False as Python writes them (it was the truthy "False"); a
    # Path's is made from the text (it was a str, or the int 5); an old overrides.json's null
    # for a str default is None (it was the string "null")
    from pathlib import Path

    given("check=False", "more=True", "out=runs/x", "n=5")
    assert config(check=None, more=None, out=Path("a"), n=Path("b")) == {
        "check": False, "more": True, "out": Path("runs/x"), "n": Path("5")}
    monkeypatch.setenv(OVERRIDES_ENV, json.dumps({"name": None}))
    assert config(name="a") == {"name": None}
    import torch  # another type's default: the text as given (Hugging Face reads "float16")

    given("dtype=float16")
    assert config(dtype=torch.bfloat16) == {"dtype": "float16"}

    flow = tmp_path / "no_settings.py"  # never calls asyncrl.config: lr=0.1 would be lost
    flow.write_text(NO_GROUPS_FLOW)
    monkeypatch.setattr(asyncrl.cli, "run", lambda *a, **k: 0)
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    with pytest.raises(SystemExit, match=r"no_settings.py takes no settings \(it never calls "
                                         r"asyncrl.config\(...\)\), so lr=0.1 would be ignored"):
        asyncrl.cli.main(["launch", str(flow), "lr=0.1"])
    # a driver (its own main()): its arguments go after --, not into asyncrl.config
    driver = tmp_path / "driver_file.py"
    driver.write_text("import asyncrl\n\n\nasync def main():\n    pass\n")
    with pytest.raises(SystemExit, match=r"arguments for its main\(\) go after --: asyncrl "
                                         r"launch .*driver_file.py -- out=r.json"):
        asyncrl.cli.main(["launch", str(driver), "out=r.json"])


def test_a_resume_logs_to_the_runs_wandb_project_unless_told_not_to(tmp_path, capsys):
    from asyncrl import cli as asyncrl_cli

    state = tmp_path / "wandb.json"
    state.write_text(json.dumps({"id": "abc123", "project": "p1"}))

    def project(*flags: str) -> str | None:
        args = asyncrl_cli.parser().parse_args(
            ["launch", "flow.py", "--run-dir", str(tmp_path), *flags])
        return asyncrl_cli._wandb(args, tmp_path)

    assert project("--resume") == "p1"
    assert "logging to wandb project 'p1' as the run did" in capsys.readouterr().err
    assert project("--resume", "--no-wandb") is None
    assert "not logging to wandb project 'p1' (--no-wandb)" in capsys.readouterr().err
    assert json.loads(state.read_text())["id"] == "abc123"  # kept for a later resume
    assert project("--wandb", "p2") == "p2"
    assert project() is None  # a fresh run logs to wandb only when told to
    with pytest.raises(SystemExit):
        project("--wandb", "p2", "--no-wandb")
    assert "--no-wandb: not allowed with argument --wandb" in capsys.readouterr().err


def test_launch_failures_are_said_without_asyncios_traceback(tmp_path):
    """A flow that cannot run says why in a line (exit 1); a bug in a node's own code (on the
    controller) shows where it is, once."""
    dup = tmp_path / "dup_flow.py"
    dup.write_text("import asyncrl\n\n\nclass W(asyncrl.Worker):\n    pass\n\n\n"
                   "a = asyncrl.group(W, name='same')\nb = asyncrl.group(W, name='same')\n\n\n"
                   "@asyncrl.node\ndef n(x):\n    return x\n\n\n"
                   "flow = asyncrl.DataFlow(nodes=[n], inputs={'x': [1, 2]})\n")
    out = cli("launch", str(dup), "--steps", "1", "--run-dir", str(tmp_path / "dup"))
    assert out.returncode == 1
    assert "asyncrl launch: FlowError: two groups are named ['same']; pass name=... to " \
        "asyncrl.group" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    buggy = tmp_path / "buggy_flow.py"
    buggy.write_text("import asyncrl\n\n\n@asyncrl.node\ndef score(x):\n"
                     "    return {'r': x['missing']}\n\n\n"
                     "flow = asyncrl.DataFlow(nodes=[score], inputs={'x': [{}]})\n")
    out = cli("launch", str(buggy), "--steps", "1", "--run-dir", str(tmp_path / "bug"))
    assert out.returncode == 1
    assert "asyncrl: node 'score' failed at step 0: KeyError: 'missing'" in out.stderr
    assert f'File "{buggy}", line 6, in score' in out.stderr, out.stderr
    assert out.stderr.count("KeyError: 'missing'") == 2  # the line above, the traceback's end


def test_a_run_whose_input_ends_before_its_steps_says_so(tmp_path):
    """--steps 5 on an input of 2 items ran 2 steps and ended without a word."""
    short = tmp_path / "short_flow.py"
    short.write_text("import asyncrl\n\n\n@asyncrl.node\ndef n(x):\n    return {'v': x}\n\n\n"
                     "flow = asyncrl.DataFlow(nodes=[n], inputs={'x': [1, 2]})\n")
    out = cli("launch", str(short), "--steps", "5", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    assert "asyncrl: input 'x' ran out after 2 steps, before the 5 asked for" in out.stderr
    out = cli("launch", str(short), "--run-dir", str(tmp_path / "all"))  # no steps asked
    assert out.returncode == 0 and "ran out" not in out.stderr
    # resumed, it has nothing left to give: said (it ended without a word)
    out = cli("launch", str(short), "--run-dir", str(tmp_path / "all"), "--resume")
    assert out.returncode == 0, out.stderr
    assert "nothing to run: input 'x' has no items left after steps 0..1" in out.stderr


def test_a_resume_takes_the_flows_changed_steps_over_the_runs_steps(tmp_path):
    """A run launched with --steps 2 and resumed with `steps=4` (the README's way for a
    flow whose config declares steps) ran the saved --steps 2 again: nothing to run."""
    counted = tmp_path / "counted_flow.py"
    counted.write_text("import asyncrl\n\ncfg = asyncrl.config(steps=1)\n\n\n@asyncrl.node\n"
                       "def n(x):\n    return {'v': x}\n\n\nflow = asyncrl.DataFlow(nodes=[n], "
                       "inputs={'x': range(100)}, steps=cfg['steps'])\n")
    run_dir = str(tmp_path / "run")
    out = cli("launch", str(counted), "--steps", "2", "--run-dir", run_dir)
    assert out.returncode == 0, out.stderr
    out = cli("launch", str(counted), "--run-dir", run_dir, "--resume", "steps=4")
    assert out.returncode == 0, out.stderr
    assert "the flow's steps are 4 now (1 when the run began): they replace the run's " \
           "--steps 2" in out.stderr
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in rows]
    assert steps == [0, 1, 2, 3]
    out = cli("launch", str(counted), "--run-dir", run_dir, "--resume")  # as saved: 4
    assert "resuming with the run's settings {\"steps\": \"4\"}" in out.stderr
    assert "nothing to run: steps 0..3 are done" in out.stdout, out.stdout + out.stderr


def test_a_resume_drops_the_runs_settings_the_flow_no_longer_declares(tmp_path):
    """A setting renamed in the flow file after the run began made every --resume fail
    (the checkpoint's lr=0.7 was refused as unknown, and no command line could unset it)."""
    flow = tmp_path / "renamed_flow.py"
    body = ("import asyncrl\n\n{config}\n\n\n@asyncrl.node\ndef n(x):\n    return {{'v': x}}\n"
            "\n\nflow = asyncrl.DataFlow(nodes=[n], inputs={{'x': range(100)}})\n")
    flow.write_text(body.format(config="cfg = asyncrl.config(lr=0.5)"))
    run_dir = str(tmp_path / "run")
    assert cli("launch", str(flow), "--steps", "1", "--run-dir", run_dir, "lr=0.7"
               ).returncode == 0
    flow.write_text(body.format(config="cfg = asyncrl.config(actor_lr=0.5)"))
    out = cli("launch", str(flow), "--steps", "2", "--run-dir", run_dir, "--resume",
              "actor_lr=0.9")
    assert out.returncode == 0, out.stderr
    assert "the run's setting(s) ['lr'], kept in its checkpoint, are not settings of" in \
        out.stderr
    # what is given now must still be declared
    out = cli("launch", str(flow), "--steps", "3", "--run-dir", run_dir, "--resume", "lr=1")
    assert out.returncode == 1 and "unknown setting(s) ['lr']" in out.stderr
    flow.write_text(body.format(config=""))  # no settings at all any more
    out = cli("launch", str(flow), "--steps", "3", "--run-dir", run_dir, "--resume")
    assert out.returncode == 0, out.stderr
    assert "the run's setting(s) ['actor_lr'], kept in its checkpoint" in out.stderr
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in rows] == [0, 1, 2]


def test_a_flow_imported_again_without_a_stale_setting_declares_its_groups_once(tmp_path,
                                                                                capsys):
    """The first import (refused: a setting the checkpoint kept that the file no longer
    declares) had declared the groups above its config() call; the second declared them
    again: the flow got each twice."""
    from asyncrl.flow_file import load_flow

    flow = tmp_path / "groups_first.py"
    flow.write_text("import asyncrl\n\n\nclass W(asyncrl.Worker):\n    @asyncrl.register\n"
                    "    def f(self, x):\n        return x\n\n\nw = asyncrl.group(W, name='w')\n"
                    "cfg = asyncrl.config(other=1)\n\n\n@asyncrl.node\ndef n(x):\n"
                    "    return w.f(x)\n\n\nflow = asyncrl.DataFlow(nodes=[n], "
                    "inputs={'x': [1]})\n")
    module = load_flow(str(flow), {"lr": "0.5"}, {"lr": "0.5"})
    assert "the run's setting(s) ['lr'], kept in its checkpoint" in capsys.readouterr().err
    assert [g.name for g in module.flow.groups] == ["w"]


def test_a_bad_setting_on_the_command_line_says_what_went_wrong(monkeypatch):
    """The shell's quotes taken off a list, a space after '=', a mistyped option, a setting
    given twice (the last won), steps=nan (taken as a float for an int setting)."""
    import asyncrl
    from asyncrl.controller.declare import parse_overrides
    from asyncrl.errors import SettingError

    for given, default, said in (("[a,b]", ["x"], "quote it for the shell"),
                                 ("", 1.0, "nothing after '='"),
                                 ("nan", 3, "expected a int"), ("inf", 3, "expected a int")):
        monkeypatch.setenv("ASYNCRL_OVERRIDES", json.dumps({"k": given}))
        with pytest.raises(SettingError, match=said):
            asyncrl.config(k=default)
    monkeypatch.setenv("ASYNCRL_OVERRIDES", json.dumps({"k": "inf"}))
    assert asyncrl.config(k=1.0) == {"k": float("inf")}  # a float's may be
    with pytest.raises(ValueError, match="'--stesp=3' is not an option"):
        parse_overrides(["--stesp=3"])
    with pytest.raises(ValueError, match="lr is given twice"):
        parse_overrides(["lr=1", "lr=2"])


def test_bad_controller_timings_are_refused_before_anything_starts(tmp_path):
    """--heartbeat-timeout below the interval ended in a ValueError traceback from inside
    run(), after the run directory was made; zero and negative seconds were taken."""
    from asyncrl.cli import main

    flow = tmp_path / "flow.py"
    flow.write_text("raise SystemExit('the flow file was imported')\n")
    with pytest.raises(SystemExit, match=r"heartbeat_timeout \(0.2 s\) must be longer than "
                                         r"heartbeat_interval \(0.5 s\); see --heartbeat"):
        main(["launch", str(flow), "--heartbeat-timeout", "0.2",
              "--run-dir", str(tmp_path / "run")])
    with pytest.raises(SystemExit, match=r"heartbeat_timeout \(0.2 s\) must be longer"):
        main(["bench", str(flow), "--heartbeat-timeout", "0.2"])  # (bench's: checked too)
    for flag in ("--heartbeat-interval", "--transfer-timeout", "--collective-timeout"):
        for bad in ("0", "-1", "inf", "nan"):
            with pytest.raises(SystemExit) as e:  # argparse's usage error (the flow file
                main(["launch", str(flow), flag, bad])  # imported: its message, not 2)
            assert e.value.code == 2, (flag, bad, e.value.code)
    assert not (tmp_path / "run").exists()


def test_asyncrl_timeline_on_another_tools_trace_says_so(tmp_path):
    """Valid JSON of another shape (a trace without asyncrl's fields) ended in a KeyError
    traceback."""
    (tmp_path / "timeline.json").write_text(json.dumps({"traceEvents": [
        {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name"},
        {"ph": "X", "name": "step", "ts": 0, "dur": 5}]}))
    out = cli("timeline", str(tmp_path))
    assert out.returncode == 1 and "is not a trace asyncrl wrote" in out.stderr and \
        "Traceback" not in out.stderr, out.stderr


def test_settings_declared_by_two_config_calls_both_take_overrides(tmp_path, monkeypatch):
    """Each config() call took every key on the command line as its own: with settings
    split over two calls (or one in a module the flow imports), any override was refused as
    unknown, naming the other call's settings only."""
    from asyncrl.controller import declare
    from asyncrl.controller.declare import OVERRIDES_CHECKED_ENV
    from asyncrl.flow_file import load_flow

    monkeypatch.setenv(OVERRIDES_CHECKED_ENV, "")  # (set by the launcher once checked)
    for n, (given, want) in enumerate((({"lr": "1", "steps": "3"}, (1.0, 3)),
                                       ({}, (0.5, 2)))):
        flow = tmp_path / f"two_configs{n}.py"
        flow.write_text("import asyncrl\n"
                        "model_cfg = asyncrl.config(lr=0.5)\n"
                        "run_cfg = asyncrl.config(steps=2)\n")
        module = load_flow(str(flow), given)
        assert (module.model_cfg["lr"], module.run_cfg["steps"]) == want
        assert declare.settings == {"lr": want[0], "steps": want[1]}
        assert os.environ[OVERRIDES_CHECKED_ENV] == "1"  # what the ranks' imports take
    typo = tmp_path / "two_configs_typo.py"
    typo.write_text(flow.read_text())
    with pytest.raises(SystemExit, match=r"unknown setting\(s\) \['stesp'\] on the command "
                                         r"line; this flow's settings are \['lr', 'steps'\]"):
        load_flow(str(typo), {"lr": "1", "stesp": "3"})
    assert load_flow(str(typo), {"steps": "4"}).run_cfg["steps"] == 4  # imported anew


def test_a_key_value_after_wandb_or_run_dir_is_refused_not_taken_as_its_value(tmp_path):
    """`--wandb lr=3e-4 kl=0.1` logged to a project named "lr=3e-4" and left lr at its
    default, without a word."""
    for option in ("--wandb", "--run-dir"):
        out = cli("launch", "examples/grpo_tiny.py", option, "lr=3e-4", "kl=0.1")
        assert out.returncode != 0 and f"{option} lr=3e-4: that is a key=value override, " \
            f"taken as {option}'s value" in out.stderr, out.stderr[-2000:]


def test_a_driver_returning_true_exits_0(tmp_path):
    """bool is an int: a main() returning True (success) exited with status 1."""
    script = tmp_path / "ok.py"
    script.write_text("def main():\n    return True\n")
    assert cli("launch", str(script)).returncode == 0
    script.write_text("def main():\n    return 3\n")
    assert cli("launch", str(script)).returncode == 3


def test_a_flow_file_failing_in_a_module_of_its_own_names_that_module_and_its_traceback(
        tmp_path, monkeypatch):
    """A NameError at helper.py:4, imported by the flow file, was said to be at the flow
    file's import line; and ASYNCRL_TRACEBACK=1 printed nothing more (SystemExit prints its
    message alone, not its cause)."""
    from asyncrl.flow_file import load_flow

    (tmp_path / "sibling_broken_helper.py").write_text("import os\n\n\nx = undefined_name\n")
    flow = tmp_path / "imports_broken_helper.py"
    flow.write_text("import sibling_broken_helper\n")
    with pytest.raises(SystemExit) as e:
        load_flow(str(flow))
    assert f"importing {flow} failed at {tmp_path}/sibling_broken_helper.py:4 (imported by " \
        f"{flow}:1): NameError" in str(e.value)
    assert "Traceback" not in str(e.value) and "ASYNCRL_TRACEBACK=1" in str(e.value)

    (tmp_path / "sibling_raising_helper.py").write_text("def f():\n    return {}['k']\n")
    flow.write_text("import json\nimport sibling_raising_helper\n\n"
                    "sibling_raising_helper.f()\n")
    with pytest.raises(SystemExit) as e:
        load_flow(str(flow))
    sys.modules.pop("sibling_raising_helper")  # (imported: not left to the other tests)
    assert f"failed at {tmp_path}/sibling_raising_helper.py:2 (called from {flow}:4): " \
        f"KeyError" in str(e.value)
    flow.write_text("import json\n\njson.loads('{')\n")  # the stdlib's line is not theirs
    with pytest.raises(SystemExit) as e:
        load_flow(str(flow))
    assert f"failed at {flow}:3: JSONDecodeError" in str(e.value)

    monkeypatch.setenv("ASYNCRL_TRACEBACK", "1")
    flow.write_text("import sibling_broken_helper\n")
    with pytest.raises(SystemExit) as e:
        load_flow(str(flow))
    assert str(e.value).startswith("Traceback (most recent call last):")
    assert 'sibling_broken_helper.py", line 4, in <module>' in str(e.value)
    assert "(imported by" in str(e.value) and "ASYNCRL_TRACEBACK=1" not in str(e.value)


def test_remote_hosts_and_a_loopback_or_unresolvable_name_ask_for_controller_address(
        tmp_path, monkeypatch):
    """--hosts with a host over ssh and no --controller-address took this machine's name's
    address: 127.0.1.1 on Debian (the Controller's ValueError as a traceback) or a gaierror,
    after the run directory was made."""
    import argparse
    import socket

    from asyncrl import cli
    from asyncrl.cli import main

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"hosts": [{"name": "gpu1", "address": "10.0.0.1",
                                            "cpus": 2}]}))
    flow = tmp_path / "remote_flow.py"
    flow.write_text("import asyncrl\n\n\n@asyncrl.node\ndef n(x):\n    return x\n\n\n"
                    "flow = asyncrl.DataFlow(nodes=[n], inputs={'x': [1]})\n")
    monkeypatch.setattr(sys, "argv", sys.argv)  # (launch sets the flow's)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    with pytest.raises(SystemExit, match=r"resolves to 127\.0\.1\.1 .*cannot reach; pass "
                                         r"--controller-address ADDRESS, this machine's "
                                         r"address as host\(s\) \['gpu1'\] reach it"):
        main(["launch", str(flow), "--hosts", str(hosts), "--run-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()

    def unresolvable(name):
        raise socket.gaierror(-2, "Name or service not known")
    monkeypatch.setattr(socket, "gethostbyname", unresolvable)
    given = argparse.Namespace(hosts=str(hosts), controller_address=None)
    with pytest.raises(SystemExit, match=r"does not resolve here .*--controller-address"):
        cli.launch_cluster(given)
    given.controller_address = "127.0.0.1"
    with pytest.raises(SystemExit, match=r"--controller-address 127\.0\.0\.1, an address"):
        cli.launch_cluster(given)
    given.controller_address = "10.0.0.2"
    assert cli.launch_cluster(given)[1] == "10.0.0.2"


def test_a_stale_setting_keeps_groups_and_settings_of_a_module_the_flow_imports(
        tmp_path, monkeypatch, capsys):
    """A saved setting the flow no longer declares made --resume import the flow file again,
    not the module it imports (cached): its group and its checkpoint's settings were lost."""
    from asyncrl.controller import declare
    from asyncrl.controller.declare import OVERRIDES_ENV
    from asyncrl.flow_file import load_flow

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "stale_setting_roles.py").write_text(
        "import asyncrl\n\n\nclass W(asyncrl.Worker):\n    pass\n\n\n"
        "w = asyncrl.group(W, name='w')\ncfg = asyncrl.config(actor_lr=0.5)\n")
    flow = tmp_path / "stale_setting_flow.py"
    flow.write_text("import asyncrl\nfrom stale_setting_roles import w\n\n\n@asyncrl.node\n"
                    "def n(x):\n    return w.f(x)\n\n\n"
                    "flow = asyncrl.DataFlow(nodes=[n], inputs={'x': [1]})\n")
    saved = {"lr": "0.5", "actor_lr": "0.9"}  # lr: renamed actor_lr since the run began
    monkeypatch.setenv(OVERRIDES_ENV, "{}")  # (load_flow sets it for the ranks)
    try:
        module = load_flow(str(flow), saved, saved)
    finally:
        sys.modules.pop("stale_setting_roles", None)
    assert [g.name for g in module.flow.groups] == ["w"]
    assert json.loads(os.environ[OVERRIDES_ENV]) == {"actor_lr": "0.9"}
    assert declare.settings == {"actor_lr": 0.9}
    assert re.findall(r"setting\(s\) (\[.*?\])", capsys.readouterr().err) == ["['lr']"]


def test_a_driver_whose_main_returns_a_coroutine_runs_it(tmp_path, monkeypatch):
    """A wrapped async main() returned a coroutine never awaited: launch exited 0, nothing ran."""
    from asyncrl.cli import main

    ran = tmp_path / "ran"
    driver = tmp_path / "wrapped_driver.py"
    driver.write_text(f"import functools, pathlib\n\n\ndef logged(fn):\n"
                      f"    @functools.wraps(fn)\n    def wrapper():\n        return fn()\n"
                      f"    return wrapper\n\n\n@logged\nasync def main():\n"
                      f"    pathlib.Path({str(ran)!r}).write_text('ran')\n    return 3\n")
    monkeypatch.setattr(sys, "argv", sys.argv[:])  # (launch sets the driver's)
    assert main(["launch", str(driver)]) == 3 and ran.read_text() == "ran"


def test_sigterm_during_export_removes_its_half_written_folder(tmp_path):
    """SIGTERM ended `asyncrl export` at once: its hidden .OUT.xxxx/ folder stayed."""
    script = ("import os, shutil, signal, sys, tempfile\nimport asyncrl.hybrid.export\n"
              "from asyncrl.cli import main\n\n\ndef export(path, out, group, dtype):\n"
              "    tmp = tempfile.mkdtemp(dir=out.parent, prefix=f'.{out.name}.')\n"
              "    try:\n        os.kill(os.getpid(), signal.SIGTERM)\n"
              "        while True:\n            signal.pause()\n"
              "    except BaseException:\n        shutil.rmtree(tmp)\n        raise\n\n\n"
              "asyncrl.hybrid.export.export = export\nsys.exit(main(sys.argv[1:]))\n")
    out = subprocess.run([sys.executable, "-c", script, "export", str(tmp_path / "run"),
                          str(tmp_path / "model")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 143, out.stderr[-2000:]
    assert not list(tmp_path.glob(".model.*"))


def test_a_run_dir_that_is_a_file_is_said_in_a_line(tmp_path, monkeypatch, capsys):
    """A file as --run-dir ended in a FileExistsError traceback."""
    from asyncrl.cli import main

    flow = tmp_path / "no_groups_flow.py"
    flow.write_text(NO_GROUPS_FLOW)
    (taken := tmp_path / "taken").write_text("")
    monkeypatch.setattr(sys, "argv", sys.argv[:])  # (launch sets the flow's)
    assert main(["launch", str(flow), "--run-dir", str(taken)]) == 2
    assert f"--run-dir {taken} cannot be used as the run's folder (it is a file, not a " \
        f"folder); choose another --run-dir" in capsys.readouterr().err


def test_another_users_checkpoint_is_refused_before_the_flow_takes_its_settings(
        tmp_path, monkeypatch):
    """--resume imported the flow with another user's checkpoint's settings, then refused it."""
    from asyncrl.cli import main
    from asyncrl.controller import checkpoint

    step = tmp_path / "run" / "checkpoints" / "step_000000"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 0, "overrides": {"lr": "1"}}))
    monkeypatch.setattr(checkpoint, "not_yours", lambda path: "owned by user 4242")
    flow = tmp_path / "imported_flow.py"
    flow.write_text("raise RuntimeError('the flow file was imported')\n")
    monkeypatch.setattr(sys, "argv", sys.argv[:])  # (launch sets the flow's)
    with pytest.raises(SystemExit, match=r"--resume: .*run is owned by user 4242"):
        main(["launch", str(flow), "--resume", "--run-dir", str(tmp_path / "run")])
