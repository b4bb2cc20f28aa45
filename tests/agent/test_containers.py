"""The container runtime against the real engine on this machine (podman's Docker API,
`.ci/podman.sh`): commands, limits, files, snapshots, the agent's end, and a Harbor task
built from its Dockerfile and graded by its own test.sh. Every container and image a
test makes is removed; the module is skipped when no engine answers."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import docker
import docker.errors
import pytest

from tests.agent.harbor_tasks import VERIFIER_DOCKERFILE, write_separate_task, write_task
from tidal.agent.containers import (
    SNAPSHOT_REPO,
    ContainerEnvironments,
    ContainerError,
    ContainerRuntime,
    ContainerRuntimes,
    ContainerSpec,
    connect,
    container_runtime,
    from_references,
    read_snapshot,
    remove_snapshot,
    spec_for,
)
from tidal.agent.harbor import HarborTaskError, load_task, run_oracle
from tidal.agent.runtime import RuntimeToolError, ToolRuntime
from tidal.agent.tasks import EnvironmentSpec, FileChecks, FileExists, Task, prepare
from tidal.sandbox.types import ExecStatus, ReplayDivergenceError

BASE = "localhost/tidal-base:bookworm"  # .ci/podman.sh's image: Debian, python3, procps

try:
    CLIENT = connect()
except ContainerError as _e:
    pytest.skip(f"no container engine answers ({_e})", allow_module_level=True)
try:
    CLIENT.images.get(BASE)
except docker.errors.ImageNotFound:
    pytest.skip(f"the engine has no {BASE}: run .ci/podman.sh", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the container runtime kills timed-out commands by host pid: needs root",
                allow_module_level=True)

RUN = uuid.uuid4().hex[:12]  # this test run's label, to find what it left
LABELS = {"tidal.test": RUN}


def spec(**changes: object) -> ContainerSpec:
    return replace(ContainerSpec(BASE, memory_mb=256, labels=LABELS), **changes)  # type: ignore[arg-type]


def leftovers() -> list[str]:
    return [c.id for c in CLIENT.containers.list(
        all=True, filters={"label": ["tidal=1", f"tidal.test={RUN}"]})]


@pytest.fixture(scope="module", autouse=True)
def cleanup() -> Iterator[None]:
    """Whatever a failed test left: its containers, the FROM tag the builds made."""
    had_ubuntu = _has("ubuntu:24.04")
    yield
    for cid in leftovers():
        CLIENT.api.remove_container(cid, force=True)
    if not had_ubuntu and _has("ubuntu:24.04"):
        CLIENT.images.remove("ubuntu:24.04")  # a tag only: the base image stays


def _has(ref: str) -> bool:
    try:
        CLIENT.images.get(ref)
    except docker.errors.ImageNotFound:
        return False
    return True


@pytest.fixture
def rt() -> Iterator[ContainerRuntime]:
    with container_runtime(spec(env={"FROM_SPEC": "s"}), CLIENT) as runtime:
        yield runtime


def sh(runtime: ToolRuntime, command: str, timeout_s: float = 30.0) -> str:
    r = runtime.exec(command, timeout_s)
    assert r.exit_code == 0, r
    return r.stdout


def test_a_runtime_is_a_tool_runtime(rt: ContainerRuntime) -> None:
    assert isinstance(rt, ToolRuntime)
    assert rt.can_snapshot


def test_exec_runs_in_the_workdir_with_the_variables(rt: ContainerRuntime) -> None:
    r = rt.exec("pwd; echo $FROM_SPEC $EXTRA; echo oops >&2; exit 3", 10, env={"EXTRA": "e"})
    assert (r.stdout, r.stderr, r.exit_code) == ("/app\ns e\n", "oops\n", 3)
    assert r.status is ExecStatus.NONZERO_EXIT and not r.truncated
    ok = rt.exec("echo hi", 10)
    assert ok.ok and ok.stdout == "hi\n" and ok.exit_code == 0
    missing = rt.exec("no-such-command", 10)
    assert missing.exit_code == 127 and "not found" in missing.stderr
    with pytest.raises(RuntimeToolError, match="timeout_s"):
        rt.exec("true", 0)
    with pytest.raises(RuntimeToolError, match="non-empty"):
        rt.exec("  ", 10)


def test_a_timeout_kills_the_command_and_its_children(rt: ContainerRuntime) -> None:
    t0 = time.monotonic()
    r = rt.exec("sleep 60 & setsid sleep 61 & sleep 62; echo never", 1.0)
    assert time.monotonic() - t0 < 4.0
    assert r.status is ExecStatus.TIMEOUT and r.exit_code == 124 and r.timed_out
    assert "wall-clock limit" in r.stderr and "never" not in r.stdout
    # its children too, the one that left its process group (setsid) included
    left = rt.exec("pgrep -f 'sleep 6[012]' || true", 10)
    assert left.stdout == "", left
    assert rt.exec("echo alive", 10).stdout == "alive\n"


def test_output_past_the_limit_is_cut_and_the_command_killed() -> None:
    with container_runtime(spec(), CLIENT, output_bytes=1000) as small:
        r = small.exec("yes | head -c 5000000; sleep 30", 20)
    assert r.status is ExecStatus.OUTPUT_TRUNCATED and r.truncated
    assert r.stdout.startswith("y\ny\n") and "output truncated at 1000 bytes" in r.stdout
    assert len(r.stdout) < 1200 and r.duration_s < 10


def test_the_file_api(rt: ContainerRuntime) -> None:
    with pytest.raises(FileNotFoundError):
        rt.read_file("nope.txt")
    rt.write_file("a/b/c.txt", "nested\n")  # relative: under the working directory
    rt.write_file("/etc/tidal/x.conf", "abs")
    assert rt.read_file("/app/a/b/c.txt") == "nested\n"
    assert rt.read_file("/etc/tidal/x.conf") == "abs"
    rt.write_file("top.txt", "1")
    assert rt.list("/app") == ["a/", "top.txt"]
    assert rt.list("a/b") == ["c.txt"]
    with pytest.raises(RuntimeToolError, match="directory"):
        rt.read_file("a")
    with pytest.raises(RuntimeToolError, match="directory"):
        rt.write_file("a", "would replace the directory")
    assert rt.read_file("a/b/c.txt") == "nested\n"  # still there
    with pytest.raises(FileNotFoundError):
        rt.list("missing")
    with pytest.raises(RuntimeToolError, match="not a directory"):
        rt.list("top.txt")
    # a link is followed both ways, and an existing file keeps its mode
    sh(rt, "printf old > real.sh && chmod 755 real.sh && ln -s real.sh link.sh")
    assert rt.read_file("link.sh") == "old"
    rt.write_file("link.sh", "new")
    assert sh(rt, "cat real.sh; test -L link.sh && test -x real.sh && echo ' ok'") == "new ok\n"
    sh(rt, "touch '.hidden' 'with space'")
    assert {".hidden", "with space", "link.sh"} <= set(rt.list("."))


def test_upload_keeps_modes_and_stays_in_the_tree(rt: ContainerRuntime, tmp_path: Path) -> None:
    tree = tmp_path / "tests"
    (tree / "sub").mkdir(parents=True)
    (tree / "empty").mkdir()
    (tree / "test.sh").write_text("#!/bin/sh\necho ran\n")
    (tree / "test.sh").chmod(0o755)
    (tree / "sub" / "data.txt").write_text("data")
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    (tree / "inside").symlink_to(tree / "sub" / "data.txt")
    (tree / "outside").symlink_to(secret)
    rt.upload(tree, "/tmp/up")
    assert sh(rt, "/tmp/up/test.sh") == "ran\n"
    assert rt.read_file("/tmp/up/inside") == "data"
    assert rt.list("/tmp/up") == ["empty/", "inside", "sub/", "test.sh"]  # no "outside"
    rt.upload(tree / "test.sh", "/usr/local/bin/t")
    assert sh(rt, "t") == "ran\n"
    with pytest.raises(FileNotFoundError):
        rt.upload(tmp_path / "missing", "/tmp/x")


def test_no_network_means_none() -> None:
    probe = ("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), 2)\"")
    with container_runtime(spec(network="none"), CLIENT) as runtime:
        r = runtime.exec(probe, 20)
    assert r.exit_code == 1 and "unreachable" in r.stderr


def test_the_memory_limit_kills_a_memory_hog() -> None:
    with container_runtime(spec(memory_mb=64), CLIENT) as runtime:
        r = runtime.exec("python3 -c \"x = 'a' * (400 << 20)\"", 30)
        assert r.exit_code == 137, r
        assert r.status is ExecStatus.MEMORY and "memory limit" in r.stderr
        assert runtime.exec("echo alive", 10).stdout == "alive\n"


def _snapshot_images() -> set[str]:
    return {i.id for i in CLIENT.images.list(name=SNAPSHOT_REPO)}


def test_a_snapshot_restores_the_files_and_replays_its_log_once(tmp_path: Path) -> None:
    snap = tmp_path / "snap" / "container.json"
    before = _snapshot_images()
    with container_runtime(spec(env={"KEEP": "k"}), CLIENT) as runtime:
        runtime.write_file("work.txt", "kept")
        sh(runtime, "echo once >> log.txt; sleep 300 >/dev/null 2>&1 &")
        with pytest.raises(FileNotFoundError):
            runtime.read_file("missing.txt")
        runtime.snapshot(snap)
    try:
        back = ContainerRuntime.restore(snap, CLIENT)
        try:
            assert back.replay_pending == 3
            # the same operations again: answered from the log, nothing runs twice
            back.write_file("work.txt", "kept")
            again = back.exec("echo once >> log.txt; sleep 300 >/dev/null 2>&1 &", 30)
            assert again.replayed and again.exit_code == 0
            with pytest.raises(FileNotFoundError):
                back.read_file("missing.txt")
            assert back.replay_pending == 0
            # then live, on the committed files
            assert back.read_file("/app/work.txt") == "kept"
            assert back.read_file("log.txt") == "once\n"
            assert sh(back, "echo $KEEP; pwd") == "k\n/app\n"
            assert back.exec("pgrep -f 'sleep 30[0]'", 10).exit_code == 1  # processes are not kept
            assert back.pristine.image == BASE  # the verifier's image is still the task's
            back.snapshot(snap)  # a restored runtime snapshots again, its whole log kept
            assert len(read_snapshot(snap)["log"]) == 7  # type: ignore[arg-type]
        finally:
            back.close()
        # the first image stays while the restored container ran from it (a new
        # snapshot at the path removes only unused ones); remove_snapshot takes both
        assert len(_snapshot_images() - before) == 2
    finally:
        remove_snapshot(snap, CLIENT)
    assert not snap.exists() and _snapshot_images() == before
    with pytest.raises(ContainerError, match="cannot read"):
        ContainerRuntime.restore(snap, CLIENT)


def test_a_restored_runtime_refuses_an_operation_off_its_log(tmp_path: Path) -> None:
    snap = tmp_path / "snap.json"
    with container_runtime(spec(), CLIENT) as runtime:
        sh(runtime, "echo a > a.txt")
        runtime.snapshot(snap)
    try:
        with contextlib.closing(ContainerRuntime.restore(snap, CLIENT)) as back, \
                pytest.raises(ReplayDivergenceError, match=r"echo a > a\.txt"):
            back.exec("echo b > b.txt", 10)
    finally:
        remove_snapshot(snap, CLIENT)


def test_a_snapshot_waits_for_a_running_command(tmp_path: Path) -> None:
    """A command running when the snapshot is asked for ends first, and is in the log:
    the committed files and the log agree."""
    snap = tmp_path / "snap.json"
    with container_runtime(spec(), CLIENT) as runtime:
        worker = threading.Thread(target=sh, args=(runtime, "sleep 1; echo done > slow.txt"))
        worker.start()
        time.sleep(0.3)
        runtime.snapshot(snap)
        worker.join()
    try:
        log = read_snapshot(snap)["log"]
        assert [e["args"]["command"] for e in log] == [  # type: ignore[index, union-attr]
            "sleep 1; echo done > slow.txt"]
        with contextlib.closing(ContainerRuntime.restore(snap, CLIENT)) as back:
            back.exec("sleep 1; echo done > slow.txt", 10)  # replayed
            assert back.read_file("slow.txt") == "done\n"
    finally:
        remove_snapshot(snap, CLIENT)


@pytest.fixture(scope="module")
def app_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An image with a file in /app (built by ContainerEnvironments, removed after)."""
    root = tmp_path_factory.mktemp("app-image")
    (root / "Dockerfile").write_text(
        f"FROM {BASE}\nRUN mkdir -p /app && echo orig > /app/orig.txt\nWORKDIR /app\n")
    task = _env_task("app-image", EnvironmentSpec(dockerfile=root / "Dockerfile", context=root))
    ref = ContainerEnvironments(CLIENT).image(task)
    yield ref
    CLIENT.images.remove(ref, force=True)


def _env_task(task_id: str, env: EnvironmentSpec | None) -> Task:
    return Task(task_id, "do it", FileChecks((FileExists("x"),)), environment=env)


def test_end_agent_pristine_carries_only_the_workdir(app_image: str) -> None:
    with container_runtime(spec(image=app_image), CLIENT) as runtime:
        old = runtime.container_id
        runtime.write_file("new.txt", "agent's")
        runtime.write_file("/usr/local/bin/helper", "#!/bin/sh\necho sneaky\n")
        sh(runtime, "rm /app/orig.txt && sleep 300 >/dev/null 2>&1 &")
        assert runtime.end_agent(()) == "pristine, carrying /app"
        assert not runtime.can_snapshot
        assert runtime.container_id != old and old not in leftovers()
        assert runtime.list("/app") == ["new.txt"]  # the deletion carried over too
        with pytest.raises(FileNotFoundError):
            runtime.read_file("/usr/local/bin/helper")
        assert runtime.exec("pgrep -f 'sleep 30[0]'", 10).exit_code == 1
        with pytest.raises(RuntimeToolError, match="agent has ended"):
            runtime.snapshot(Path("/tmp/never.json"))


def test_end_agent_shared_keeps_files_and_kills_processes(rt: ContainerRuntime) -> None:
    rt.write_file("/usr/local/bin/helper", "kept")
    sh(rt, "sleep 300 >/dev/null 2>&1 & (setsid sleep 301 >/dev/null 2>&1 &)")
    assert rt.exec("pgrep -fc 'sleep 30[01]'", 10).stdout == "2\n"
    assert rt.end_agent(None) == "shared"
    assert rt.exec("pgrep -f 'sleep 30[01]'", 10).exit_code == 1
    assert rt.read_file("/usr/local/bin/helper") == "kept"
    assert sh(rt, "echo still") == "still\n"


def test_a_harbor_task_builds_once_and_grades_as_harbor_does(tmp_path: Path) -> None:
    # FROM ubuntu:24.04, WORKDIR /app; a context file of this run's own, so that the first
    # build is one whatever an earlier run (or `tidal tasks check`) left in the engine
    task = load_task(write_task(tmp_path, extra={"environment/run.txt": RUN}))
    assert task.environment is not None and task.oracle is not None
    envs = ContainerEnvironments(CLIENT, images={"ubuntu:24.04": BASE})
    t0 = time.monotonic()
    assert envs.prepare([task]) == 1
    built_s = time.monotonic() - t0
    image = envs.image(task)
    try:
        s = replace(envs.spec(task), labels=LABELS)
        assert (s.workdir, s.memory_mb, s.cpus, s.network) == ("/app", 2048, 1.0, "bridge")
        assert any("storage_mb = 10240 is not enforced" in n for n in s.notes)
        with container_runtime(s, CLIENT) as runtime:
            prepare(task, runtime)
            runtime.end_agent(task.verifier_carry)
            untouched = task.grader.grade(runtime)
        assert untouched.error is None and untouched.reward < 1.0
        with container_runtime(s, CLIENT) as runtime:
            prepare(task, runtime)
            assert run_oracle(task, runtime) is None
            runtime.end_agent(task.verifier_carry)
            graded = task.grader.grade(runtime)
        assert graded.error is None and graded.reward == 1.0, graded
        again = ContainerEnvironments(CLIENT, images={"ubuntu:24.04": BASE})
        t0 = time.monotonic()
        assert again.prepare([task]) == 0 and again.image(task) == image  # the cache
        assert time.monotonic() - t0 < built_s
    finally:
        CLIENT.images.remove(image, force=True)


SEPARATE = 'artifacts = ["/app/out.txt"]\n[verifier]\nenvironment_mode = "separate"\n'


def test_a_separate_verifier_starts_from_its_own_image_even_after_a_restore(
        tmp_path: Path) -> None:
    # tests/Dockerfile with a context file of this run's own: its build is this test's
    task = load_task(write_separate_task(tmp_path, "sep", toml=SEPARATE, own_image=True, extra={
        "tests/Dockerfile": VERIFIER_DOCKERFILE, "tests/run.txt": RUN}))
    runtimes = ContainerRuntimes(ContainerEnvironments(CLIENT, images={"ubuntu:24.04": BASE}))
    assert runtimes.prepare([task]) == 1  # the verifier's image, before any episode
    image = runtimes.environments.verifier_image(task)
    snap = tmp_path / "snap.json"
    try:
        assert runtimes.environments.image(task) != image
        with runtimes.runtime(task) as rt:
            assert (rt.spec.image, rt.pristine.image) == (runtimes.environments.image(task),
                                                          image)
            assert run_oracle(task, rt) is None
            rt.snapshot(snap)  # preempted: the episode goes on elsewhere
        with runtimes.restored(task, snap) as rt:
            assert rt.pristine.image == image  # kept by the snapshot
            assert run_oracle(task, rt) is None  # replayed from its log
            assert rt.end_agent(task.verifier_carry) == (
                "separate (tests/Dockerfile), carrying /app/out.txt, /logs/artifacts")
            assert rt.spec.image == image and rt.list("/app") == ["out.txt"]
            assert rt.read_file("/logs/artifacts/run.log") == "ran\n"
            graded = task.grader.grade(rt)
        assert graded.error is None and graded.reward == 1.0, graded
    finally:
        runtimes.discard(snap)
        CLIENT.images.remove(image, force=True)


def test_a_broken_verifier_image_stops_prepare_naming_its_file(tmp_path: Path) -> None:
    task = load_task(write_separate_task(tmp_path, "sep", toml=SEPARATE, extra={
        "tests/Dockerfile": f"FROM {BASE}\nRUN echo boom-{RUN} && exit 3\n"}))
    envs = ContainerEnvironments(CLIENT, images={"ubuntu:24.04": BASE})
    with pytest.raises(HarborTaskError) as e:
        envs.prepare([task])
    assert (e.value.task, e.value.file) == ("sep", "tests/Dockerfile")
    assert e.value.problem.startswith("the build failed") and f"boom-{RUN}" in e.value.problem
    unmapped = load_task(write_separate_task(tmp_path, "img", toml=(
        '[verifier.environment]\ndocker_image = "tidal-test/never-pulled:1"\n')))
    with pytest.raises(HarborTaskError, match=r"'img': task.toml: docker_image: "
                       r"tidal-test/never-pulled:1 is not in the engine"):
        envs.verifier_image(unmapped)


def test_a_failing_run_quotes_the_build_log(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text(f"FROM {BASE}\nRUN echo boom-{RUN} && exit 3\n")
    task = _env_task("broken", EnvironmentSpec(dockerfile=tmp_path / "Dockerfile",
                                              context=tmp_path))
    with pytest.raises(ContainerError, match=f"task 'broken'.*the build failed(.|\n)*boom-{RUN}"):
        ContainerEnvironments(CLIENT).image(task)


def test_an_unmapped_missing_base_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM tidal-test/never-pulled:1\nRUN true\n")
    task = _env_task("unmapped", EnvironmentSpec(dockerfile=tmp_path / "Dockerfile",
                                                context=tmp_path))
    with pytest.raises(ContainerError, match=r"tidal-test/never-pulled:1 is not in the engine"
                                             r".*--image tidal-test/never-pulled:1=IMAGE"):
        ContainerEnvironments(CLIENT).image(task)
    image_task = _env_task("image", EnvironmentSpec(docker_image="tidal-test/never-pulled:1"))
    assert ContainerEnvironments(
        CLIENT, images={"tidal-test/never-pulled:1": BASE}).image(image_task) == BASE


def test_a_no_network_build_has_no_network(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text(
        f"FROM {BASE}\nRUN python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), "
        "2)\"\n")
    task = _env_task("offline", EnvironmentSpec(dockerfile=tmp_path / "Dockerfile",
                                               context=tmp_path))
    with pytest.raises(ContainerError, match="unreachable"):
        ContainerEnvironments(CLIENT, build_network="none").image(task)


def test_the_spec_maps_a_task_and_refuses_an_allowlist() -> None:
    task = _env_task("t", EnvironmentSpec(env={"A": "1"}, memory_mb=10, cpus=512.0,
                                          network_mode="no-network"))
    s = spec_for(task, BASE, CLIENT)
    assert s.workdir == "/app" and s.env["A"] == "1" and s.env["PATH"].startswith("/usr")
    assert s.memory_mb == 64 and s.cpus == os.cpu_count() and s.network == "none"
    assert any("capped" in n for n in s.notes)
    allow = _env_task("t", EnvironmentSpec(network_mode="allowlist", allowed_hosts=("pypi.org",)))
    with pytest.raises(ContainerError, match='network_mode = "allowlist" is not supported'):
        spec_for(allow, BASE, CLIENT)
    with pytest.raises(ContainerError, match="network"):
        ContainerSpec(BASE, network="host")
    assert from_references("ARG V=3.12\nFROM python:${V} AS b\nFROM b\nFROM scratch\n") == [
        "python:3.12"]


def test_closing_removes_the_container() -> None:
    runtime = ContainerRuntime(spec(), CLIENT)
    assert runtime.container_id in leftovers()
    runtime.close()
    runtime.close()  # idempotent
    assert leftovers() == []
    with pytest.raises(ContainerError, match="closed"):
        runtime.exec("true", 5)
    with pytest.raises(RuntimeError), container_runtime(spec(), CLIENT):
        raise RuntimeError("a failing episode")
    assert leftovers() == []


def test_a_missing_engine_or_image_is_named() -> None:
    with pytest.raises(ContainerError, match=r"does not answer.*\.ci/podman\.sh"):
        connect("unix:///nonexistent/engine.sock")
    with pytest.raises(ContainerError, match="no image 'tidal-test/absent:1'"):
        ContainerRuntime(spec(image="tidal-test/absent:1"), CLIENT)
