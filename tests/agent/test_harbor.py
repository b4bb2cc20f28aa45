"""Harbor tasks: read from TB2-layout directories, refused with the task and file when
malformed, graded by their test.sh in a real sandbox (reward.txt / reward.json rules)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.agent.harbor_tasks import IMAGES, write_task
from tidal.agent.environment import Environments, SandboxRuntimes
from tidal.agent.harbor import (
    HarborTaskError,
    RewardError,
    VerifierScript,
    load_split,
    load_task,
    load_tasks,
    read_reward,
    run_oracle,
    task_dirs,
)
from tidal.agent.runtime import RuntimeToolError, ToolRuntime
from tidal.agent.sandboxed import SandboxRuntime, sandboxed_runtime
from tidal.agent.tasks import EnvironmentSpec, SeparateVerifier, Task, TaskError, prepare
from tidal.sandbox import Limits, SandboxConfig

LIMITS = Limits(memory_bytes=256 << 20, cpu_s=60.0, wall_s=60.0, disk_bytes=128 << 20)


def test_a_tb2_task_directory_reads_with_every_field(tmp_path: Path) -> None:
    d = write_task(tmp_path, agent_timeout=900.0, verifier_timeout=300.0)
    task = load_task(d)
    assert task.task_id == "hello-world" and task.prompt.startswith("Create a file")
    assert task.time_limit_s == 900.0 and task.family == "file-operations"
    assert isinstance(task.grader, VerifierScript) and task.grader.timeout_s == 300.0
    env = task.environment
    assert env is not None and env.dockerfile == d / "environment" / "Dockerfile"
    assert env.docker_image == "alexgshaw/hello-world:20251031"
    assert (env.memory_mb, env.storage_mb, env.cpus) == (2048, 10240, 1.0)  # "2G", "10G"
    assert env.network_mode == "public" and env.workdir is None  # Harbor's defaults
    assert task.oracle is not None and task.oracle.directory == d / "solution"
    assert task.metadata["metadata"]["expert_time_estimate_min"] == 1.0


def test_the_newer_task_table_and_env_fields_read(tmp_path: Path) -> None:
    toml = ('version = "1.0"\n[task]\nname = "org/hello"\ndescription = "say hello"\n'
            '[verifier]\nenv = { TOKEN = "x" }\n[solution]\nenv = { MODE = "oracle" }\n'
            '[environment]\nworkdir = "/srv"\nmemory_mb = 512\nallow_internet = false\n'
            'env = { LANGUAGE = "en" }\n')
    task = load_task(write_task(tmp_path, toml=toml))
    assert task.metadata["name"] == "org/hello" and task.metadata["description"] == "say hello"
    assert task.grader.env == {"TOKEN": "x"}  # type: ignore[attr-defined]
    assert task.oracle is not None and task.oracle.env == {"MODE": "oracle"}
    assert task.environment is not None
    assert (task.environment.workdir, task.environment.memory_mb) == ("/srv", 512)
    assert task.environment.env == {"LANGUAGE": "en"}
    assert task.environment.network_mode == "no-network"  # allow_internet = false
    assert task.time_limit_s == 600.0  # Harbor's default agent timeout


@pytest.mark.parametrize(
    ("kwargs", "file", "problem"),
    [
        ({"instruction": None}, "instruction.md", "missing"),
        ({"instruction": "  \n"}, "instruction.md", "empty"),
        ({"toml": "version = \n"}, "task.toml", "not valid TOML"),
        ({"toml": "[agent]\ntimeout_sec = \"soon\"\n"}, "task.toml",
         "[agent].timeout_sec must be a positive number"),
        ({"toml": "[environment]\nmemory = \"lots\"\n"}, "task.toml", "is not a size"),
        ({"toml": "[environment]\nworkdir = \"app\"\n"}, "task.toml", "must be an absolute path"),
        ({"toml": "environment = 3\n"}, "task.toml", "[environment] must be a table"),
        ({"test_sh": None}, "tests/test.sh", "missing"),
        ({"dockerfile": None, "toml": "version = \"1.0\"\n"}, "environment/Dockerfile",
         "names no [environment] docker_image"),
        ({"toml": "[verifier]\nenvironment_mode = \"host\"\n"}, "task.toml",
         "[verifier].environment_mode must be one of pristine, separate, shared"),
        ({"toml": "[verifier]\ncarry_paths = [\"app\"]\n"}, "task.toml",
         "[verifier].carry_paths must be a list of absolute paths"),
        ({"toml": "[verifier]\ncarry_paths = \"/app\"\n"}, "task.toml",
         "[verifier].carry_paths must be a list of absolute paths"),
        ({"toml": "[verifier]\nenvironment_mode = \"shared\"\ncarry_paths = [\"/app\"]\n"},
         "task.toml", "carry_paths means nothing with environment_mode = \"shared\""),
        ({"toml": "[environment]\nnetwork_mode = \"wifi\"\n"}, "task.toml",
         "network_mode must be one of no-network, public, allowlist"),
        ({"toml": "[environment]\nallowed_hosts = [\"pypi.org\"]\n"}, "task.toml",
         "allowed_hosts is only valid with network_mode = \"allowlist\""),
        ({"toml": "[verifier]\nreward_key = 3\n"}, "task.toml",
         "[verifier].reward_key must name a key of reward.json"),
        # a separate verifier: [verifier.environment] is read as [environment] is
        ({"toml": "[verifier.environment]\nmemory = \"lots\"\n"}, "task.toml",
         "[verifier.environment].memory = 'lots' is not a size"),
        ({"toml": "[verifier.environment]\nnetwork_mode = \"wifi\"\n"}, "task.toml",
         "[verifier.environment].network_mode must be one of"),
        ({"toml": "[verifier]\nenvironment = 3\n"}, "task.toml",
         "[verifier.environment] must be a table"),
        ({"toml": "[verifier]\nenvironment_mode = \"shared\"\n[verifier.environment]\ncpus = 2\n"},
         "task.toml", "environment_mode = 'shared' conflicts with [verifier.environment]"),
        ({"toml": "artifacts = \"/app\"\n"}, "task.toml", "artifacts must be a list"),
        ({"toml": "artifacts = [\"out.txt\"]\n"}, "task.toml",
         "artifacts[0] must be an absolute path"),
        ({"toml": "artifacts = [\"/app\", {destination = \"x\"}]\n"}, "task.toml",
         "artifacts[1].source must be an absolute path"),
        ({"toml": "artifacts = [\"/app/../..\"]\n"}, "task.toml", "without '..'"),
        ({"toml": "artifacts = [\"/\"]\n"}, "task.toml", "would hand the verifier everything"),
        ({"toml": "artifacts = [{source = \"/var/lib/db\", service = \"db\"}]\n"}, "task.toml",
         "artifacts[0].service = 'db' is not supported"),
        ({"toml": "artifacts = [{source = \"/app\", exclude = [\"*.pyc\"]}]\n"}, "task.toml",
         "artifacts[0].exclude is not supported"),
        ({"toml": "[verifier]\nenvironment_mode = \"separate\"\n",
          "extra": {"tests/docker-compose.yaml": "services: {}\n"}},
         "tests/docker-compose.yaml", "a docker-compose verifier environment is not supported"),
        # Harbor's multi-step layout is named, not reported as a missing instruction.md
        ({"toml": "[[steps]]\nname = \"one\"\n[[steps]]\nname = \"two\"\n",
          "instruction": None}, "task.toml", "a multi-step task ([[steps]], steps/)"),
    ],
)
def test_a_malformed_task_is_refused_naming_the_task_and_the_file(
    tmp_path: Path, kwargs: dict[str, str | None], file: str, problem: str
) -> None:
    d = write_task(tmp_path, "broken-1", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(HarborTaskError) as e:
        load_task(d)
    assert (e.value.task, e.value.file) == ("broken-1", file)
    assert problem in e.value.problem, e.value.problem
    assert str(e.value).startswith(f"task 'broken-1': {file}: ")


@pytest.mark.parametrize("dockerfile", [
    "FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y curl\n",
    "FROM a\nFROM b\n"])
def test_a_dockerfile_beyond_tidals_builder_loads_and_is_refused_when_tidal_builds_it(
        tmp_path: Path, dockerfile: str) -> None:
    # the container engine builds it as written (tests/agent/test_taskcheck.py); tidal's
    # own builder names the line it cannot build, before any episode runs
    task = load_task(write_task(tmp_path, "beyond", dockerfile=dockerfile))
    envs = Environments(dict(IMAGES), None, tmp_path / "envs")
    with pytest.raises(TaskError, match=r"task 'beyond': .*line 2"):
        envs.environment(task)


SEPARATE = 'artifacts = ["/app/out.txt"]\n[verifier]\nenvironment_mode = "separate"\n'
RESOURCES = '[environment]\nworkdir = "/srv"\nmemory_mb = 512\nenv = { A = "1" }\n'


def test_a_separate_verifier_builds_tests_dockerfile_with_the_tasks_resources(
        tmp_path: Path) -> None:
    d = write_task(tmp_path, "sep", toml=SEPARATE + RESOURCES,
                   extra={"tests/Dockerfile": "FROM ubuntu:24.04\nCOPY . /tests/\n"})
    task = load_task(d)
    sep = task.separate_verifier
    assert sep is not None and sep.environment is not None and task.environment is not None
    assert (sep.describe(), sep.file) == ("separate (tests/Dockerfile)", "tests/Dockerfile")
    assert (sep.environment.dockerfile, sep.environment.context) == (
        d / "tests" / "Dockerfile", d / "tests")
    # Harbor's copy of [environment], but for its image
    assert sep.environment == replace(task.environment, dockerfile=d / "tests" / "Dockerfile",
                                      context=d / "tests", docker_image=None)
    assert (sep.environment.workdir, sep.environment.memory_mb) == ("/srv", 512)
    assert task.verifier_carry == ("/app/out.txt", "/logs/artifacts")
    assert isinstance(task.grader, VerifierScript) and task.grader.bundled  # its image has /tests
    # Harbor builds tests/Dockerfile only for a separate verifier: elsewhere it is inert
    for verifier, carry in (("", ()), ('environment_mode = "shared"', None)):
        (d / "task.toml").write_text(f"[verifier]\n{verifier}\n")
        task = load_task(d)
        assert task.separate_verifier is None and task.verifier_carry == carry
        assert not task.grader.bundled  # type: ignore[attr-defined]


def test_a_verifier_environment_table_is_its_own_environment(tmp_path: Path) -> None:
    own = ('[verifier.environment]\ndocker_image = "grader:1"\nmemory_mb = 1024\n'
           'network_mode = "no-network"\n')
    # a docker_image of its own brings /tests: no tests/test.sh needed; none of the
    # task's [environment] is inherited (Harbor's schema defaults instead)
    d = write_task(tmp_path, "img", toml=RESOURCES + own, test_sh=None,
                   extra={"tests/Dockerfile": "FROM ubuntu:24.04\n"})  # docker_image wins
    task = load_task(d)
    sep = task.separate_verifier
    assert sep is not None and sep.environment is not None
    assert (sep.describe(), sep.file) == ("separate (docker_image grader:1)", "task.toml")
    assert sep.environment == EnvironmentSpec(docker_image="grader:1", memory_mb=1024,
                                              network_mode="no-network")
    assert task.verifier_carry == ("/logs/artifacts",) and task.grader.bundled  # type: ignore[attr-defined]
    # resources only: the task's own image, the verifier's resources, tests/ uploaded
    d = write_task(tmp_path, "res", toml=RESOURCES + "[verifier.environment]\ncpus = 2\n")
    task = load_task(d)
    sep = task.separate_verifier
    assert sep is not None and sep.environment is not None and task.environment is not None
    assert sep.describe() == "separate ([verifier.environment] on the task's image)"
    assert (sep.environment.dockerfile, sep.environment.cpus, sep.environment.workdir) == (
        task.environment.dockerfile, 2.0, None)
    assert not task.grader.bundled  # type: ignore[attr-defined]
    # separate alone: a fresh copy of the task's environment
    task = load_task(write_task(tmp_path, "copy", toml=SEPARATE))
    assert task.separate_verifier == SeparateVerifier()
    assert task.separate_verifier.describe() == (
        "separate (a fresh copy of the task's environment)")


def test_the_bubblewrap_runtime_refuses_a_verifier_image_of_its_own(tmp_path: Path) -> None:
    task = load_task(write_task(tmp_path, "own", toml=SEPARATE, extra={
        "tests/Dockerfile": "FROM ubuntu:24.04\nCOPY . /tests/\n"}))
    runtimes = SandboxRuntimes(sandboxed_runtime, environments=Environments(
        dict(IMAGES), None, tmp_path / "envs"))
    for call in (lambda: runtimes.notes(task), lambda: runtimes.prepare([task])):
        with pytest.raises(HarborTaskError) as e:
            call()
        assert (e.value.task, e.value.file) == ("own", "tests/Dockerfile")
        assert "bubblewrap sandboxes cannot give" in e.value.problem
        assert "--sandbox docker" in e.value.problem
        assert 'rollout.sandbox = "docker"' in e.value.problem
    copy = load_task(write_task(tmp_path, "copy", toml=SEPARATE))  # the task's own image: fine
    assert runtimes.notes(copy) == ["network_mode is 'public': tidal's bubblewrap sandboxes "
                                    "have no network"]


def test_a_steps_directory_is_a_multi_step_task(tmp_path: Path) -> None:
    d = write_task(tmp_path, "multi")
    (d / "steps" / "one").mkdir(parents=True)
    with pytest.raises(HarborTaskError, match=r"'multi': task.toml: a multi-step task"):
        load_task(d)


@pytest.mark.parametrize(("environment", "mode", "hosts"), [
    ("", "public", ()),  # Harbor's default
    ("allow_internet = false", "no-network", ()),
    ("allow_internet = true", "public", ()),
    ('network_mode = "no-network"\nallow_internet = true', "no-network", ()),  # the newer key
    ('network_mode = "allowlist"\nallowed_hosts = ["pypi.org", "*.debian.org"]', "allowlist",
     ("pypi.org", "*.debian.org"))])
def test_the_network_policy_is_read_as_harbor_reads_it(
        tmp_path: Path, environment: str, mode: str, hosts: tuple[str, ...]) -> None:
    task = load_task(write_task(tmp_path, "net", toml=f"[environment]\n{environment}\n"))
    assert task.environment is not None
    assert (task.environment.network_mode, task.environment.allowed_hosts) == (mode, hosts)


ARTIFACTS = 'artifacts = ["/app/out.txt", {source = "/data/", destination = "d"}]\n'


@pytest.mark.parametrize(("artifacts", "verifier", "carry"), [
    ("", "", ()), ("", 'environment_mode = "pristine"', ()),
    ("", 'carry_paths = ["/app", "/data/out"]', ("/app", "/data/out")),
    ("", 'environment_mode = "shared"', None),
    (ARTIFACTS, "", ()),  # artifacts cross only to a separate verifier
    # separate, as Harbor: the declared artifacts and /logs/artifacts, never the workdir
    ("", 'environment_mode = "separate"', ("/logs/artifacts",)),
    (ARTIFACTS, 'environment_mode = "separate"', ("/app/out.txt", "/data", "/logs/artifacts")),
    ('artifacts = ["/logs/artifacts/", {source = "/app/out.txt", service = "main"}]\n',
     'environment_mode = "separate"\ncarry_paths = ["/etc/app.conf"]',
     ("/logs/artifacts", "/app/out.txt", "/etc/app.conf"))])
def test_what_the_verifier_sees_of_the_agent_is_read_from_task_toml(
        tmp_path: Path, artifacts: str, verifier: str, carry: tuple[str, ...] | None) -> None:
    d = write_task(tmp_path, "t", toml=f"{artifacts}[verifier]\n{verifier}\n")
    assert load_task(d).verifier_carry == carry


def test_a_missing_task_toml_and_a_bad_directory_name_are_refused(tmp_path: Path) -> None:
    d = write_task(tmp_path, "no-toml")
    (d / "task.toml").unlink()
    with pytest.raises(HarborTaskError, match=r"'no-toml': task.toml: missing"):
        load_task(d)
    with pytest.raises(HarborTaskError, match="letters, digits"):
        load_task(write_task(tmp_path, "has space"))


def test_a_directory_of_tasks_loads_by_name_and_an_empty_one_is_refused(tmp_path: Path) -> None:
    for name in ("b-task", "a-task"):
        write_task(tmp_path / "set", name)
    (tmp_path / "set" / ".hidden").mkdir()
    (tmp_path / "set" / "notes").mkdir()  # not a task: skipped
    assert [t.task_id for t in load_tasks(tmp_path / "set")] == ["a-task", "b-task"]
    assert [t.task_id for t in load_tasks(tmp_path / "set" / "a-task")] == ["a-task"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="holds no Harbor tasks"):
        load_tasks(tmp_path / "empty")
    with pytest.raises(TaskError, match="does not exist"):
        load_tasks(tmp_path / "nowhere")


# --------------------------------------------------------------------------- rewards


@pytest.mark.parametrize(
    ("txt", "js", "key", "expected"),
    [
        ("0.5\n", None, None, (0.5, {"reward": 0.5}, "reward.txt")),
        ("1", '{"reward": 0.0}', None,
         (0.0, {"reward": 0.0}, "reward.json: reward")),  # reward.json first, as Harbor
        (None, '{"reward": 0.25, "tests_passed": 3}', None,
         (0.25, {"reward": 0.25, "tests_passed": 3}, "reward.json: reward")),
        (None, '{"accuracy": 0.75}', None, (0.75, {"accuracy": 0.75}, "reward.json: accuracy")),
        (None, "0.5", None, (0.5, {"reward": 0.5}, "reward.json: reward")),  # a bare number
        (None, '{"a": 1, "b": 0, "c": 0.5}', None, (0.5, {"a": 1, "b": 0, "c": 0.5},
         "reward.json: the mean of 3 numbers")),  # kept whole, not refused
        (None, '{"a": 1, "b": 0.25}', "b", (0.25, {"a": 1, "b": 0.25}, "reward.json: b")),
        (None, '{"passed": true, "score": 0}', None, (0.5, {"passed": 1.0, "score": 0.0},
         "reward.json: the mean of 2 numbers")),  # a bool is a number, as Harbor reads it
    ],
)
def test_rewards_are_read_from_reward_json_then_reward_txt(
    txt: str | None, js: str | None, key: str | None,
    expected: tuple[float, dict[str, float], str],
) -> None:
    assert read_reward(txt, js, reward_key=key) == expected


@pytest.mark.parametrize(
    ("txt", "js", "message"),
    [
        (None, None, "wrote no reward"),
        ("", None, "reward.txt is empty"),
        ("high", None, "not a number"),
        ("nan", None, "not a finite number"),
        ("inf\n", None, "not a finite number"),
        (None, "", "reward.json is empty"),
        (None, "[1]", "'reward' is [1], not a number"),
        (None, "{bad", "not JSON"),
        (None, '{"reward": "high"}', "not a number"),
        (None, '{"accuracy": 0.5, "note": "x"}', "'note' is 'x', not a number"),  # as Harbor
        (None, '{"reward": NaN}', "not a finite number"),
        (None, "{}", "holds no numbers"),
        ("1", "{bad", "not JSON"),  # a broken reward.json is not passed over for reward.txt
    ],
)
def test_an_unusable_reward_is_a_clear_error(txt: str | None, js: str | None,
                                             message: str) -> None:
    with pytest.raises(RewardError, match=re.escape(message)):
        read_reward(txt, js)


def test_a_reward_key_the_json_lacks_is_a_clear_error() -> None:
    with pytest.raises(RewardError, match=r"no 'score' \(\[verifier\] reward_key\), only "
                       r"\['a', 'b'\]"):
        read_reward(None, '{"a": 1, "b": 2}', reward_key="score")


# --------------------------------------------------------------------------- grading


@pytest.fixture
def app() -> Iterator[ToolRuntime]:
    with sandboxed_runtime(SandboxConfig(workdir="/app", limits=LIMITS)) as rt:
        yield rt


def _verifier(tmp_path: Path, script: str, timeout_s: float = 30.0) -> VerifierScript:
    tests = tmp_path / "tests"
    tests.mkdir(exist_ok=True)
    (tests / "test.sh").write_text(script)
    (tests / "data.txt").write_text("fixture\n")
    return VerifierScript(tests, timeout_s, {"TEST_ENV": "yes"})


def test_test_sh_runs_in_the_sandbox_with_tests_at_slash_tests(
    tmp_path: Path, app: ToolRuntime
) -> None:
    script = ('#!/bin/bash\npwd > /logs/verifier/where.txt\n'
              'cat /tests/data.txt >> /logs/verifier/where.txt\n'
              'echo "$TEST_ENV" >> /logs/verifier/where.txt\n'
              'echo 0.5 > /logs/verifier/reward.txt\necho done\n')
    app.write_file("/logs/verifier/reward.txt", "1")  # planted by the agent: cleared first
    g = _verifier(tmp_path, script).grade(app)
    assert g.error is None and g.reward == 0.5 and g.partial_score == 0.5
    assert g.by_kind == {"tests": 0.5} and not g.success
    assert app.read_file("/logs/verifier/where.txt") == "/app\nfixture\nyes\n"
    assert "done" in g.extra["output"] and g.extra["exit_code"] == 0


@pytest.mark.parametrize(
    ("script", "reward", "error"),
    [
        ('echo \'{"reward": 1.0, "passed": 4}\' > /logs/verifier/reward.json', 1.0, None),
        ("exit 3", None, "wrote no reward (/logs/verifier/reward.txt or reward.json) "
                         "(test.sh exited with 3)"),
        ("echo nan > /logs/verifier/reward.txt", None, "not a finite number"),
        ("sleep 30", None, "did not finish within 1 s"),
    ],
)
def test_what_test_sh_leaves_decides_the_grade(
    tmp_path: Path, app: ToolRuntime, script: str, reward: float | None, error: str | None
) -> None:
    g = _verifier(tmp_path, f"#!/bin/bash\n{script}\n", timeout_s=1.0).grade(app)
    if error is None:
        assert g.error is None and g.reward == reward and g.success
        assert g.extra["rewards"] == {"reward": 1.0, "passed": 4.0}
    else:
        assert g.error is not None and error in g.error and g.reward == 0.0
        assert not g.success and math.isfinite(g.reward)


def test_test_sh_runs_by_its_shebang(tmp_path: Path, app: ToolRuntime) -> None:
    # as Harbor runs it (made executable, then run): a Python test.sh is not fed to bash
    script = ("#!/usr/bin/env python3\nimport json, sys\n"
              "json.dump({'passed': 3, 'total': 4}, open('/logs/verifier/reward.json', 'w'))\n"
              "print(sys.version_info[0])\n")
    g = VerifierScript(_verifier(tmp_path, script).tests, 30.0, reward_key="passed").grade(app)
    assert g.error is None and g.reward == 3.0, g.extra
    assert g.extra["rewards"] == {"passed": 3.0, "total": 4.0}
    assert g.extra["reward_from"] == "reward.json: passed" and "3" in g.extra["output"]


def test_bundled_tests_run_from_the_image_without_an_upload(
        tmp_path: Path, app: ToolRuntime) -> None:
    # a verifier image of its own brings /tests (Harbor uploads no tests/ to it)
    script = "#!/bin/bash\necho 0.25 > /logs/verifier/reward.txt\n"
    bundled = VerifierScript(tmp_path / "no-such-dir", 30.0, bundled=True)
    g = bundled.grade(app)
    assert g.error is not None and "exited with 127" in g.error
    assert "the verifier's image has no /tests/test.sh" in g.extra["output"]
    app.write_file("/tests/test.sh", script)  # as its image would hold it
    g = bundled.grade(app)
    assert g.error is None and g.reward == 0.25


def test_a_tb2_task_builds_grades_untouched_and_after_its_oracle(tmp_path: Path) -> None:
    """The whole path of one task: its Dockerfile (FROM ubuntu:24.04 mapped to the
    default image) built, an episode's sandbox from it, test.sh's partial credit."""
    task = load_task(write_task(tmp_path / "tasks"))
    envs = Environments(IMAGES, None, tmp_path / "cache")
    config = envs.sandbox_config(task, SandboxConfig(limits=LIMITS))
    assert config.workdir == "/app" and config.limits.memory_bytes == 2048 << 20

    def graded(oracle: bool) -> float:
        with sandboxed_runtime(config) as rt:
            prepare(task, rt)
            if oracle:
                assert run_oracle(task, rt) is None
            g = task.grader.grade(rt)
            assert g.error is None, g.error
            return g.reward

    assert graded(False) == 0.0
    assert graded(True) == 1.0
    with sandboxed_runtime(config) as rt:  # partial credit: the file, the wrong text
        rt.write_file("hello.txt", "hi")
        assert task.grader.grade(rt).reward == 0.5


def test_the_verifier_runs_in_what_end_agent_leaves(tmp_path: Path) -> None:
    """`run_task`'s order on a real sandbox: the oracle's answer in /app carried over
    into a fresh sandbox; a hello.txt written outside the carried paths is not; the
    agent's box can no longer be snapshotted; "shared" keeps the same sandbox."""
    task = load_task(write_task(tmp_path / "tasks"))
    config = Environments(IMAGES, None, tmp_path / "cache").sandbox_config(
        task, SandboxConfig(limits=LIMITS))
    with sandboxed_runtime(config) as rt:
        assert isinstance(rt, SandboxRuntime) and rt.can_snapshot
        assert run_oracle(task, rt) is None
        agents = rt.sandbox
        assert rt.end_agent(task.verifier_carry) == "pristine, carrying /app"
        assert agents.closed and not rt.sandbox.closed and not rt.can_snapshot
        with pytest.raises(RuntimeToolError, match="the agent has ended"):
            rt.snapshot(tmp_path / "s.tar")
        assert task.grader.grade(rt).reward == 1.0
    assert rt.sandbox.closed  # the verifier's sandbox closes with the episode
    with sandboxed_runtime(config) as rt:
        assert run_oracle(task, rt) is None
        assert rt.end_agent(["/tmp"]) == "pristine, carrying /tmp"
        assert task.grader.grade(rt).reward == 0.0
    with sandboxed_runtime(config) as rt:
        assert isinstance(rt, SandboxRuntime)
        assert run_oracle(task, rt) is None
        agents = rt.sandbox
        assert rt.end_agent(None) == "shared" and rt.sandbox is agents
        assert task.grader.grade(rt).reward == 1.0


def test_an_unmapped_from_is_refused_with_the_remedy(tmp_path: Path) -> None:
    task: Task = load_task(write_task(tmp_path))
    envs = Environments({}, None, tmp_path / "cache")
    with pytest.raises(TaskError,
                       match=r"task 'hello-world': .*ubuntu:24\.04.*\[environment\] images"):
        envs.sandbox_config(task, SandboxConfig())
    fallback = Environments({}, "default", tmp_path / "cache")
    assert fallback.sandbox_config(task, SandboxConfig()).image is None  # the default image



# --------------------------------------------------------------------------- tool-call solutions


def test_a_tool_call_solution_reads_into_the_tasks_solution(tmp_path: Path) -> None:
    d = write_task(tmp_path, "with-calls")
    (d / "solution" / "tool_calls.json").write_text(json.dumps([
        [{"name": "bash", "arguments": {"command": "echo 'Hello, world!' > hello.txt"}}],
        [{"name": "finish", "arguments": {"answer": "done"}}],
    ]))
    task = load_task(d)
    assert [[(s.name, dict(s.arguments)) for s in turn] for turn in task.solution] == [
        [("bash", {"command": "echo 'Hello, world!' > hello.txt"})],
        [("finish", {"answer": "done"})],
    ]
    assert load_task(write_task(tmp_path, "without")).solution == ()


@pytest.mark.parametrize(("calls", "problem"), [
    ("{", "not valid JSON"),
    ("[]", "non-empty list of turns"),
    ('[{"name": "finish"}]', "turn 0 must be a non-empty list"),
    ('[[{"name": "rm_rf", "arguments": {}}]]', "turn 0 call 0: 'rm_rf' is not a built-in tool"),
    ('[[{"name": "bash", "arguments": {"command": 3}}]]', "arguments must map strings"),
    ('[[{"name": "bash", "args": {}}]]', "name and arguments only"),
    ('[[{"name": "bash", "arguments": {"command": "ls"}}]]', "last turn must be one finish"),
])
def test_a_bad_tool_call_solution_is_refused_naming_the_file(
        tmp_path: Path, calls: str, problem: str) -> None:
    d = write_task(tmp_path, "bad-calls")
    (d / "solution" / "tool_calls.json").write_text(calls)
    with pytest.raises(HarborTaskError) as e:
        load_task(d)
    assert (e.value.task, e.value.file) == ("bad-calls", "solution/tool_calls.json")
    assert problem in e.value.problem, e.value.problem


def test_a_directory_with_train_and_heldout_loads_as_a_split_set(tmp_path: Path) -> None:
    for split, name in (("train", "a-task"), ("train", "b-task"), ("heldout", "c-task")):
        write_task(tmp_path / "set" / split, name)
    ts = load_split(tmp_path / "set")
    assert ts is not None
    assert [t.task_id for t in ts.train] == ["a-task", "b-task"]
    assert [t.task_id for t in ts.heldout] == ["c-task"]
    assert [p.name for p in task_dirs(tmp_path / "set")] == ["a-task", "b-task", "c-task"]
    assert load_split(tmp_path / "set" / "train") is None
