"""`tidal tasks check`: oracles earn 1, untouched environments less; every broken task
is named with the file at fault, and the command exits non-zero."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tests.agent.harbor_tasks import write_task
from tidal.cli import app

NO_REWARD = "#!/bin/bash\necho 'ran the tests, forgot the reward'\n"
ALWAYS_ONE = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"
WRONG_SOLUTION = "#!/bin/bash\necho 'Hello' > hello.txt\n"


def _check(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, ["tasks", "check", *args])
    return r.exit_code, r.stdout, r.stderr


def test_good_tasks_pass_with_a_table(tmp_path: Path) -> None:
    write_task(tmp_path, "hello-a")
    write_task(tmp_path, "hello-b", solve_sh=None)  # no oracle: noted, not broken
    code, out, err = _check(str(tmp_path), "--image", "ubuntu:24.04=default")
    assert code == 0, out + err
    assert "hello-a" in out and "2 of 2 tasks ok" in out and "oracle is not checked" in out


def test_each_broken_task_is_named_with_the_file_at_fault(tmp_path: Path) -> None:
    write_task(tmp_path, "good")
    write_task(tmp_path, "no-instruction", instruction=None)
    write_task(tmp_path, "bad-toml", toml="[verifier\n")
    write_task(tmp_path, "network-build", dockerfile="FROM ubuntu:24.04\nRUN pip install x\n")
    write_task(tmp_path, "no-test", test_sh=None)
    write_task(tmp_path, "no-reward", test_sh=NO_REWARD)
    write_task(tmp_path, "wrong-oracle", solve_sh=WRONG_SOLUTION)
    write_task(tmp_path, "too-easy", test_sh=ALWAYS_ONE)
    write_task(tmp_path, "unmapped", dockerfile="FROM alpine:3.20\n")
    code, out, err = _check(str(tmp_path), "--image", "ubuntu:24.04=default", "--json")
    assert code == 1
    report = json.loads(out)
    by = {t["task"]: t for t in report["tasks"]}
    assert not report["ok"] and by["good"]["ok"]
    assert (by["good"]["oracle_reward"], by["good"]["untouched_reward"]) == (1.0, 0.0)
    files = {name: [p["file"] for p in t["problems"]] for name, t in by.items()}
    assert files == {
        "good": [],
        "no-instruction": ["instruction.md"],
        "bad-toml": ["task.toml"],
        "network-build": ["environment/Dockerfile"],
        "no-test": ["tests/test.sh"],
        "no-reward": ["tests/test.sh", "tests/test.sh"],  # untouched, and after the oracle
        "wrong-oracle": ["tests/test.sh"],
        "too-easy": ["tests/test.sh"],
        "unmapped": ["environment/Dockerfile"],
    }
    problems = {name: " ".join(p["problem"] for p in t["problems"]) for name, t in by.items()}
    assert "line 2" in problems["network-build"] and "network" in problems["network-build"]
    assert "wrote no reward" in problems["no-reward"]
    assert "the oracle earns 0.5, not 1" in problems["wrong-oracle"]
    assert "untouched environment earns 1" in problems["too-easy"]
    assert "alpine:3.20" in problems["unmapped"] and "--image REF=DIR" in problems["unmapped"]
    assert "--fallback default" in problems["unmapped"]  # the flags of this command
    for name, at in files.items():  # stderr names every broken task and its file
        if at:
            assert f"broken: {name}: {at[0]}" in err


def test_a_missing_directory_is_a_usage_error(tmp_path: Path) -> None:
    code, _, err = _check(str(tmp_path / "none"))
    assert code == 2 and "does not exist" in err


def test_a_verdict_the_fallback_changes_says_so(tmp_path: Path) -> None:
    write_task(tmp_path, "mapped")  # FROM ubuntu:24.04, mapped below
    write_task(tmp_path, "unmapped", dockerfile="FROM alpine:3.20\nWORKDIR /app\n")
    code, out, err = _check(str(tmp_path), "--image", "ubuntu:24.04=default",
                            "--fallback", "default", "--json")
    assert code == 0, out + err
    by = {t["task"]: t for t in json.loads(out)["tasks"]}
    assert by["unmapped"]["ok"] and by["mapped"]["ok"]
    assert any("checked on --fallback default, not on 'alpine:3.20'" in n
               for n in by["unmapped"]["notes"])
    assert not any("--fallback" in n for n in by["mapped"]["notes"])


def test_a_network_the_sandbox_does_not_give_is_noted(tmp_path: Path) -> None:
    write_task(tmp_path, "online", toml='[environment]\nnetwork_mode = "public"\n')
    code, out, err = _check(str(tmp_path), "--image", "ubuntu:24.04=default", "--json")
    assert code == 0, out + err
    (task,) = json.loads(out)["tasks"]
    assert "network_mode is 'public': tidal's sandboxes have no network" in task["notes"]
