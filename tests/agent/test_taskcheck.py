"""`tidal tasks check`: oracles earn 1, untouched environments less; every broken task
is named with the file at fault, and the command exits non-zero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.agent.harbor_tasks import (
    BASE,
    HARBOR_TEMPLATE,
    VERIFIER_DOCKERFILE,
    engine_problem,
    from_harbor_template,
    write_separate_task,
    write_task,
)
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
    assert "network_mode is 'public': tidal's bubblewrap sandboxes have no network" in task["notes"]


SEPARATE = 'artifacts = ["/app/out.txt"]\n[verifier]\nenvironment_mode = "separate"\n'


def test_a_separate_verifier_gets_only_the_artifacts_on_bubblewrap(tmp_path: Path) -> None:
    write_separate_task(tmp_path, "separate", toml=SEPARATE)
    # an image of its own cannot be given here: named, with the remedy
    write_separate_task(tmp_path, "own-image", toml=SEPARATE, own_image=True,
                        extra={"tests/Dockerfile": VERIFIER_DOCKERFILE})
    code, out, err = _check(str(tmp_path), "--image", "ubuntu:24.04=default", "--json")
    assert code == 1
    by = {t["task"]: t for t in json.loads(out)["tasks"]}
    sep = by["separate"]
    assert sep["ok"] and (sep["oracle_reward"], sep["untouched_reward"]) == (1.0, 0.0), sep
    assert any(n.endswith("carrying /app/out.txt, /logs/artifacts") for n in sep["notes"])
    (problem,) = by["own-image"]["problems"]
    assert problem["file"] == "tests/Dockerfile"
    assert "bubblewrap sandboxes cannot give" in problem["problem"]
    assert "broken: own-image: tests/Dockerfile: " in err and "--sandbox docker" in err


# --------------------------------------------------------------------------- containers

needs_engine = pytest.mark.skipif(engine_problem() is not None, reason=str(engine_problem()))


PY_TEST = ("#!/usr/bin/env python3\nimport json, pathlib\n"
           "p = pathlib.Path('/app/sum.txt')\n"
           "ok = p.exists() and p.read_text().strip() == '42'\n"
           "json.dump({'correct': int(ok), 'exists': int(p.exists())},\n"
           "          open('/logs/verifier/reward.json', 'w'))\n")


@needs_engine
@pytest.mark.skipif(HARBOR_TEMPLATE is None, reason=".venv-harbor does not exist: run "
                    ".ci/harbor-venv.sh")
def test_tasks_written_for_docker_pass_on_the_container_runtime(tmp_path: Path) -> None:
    from_harbor_template(tmp_path)
    write_task(tmp_path, "hello-world")  # Terminal-Bench 2's hello-world shape
    # a RUN that the bubblewrap builder refuses (the network), built by the engine
    write_task(tmp_path, "sum-python", dockerfile=(
        "FROM ubuntu:24.04\nRUN mkdir -p /app && printf '40\\n2\\n' > /app/numbers.txt\n"
        "RUN useradd --create-home agent\nWORKDIR /app\n"),
        instruction="Write the sum of the numbers in /app/numbers.txt to /app/sum.txt.",
        solve_sh="#!/bin/bash\npaste -sd+ numbers.txt | bc > sum.txt 2>/dev/null || "
                 "python3 -c \"print(sum(map(int, open('numbers.txt'))))\" > sum.txt\n",
        test_sh=PY_TEST, toml='[verifier]\nreward_key = "correct"\n'
                              '[environment]\nnetwork_mode = "no-network"\n')
    code, out, err = _check(str(tmp_path), "--sandbox", "docker", "--image",
                            f"ubuntu:24.04={BASE}", "--json")
    assert code == 0, out + err
    by = {t["task"]: t for t in json.loads(out)["tasks"]}
    assert set(by) == {"greeting-template", "hello-world", "sum-python"}
    for name, t in by.items():
        assert t["ok"] and t["oracle_reward"] == 1.0, (name, t)
        assert t["untouched_reward"] is not None and t["untouched_reward"] < 1.0, (name, t)
    assert any("storage_mb" in n for n in by["hello-world"]["notes"])  # said, not pretended


@needs_engine
def test_the_docker_check_names_an_unmapped_from_and_refuses_fallback(tmp_path: Path) -> None:
    write_task(tmp_path, "unmapped", dockerfile="FROM alpine:3.20\nWORKDIR /app\n")
    code, out, err = _check(str(tmp_path), "--sandbox", "docker", "--json")
    assert code == 1
    (task,) = json.loads(out)["tasks"]
    assert "alpine:3.20 is not in the engine and not mapped" in task["problems"][0]["problem"]
    assert "--image alpine:3.20=IMAGE" in task["problems"][0]["problem"]
    code, _, err = _check(str(tmp_path), "--sandbox", "docker", "--fallback", "default")
    assert code == 2 and "--fallback is for --sandbox bwrap" in err


def _debian_mirror_problem() -> str | None:
    import socket

    try:
        socket.create_connection(("deb.debian.org", 80), timeout=5).close()
    except OSError as e:
        return f"deb.debian.org is not reachable ({e}): the build's apt-get needs it"
    return None


@needs_engine
@pytest.mark.skipif(_debian_mirror_problem() is not None, reason=str(_debian_mirror_problem()))
def test_a_task_whose_dockerfile_runs_apt_get_builds_and_passes(tmp_path: Path) -> None:
    # the line every one of 3,566 third-party tasks failed on under tidal's own builder
    write_task(tmp_path, "json-field", dockerfile=(
        "FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y --no-install-recommends"
        " jq && rm -rf /var/lib/apt/lists/*\nWORKDIR /app\n"
        "RUN echo '{\"name\": \"tidal\"}' > /app/data.json\n"),
        instruction="Write the value of the name field of /app/data.json to /app/name.txt.",
        solve_sh="#!/bin/bash\njq -r .name data.json > name.txt\n",
        test_sh='#!/bin/bash\n[ "$(cat /app/name.txt 2>/dev/null)" = tidal ] && echo 1 > '
                "/logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    code, out, err = _check(str(tmp_path), "--sandbox", "docker", "--image",
                            f"ubuntu:24.04={BASE}", "--json")
    assert code == 0, out + err
    (task,) = json.loads(out)["tasks"]
    assert (task["oracle_reward"], task["untouched_reward"]) == (1.0, 0.0), task


def _grader_image(root: Path) -> str:
    """An engine image holding a grading tool and a separate task's test.sh, as a
    `[verifier.environment] docker_image` names one (built from VERIFIER_DOCKERFILE)."""
    from tidal.agent.containers import ContainerEnvironments, connect
    from tidal.agent.harbor import load_task

    d = write_separate_task(root, "grader", toml=SEPARATE, own_image=True,
                            extra={"tests/Dockerfile": VERIFIER_DOCKERFILE})
    envs = ContainerEnvironments(connect(), {"ubuntu:24.04": BASE})
    return envs.verifier_image(load_task(d))


@needs_engine
def test_a_separate_verifier_runs_in_its_own_image_on_the_container_runtime(
        tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    # tests/Dockerfile: built by the engine (FROM mapped), the tests bundled in it
    write_separate_task(tasks, "tests-dockerfile", toml=SEPARATE, own_image=True,
                        extra={"tests/Dockerfile": VERIFIER_DOCKERFILE})
    # [verifier.environment] docker_image, mapped as a task's docker_image is
    write_separate_task(tasks, "verifier-image", own_image=True, toml=(
        'artifacts = [{source = "/app/out.txt"}]\n[verifier.environment]\n'
        'docker_image = "tidal-test/grader:1"\nnetwork_mode = "no-network"\n'))
    # separate without an image of its own: a fresh copy of the task's environment
    write_separate_task(tasks, "separate", toml=SEPARATE)
    grader = _grader_image(tmp_path / "grader")
    code, out, err = _check(str(tasks), "--sandbox", "docker", "--image",
                            f"ubuntu:24.04={BASE}", "--image", f"tidal-test/grader:1={grader}",
                            "--json")
    assert code == 0, out + err
    by = {t["task"]: t for t in json.loads(out)["tasks"]}
    for name, t in by.items():  # each sees the artifact and the log, never notes.txt
        assert (t["oracle_reward"], t["untouched_reward"]) == (1.0, 0.0), (name, t)
    carrying = "carrying /app/out.txt, /logs/artifacts"
    assert f"verifier: separate (tests/Dockerfile), {carrying}" in by["tests-dockerfile"]["notes"]
    assert (f"verifier: separate (docker_image tidal-test/grader:1), {carrying}"
            in by["verifier-image"]["notes"])
    assert (f"verifier: separate (a fresh copy of the task's environment), {carrying}"
            in by["separate"]["notes"])
