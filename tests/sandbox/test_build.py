"""Building a Dockerfile into a cached read-only layer, and episodes on it (real
sandboxes): files, deletions, ENV and WORKDIR reach the episode; episodes keep their own
writable layers; the cache key follows the content; a hit does no work."""

from __future__ import annotations

import hashlib
import io
import pickle
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from tidal.sandbox import ImageError, Sandbox, SandboxConfig
from tidal.sandbox.build import (
    BuildError,
    Environment,
    build_environment,
    image_environment,
    resolve_base,
)
from tidal.sandbox.dockerfile import REMEDY_UNMAPPED, DockerfileError

from .conftest import SMALL

DOCKERFILE = """\
FROM tidal/default
WORKDIR /app
ENV GREETING="hello there" MODE=test
COPY src ./src/
COPY --chmod=755 tool.sh /usr/local/bin/tool
RUN echo "$GREETING from $(pwd)" > made.txt && date +%s%N >> /built-at \\
    && rm /etc/hostname && rm -rf /etc/skel && mkdir /etc/skel && echo new > /etc/skel/only
RUN ["python3", "-c", "import os; open('exec.txt', 'w').write(os.environ['MODE'])"]
SHELL ["/bin/bash", "-c"]
RUN [[ -n "$BASH_VERSION" ]] && echo bash > shell.txt
"""


def write_context(root: Path, dockerfile: str = DOCKERFILE) -> Path:
    (root / "src" / "pkg" / "empty").mkdir(parents=True)
    (root / "src" / "main.py").write_text("print('main')\n")
    (root / "src" / "pkg" / "mod.py").write_text("X = 1\n")
    (root / "src" / "link").symlink_to("main.py")
    (root / "tool.sh").write_text("#!/bin/sh\necho tool ran\n")
    (root / "unrelated.txt").write_text("not copied\n")
    (root / "Dockerfile").write_text(dockerfile)
    return root / "Dockerfile"


def build(dockerfile: Path, state_dir: Path, *, images: Mapping[str, str] | None = None,
          fallback: str | None = None, cache: Path | None = None) -> Environment:
    return build_environment(dockerfile, context=dockerfile.parent, images=images or {},
                             fallback=fallback, cache_dir=cache or dockerfile.parent / "cache",
                             state_dir=str(state_dir))


def episode(env: Environment, state_dir: Path, **fields: object) -> Sandbox:
    cfg = SandboxConfig(image=env.image, layers=env.layers, workdir=env.workdir or "/",
                        env=env.env, limits=SMALL, state_dir=str(state_dir))
    return Sandbox(cfg, **fields)


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        h.update(f"{p.relative_to(root)} {st.st_mode} {st.st_size} {st.st_mtime_ns}\n".encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def built(tmp_path: Path, state_dir: Path) -> tuple[Path, Environment]:
    df = write_context(tmp_path / "task")
    return df, build(df, state_dir)


def test_episode_sees_the_built_environment(built: tuple[Path, Environment],
                                            state_dir: Path) -> None:
    _, env = built
    assert env.built and env.image is None and len(env.layers) == 1
    assert env.workdir == "/app" and dict(env.env) == {"GREETING": "hello there", "MODE": "test"}
    layer = Path(env.layers[0])
    assert sorted(p.name for p in layer.iterdir()) == ["root", "usr"]
    assert (layer.parent / "meta.json").is_file() and (layer.parent / "build.log").is_file()
    with episode(env, state_dir) as sb:
        r = sb.exec("pwd; echo $GREETING/$MODE; cat made.txt; echo; cat exec.txt shell.txt; tool; "
                    "find src | sort; stat -c %a /usr/local/bin/tool; readlink src/link; "
                    "cat src/link")
        assert r.ok, r.stderr
        assert r.stdout.splitlines() == [
            "/app", "hello there/test", "hello there from /app", "", "testbash", "tool ran",
            "src", "src/link", "src/main.py", "src/pkg", "src/pkg/empty", "src/pkg/mod.py",
            "755", "main.py", "print('main')"]
        # deleted in the build: a whiteout in the layer hides the image's file; a
        # recreated directory is opaque (the image's /etc/skel files stay hidden)
        r = sb.exec("test -e /etc/hostname; echo $?; ls -A /etc/skel; ls /etc/passwd")
        assert r.stdout.splitlines() == ["1", "only", "/etc/passwd"]
        assert sb.read_text("src/pkg/mod.py") == "X = 1\n"  # the file API sees the layer


def test_episodes_get_their_own_writable_layer(built: tuple[Path, Environment],
                                               state_dir: Path) -> None:
    _, env = built
    layer = Path(env.layers[0])
    before = tree_digest(layer)
    with episode(env, state_dir) as a, episode(env, state_dir) as b:
        assert a.exec("echo a > made.txt; rm src/main.py; echo new > mine.txt").ok
        assert b.exec("cat made.txt; ls src; test -e mine.txt || echo absent").stdout == (
            "hello there from /app\nlink\nmain.py\npkg\nabsent\n")
        assert a.read_text("made.txt") == "a\n"
    assert tree_digest(layer) == before


def test_second_build_is_a_cache_hit_that_does_no_work(built: tuple[Path, Environment],
                                                       state_dir: Path) -> None:
    df, first = built
    entry = Path(first.layers[0]).parent
    stamp = entry / "layer" / "root" / "built-at"
    written = {p.name: p.stat().st_mtime_ns for p in entry.iterdir()}
    t0 = time.monotonic()
    again = build(df, state_dir)
    took = time.monotonic() - t0
    assert not again.built and again.key == first.key and again.layers == first.layers
    assert took < 1.0 and again.seconds <= took  # ~2 ms here: hashing the copied files
    assert len(stamp.read_text().splitlines()) == 1  # the RUN ran once
    assert {p.name: p.stat().st_mtime_ns for p in entry.iterdir()} == written


def test_key_follows_copied_content_not_the_rest(built: tuple[Path, Environment],
                                                 state_dir: Path) -> None:
    df, first = built
    ctx = df.parent
    (ctx / "unrelated.txt").write_text("edited\n")
    assert build(df, state_dir).key == first.key
    (ctx / "src" / "main.py").write_text("print('changed')\n")
    changed = build(df, state_dir)
    assert changed.built and changed.key != first.key
    with episode(changed, state_dir) as sb:
        assert sb.read_text("src/main.py") == "print('changed')\n"
    (ctx / "tool.sh").chmod(0o700)  # --chmod decides the mode: same key
    assert build(df, state_dir).key == changed.key
    df.write_text(DOCKERFILE.replace("MODE=test", "MODE=prod"))  # an instruction
    assert build(df, state_dir).key not in (first.key, changed.key)


def test_failing_run_names_line_and_exit_code(tmp_path: Path, state_dir: Path) -> None:
    df = tmp_path / "Dockerfile"
    df.write_text("FROM tidal/default\nENV X=1\n\nRUN echo before && echo oops >&2 && exit 3\n")
    with pytest.raises(BuildError) as e:
        build(df, state_dir)
    err = e.value
    assert (err.file, err.line) == (str(df), 4)
    assert "exit code 3" in str(err) and "before" in err.output and "oops" in err.output
    assert "without network" in err.remedy and str(err).startswith(f"{df} line 4: RUN ")
    assert err.log is not None and "oops" in Path(err.log).read_text()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # nothing cached


def test_unmapped_from(tmp_path: Path, state_dir: Path) -> None:
    df = tmp_path / "Dockerfile"
    df.write_text("# base\nFROM python:3.12-slim\nENV X=1\nRUN echo $X > /x\n")
    with pytest.raises(DockerfileError) as e:
        build(df, state_dir)
    assert e.value.line == 2 and e.value.remedy == REMEDY_UNMAPPED
    assert "'python:3.12-slim' is not mapped" in str(e.value)
    env = build(df, state_dir, fallback="default")
    assert env.image is None and env.built
    with episode(env, state_dir) as sb:
        assert sb.exec("cat /x").stdout == "1\n"


def test_a_declared_default_image_stands_in_where_nothing_maps_the_from(
        tmp_path: Path, state_dir: Path) -> None:
    """`LABEL tidal.image="default"`: the default image, in the layer `FROM tidal/default`
    builds (the same key), named in `declared_for`; a mapping of the run still wins. The
    same FROM without the label is refused, or built on the fallback as a fallback."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.py").write_text("print('main')\n")
    body = "WORKDIR /app\nCOPY src/ /app/\n"
    df = tmp_path / "Dockerfile"
    df.write_text(f'FROM python:3.11-slim-bookworm\nLABEL tidal.image="default"\n{body}')
    env = build(df, state_dir)
    assert (env.image, env.declared_for, env.fallback_for) == (
        None, "python:3.11-slim-bookworm", None)
    with episode(env, state_dir) as sb:
        assert sb.exec("python3 /app/main.py").stdout == "main\n"
    old = tmp_path / "old" / "Dockerfile"
    old.parent.mkdir()
    old.write_text(f"FROM tidal/default\n{body}")
    before = build_environment(old, context=tmp_path, images={}, fallback=None,
                               cache_dir=tmp_path / "cache", state_dir=str(state_dir))
    assert (before.key, before.layers, before.built) == (env.key, env.layers, False)
    mapped = build(df, state_dir, images={"python:3.11-slim-bookworm": "default"},
                   fallback=str(tmp_path))
    assert (mapped.image, mapped.declared_for, mapped.fallback_for) == (None, None, None)
    df.write_text(f"FROM python:3.11-slim-bookworm\n{body}")  # a third party's: no label
    with pytest.raises(DockerfileError, match=r"'python:3\.11-slim-bookworm' is not mapped"):
        build(df, state_dir)
    fell_back = build(df, state_dir, fallback="default")
    assert (fell_back.declared_for, fell_back.fallback_for) == (None, "python:3.11-slim-bookworm")


def test_resolve_base(tmp_path: Path) -> None:
    img = tmp_path / "img"
    img.mkdir()
    images = {"ubuntu": str(img), "exact:1.0": "default", "localhost:5000/app": str(img)}
    assert resolve_base("ubuntu:24.04", images, None) == str(img)
    assert resolve_base("ubuntu@sha256:" + "0" * 64, images, None) == str(img)
    assert resolve_base("exact:1.0", images, None) is None
    assert resolve_base("localhost:5000/app:v2", images, None) == str(img)
    assert resolve_base("tidal/default", {}, None) is None
    assert resolve_base("other", images, str(img)) == str(img)
    assert resolve_base("other", images, "default") is None
    with pytest.raises(DockerfileError, match="does not exist"):
        resolve_base("x", {"x": str(tmp_path / "missing")}, None, file="D", line=3)
    # a Dockerfile's LABEL tidal.image="default": before the fallback, after the mapping
    assert resolve_base("python:3.11-slim-bookworm", {}, None, declared_default=True) is None
    assert resolve_base("python:3.11", {}, str(img), declared_default=True) is None
    assert resolve_base("ubuntu:24.04", images, None, declared_default=True) == str(img)
    with pytest.raises(DockerfileError, match="not mapped"):
        resolve_base("python:3.11-slim-bookworm", {}, None)


def test_user_image_directory_as_base(tmp_path: Path, image: Path, state_dir: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "conf").mkdir(parents=True)
    (ctx / "conf" / "app.ini").write_text("[app]\n")
    (ctx / "Dockerfile").write_text("FROM myorg/base:1\nWORKDIR /srv\nCOPY conf/ ./\n")
    env = build(ctx / "Dockerfile", state_dir, images={"myorg/base": str(image)})
    assert env.image == str(image.resolve()) and env.built
    assert sorted(p.name for p in Path(env.layers[0]).iterdir()) == ["root"]
    with episode(env, state_dir) as sb:  # the image has no shell: the file API
        assert sb.read_text("/srv/app.ini") == "[app]\n"
        assert sb.read_text("/data/hello.txt") == "hello from the image\n"


def test_copy_semantics(tmp_path: Path, state_dir: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "logs").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "c.md", "secret.txt", "logs/x.log", "logs/keep.log"):
        (ctx / name).write_text(name)
    (ctx / ".dockerignore").write_text("# comment\nsecret.txt\nlogs/*.log\n!logs/keep.log\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in (("pkg/README", b"readme"), ("pkg/bin/run", b"#!/bin/sh\n")):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tf.addfile(info, io.BytesIO(data))
    (ctx / "pkg.tar.gz").write_bytes(buf.getvalue())
    (ctx / "Dockerfile").write_text(
        "FROM tidal/default\nCOPY *.txt /globbed/\nCOPY a.txt c.md /multi/\n"
        "COPY a.txt /renamed.txt\nCOPY . /all\nADD pkg.tar.gz /opt/\nCOPY pkg.tar.gz /kept/\n"
        "COPY c.md /etc\n")
    env = build(ctx / "Dockerfile", state_dir)
    with episode(env, state_dir) as sb:
        r = sb.exec("cd /; find globbed multi renamed.txt all opt kept etc/c.md -type f | sort; "
                    "stat -c %a opt/pkg/bin/run")
        assert r.stdout.split() == [
            "all/.dockerignore", "all/Dockerfile", "all/a.txt", "all/b.txt", "all/c.md",
            "all/logs/keep.log", "all/pkg.tar.gz", "etc/c.md", "globbed/a.txt", "globbed/b.txt",
            "kept/pkg.tar.gz", "multi/a.txt", "multi/c.md", "opt/pkg/README", "opt/pkg/bin/run",
            "renamed.txt", "755"]  # secret.txt and logs/x.log excluded
    (ctx / "secret.txt").write_text("edited, but ignored")
    assert build(ctx / "Dockerfile", state_dir).key == env.key


@pytest.mark.parametrize(("setup", "dockerfile", "problem"), [
    (lambda c: None, "COPY missing.txt /x", "'missing.txt' is not in the build context"),
    (lambda c: (c / "out").symlink_to("/etc"), "COPY out/passwd /x",
     "leads outside the build context"),
    (lambda c: (c / "x.txt").write_text("x"), "COPY *.nothing /x/", "no file in the build"),
    (lambda c: [(c / n).write_text(n) for n in ("a.txt", "b.txt")], "COPY *.txt /single",
     "not a directory"),
])
def test_copy_refusals(tmp_path: Path, state_dir: Path, setup: Callable[[Path], object],
                       dockerfile: str, problem: str) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    setup(ctx)
    (ctx / "Dockerfile").write_text(f"FROM tidal/default\n\n{dockerfile}\n")
    with pytest.raises(DockerfileError) as e:
        build(ctx / "Dockerfile", state_dir)
    assert e.value.line == 3 and problem in e.value.problem, str(e.value)


def test_no_layer_needed(tmp_path: Path, state_dir: Path) -> None:
    df = tmp_path / "Dockerfile"
    df.write_text("FROM tidal/default\nENV A=b\nWORKDIR /work/dir\nCMD [\"x\"]\n")
    env = build(df, state_dir)
    assert env.layers == () and not env.built and env.workdir == "/work/dir"
    assert not (tmp_path / "cache").exists()
    with episode(env, state_dir) as sb:
        assert sb.exec("pwd; echo $A").stdout == "/work/dir\nb\n"


def test_concurrent_builds_of_one_key_build_once(built: tuple[Path, Environment],
                                                 state_dir: Path, tmp_path: Path) -> None:
    df, _ = built
    cache = tmp_path / "other-cache"
    barrier = threading.Barrier(2)
    out: list[Environment] = []

    def one() -> None:
        barrier.wait()
        out.append(build(df, state_dir, cache=cache))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(e.built for e in out) == [False, True]
    assert out[0].layers == out[1].layers
    assert len(Path(out[0].layers[0], "root", "built-at").read_text().splitlines()) == 1
    assert sorted(p.name for p in cache.iterdir()) == [out[0].key, f"{out[0].key}.lock"]
    assert sorted(p.name for p in (cache / out[0].key).iterdir()) == [
        "build.log", "layer", "meta.json"]


BUILD_SCRIPT = """
import sys, time
from pathlib import Path
from tidal.sandbox.build import build_environment
df, cache, state, go = sys.argv[1:]
print("ready", flush=True)
while not Path(go).exists():
    time.sleep(0.002)
env = build_environment(Path(df), context=Path(df).parent, images={}, fallback=None,
                        cache_dir=Path(cache), state_dir=state)
print(env.built, env.key)
"""


def test_concurrent_builds_from_processes_build_once(tmp_path: Path, state_dir: Path) -> None:
    df = write_context(tmp_path / "task")
    cache, go = tmp_path / "cache", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT, str(df), str(cache),
                               str(state_dir), str(go)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    go.touch()  # both have imported everything: they race from here
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o[0] for o in outs) == ["False", "True"] and outs[0][1] == outs[1][1]
    layer = cache / outs[0][1] / "layer"
    assert len((layer / "root" / "built-at").read_text().splitlines()) == 1
    assert not list(cache.glob(".tmp-*"))


def test_run_limits_end_the_build(tmp_path: Path, state_dir: Path) -> None:
    df = tmp_path / "Dockerfile"
    df.write_text("FROM tidal/default\nRUN sleep 30\n")
    with pytest.raises(BuildError, match="line 2: RUN sleep 30 failed with exit code 137 "
                                         r"\(killed at the wall-clock limit"):
        build_environment(df, context=tmp_path, images={}, fallback=None,
                          cache_dir=tmp_path / "cache", timeout_s=0.5, state_dir=str(state_dir))


def test_errors_pickle_and_bad_cache_dirs(tmp_path: Path, state_dir: Path) -> None:
    e = BuildError("D", 3, "RUN x failed with exit code 1", "fix it", output="out", log="/l")
    back = pickle.loads(pickle.dumps(e))
    assert (back.line, back.output, back.log, str(back)) == (3, "out", "/l", str(e))
    df = write_context(tmp_path / "task")
    with pytest.raises(ImageError, match="overlayfs"):
        build(df, state_dir, cache=tmp_path / "a:b")


def test_image_environment(tmp_path: Path, image: Path) -> None:
    env = image_environment("org/img:2", images={"org/img": str(image)}, fallback=None)
    assert (env.image, env.layers, env.workdir, dict(env.env), env.built) == (
        str(image.resolve()), (), None, {}, False)
    assert image_environment("anything", images={}, fallback="default").image is None
    with pytest.raises(DockerfileError, match="not mapped") as e:
        image_environment("anything", images={}, fallback=None, file="task.toml")
    assert str(e.value).startswith("task.toml: the image 'anything' is not mapped")
