"""The Dockerfile subset (pure parsing): every supported instruction, substitution,
continuation lines, the refused cases with file, line and remedy, and which RUN
commands count as needing the network."""

from __future__ import annotations

import pickle

import pytest

from tidal.sandbox.dockerfile import (
    DEFAULT_IMAGE_LABEL,
    REMEDY_NETWORK,
    Arg,
    Copy,
    DockerfileError,
    Env,
    Ignored,
    Run,
    Shell,
    User,
    Workdir,
    expand_words,
    needs_network,
    parse_dockerfile,
)

FULL = """\
# syntax=docker/dockerfile:1
# escape=\\
ARG BASE=ubuntu
ARG TAG=24.04
FROM --platform=linux/amd64 ${BASE}:${TAG} AS build
ARG TAG
ARG V=1.2 W
LABEL org.example="x y"
MAINTAINER someone
ENV A=1 B="two words" C=${V}-${W:-none}
ENV LEGACY some value $A
WORKDIR /app
WORKDIR sub
RUN echo "$A" && \\
    # a comment inside the continuation
    echo done
RUN ["python3", "-c", "print(1)"]
COPY --chmod=755 --chown=1000:1000 tool.sh lib/ ./bin/
COPY ["my file", "/opt/my file"]
ADD data.tar.gz /data
SHELL ["/bin/bash", "-eu", "-c"]
RUN echo $TAG
USER root
USER 0:0
EXPOSE 80
CMD ["sleep", "infinity"]
ENTRYPOINT ["/bin/sh"]
VOLUME /data
HEALTHCHECK CMD true
STOPSIGNAL SIGTERM
"""


def test_every_supported_instruction() -> None:
    df = parse_dockerfile(FULL, "env/Dockerfile")
    assert (df.base, df.stage, df.base_line) == ("ubuntu:24.04", "build", 5)
    assert df.workdir == "/app/sub"
    assert df.env == {"A": "1", "B": "two words", "C": "1.2-none", "LEGACY": "some value 1"}
    ins = df.instructions
    assert ins[0] == Arg(3, "ARG", (("BASE", "ubuntu"),))
    assert ins[2] == Arg(6, "ARG", (("TAG", "24.04"),))  # the pre-FROM value, redeclared
    assert ins[3] == Arg(7, "ARG", (("V", "1.2"), ("W", None)))
    assert ins[4] == Ignored(8, "LABEL", 'org.example="x y"')
    assert ins[6] == Env(10, "ENV", (("A", "1"), ("B", "two words"), ("C", "1.2-none")))
    assert ins[7] == Env(11, "ENV", (("LEGACY", "some value 1"),))
    assert ins[8] == Workdir(12, "WORKDIR", "/app")
    assert ins[9] == Workdir(13, "WORKDIR", "/app/sub")
    run = ins[10]
    assert isinstance(run, Run) and run.line == 14 and run.shell_form
    assert run.argv == ("/bin/sh", "-c", 'echo "$A" &&     echo done')  # not substituted
    assert run.workdir == "/app/sub"
    assert dict(run.env) == {"TAG": "24.04", "V": "1.2", **df.env}  # ARGs reach RUN
    assert ins[11] == Run(17, "RUN", ("python3", "-c", "print(1)"), False, run.env, "/app/sub")
    assert ins[12] == Copy(18, "COPY", ("tool.sh", "lib"), "/app/sub/bin", True, 0o755)
    assert ins[13] == Copy(19, "COPY", ("my file",), "/opt/my file", False, None)
    assert ins[14] == Copy(20, "ADD", ("data.tar.gz",), "/data", False, None)
    assert ins[15] == Shell(21, "SHELL", ("/bin/bash", "-eu", "-c"))
    assert isinstance(ins[16], Run) and ins[16].argv == ("/bin/bash", "-eu", "-c", "echo $TAG")
    assert ins[17] == User(23, "USER", "root") and ins[18] == User(24, "USER", "0:0")
    assert [i.op for i in ins[19:]] == ["EXPOSE", "CMD", "ENTRYPOINT", "VOLUME",
                                        "HEALTHCHECK", "STOPSIGNAL"]
    assert all(isinstance(i, Ignored) for i in ins[19:])
    assert "TAG" not in df.env and df.builds_layer


def test_labels_are_kept_and_tidal_image_declares_the_default_image() -> None:
    df = parse_dockerfile(FULL, "D")
    assert df.labels == {"org.example": "x y"} and not df.declares_default_image
    df = parse_dockerfile('FROM python:3.11-slim-bookworm\nLABEL a=1 "b c"="d e"\n'
                          "LABEL legacy some value\nLABEL tidal.image=\"default\"\n", "D")
    assert df.labels == {"a": "1", "b c": "d e", "legacy": "some value",
                         DEFAULT_IMAGE_LABEL: "default"}
    assert df.declares_default_image and df.base == "python:3.11-slim-bookworm"
    assert Ignored(4, "LABEL", 'tidal.image="default"') in df.instructions  # builds nothing
    assert parse_dockerfile("FROM a\nLABEL unreadable\n", "D").labels == {}  # ignored, as before
    for bad in ("LABEL tidal.image=/srv/rootfs", "LABEL tidal.image", "LABEL tidal.image=\"\""):
        with pytest.raises(DockerfileError) as e:
            parse_dockerfile(f"FROM a\nRUN true\n{bad}\n", "env/Dockerfile")
        assert e.value.line == 3 and "tidal.image" in str(e.value), bad


def test_no_layer_without_run_or_copy() -> None:
    df = parse_dockerfile("FROM tidal/default\nENV X=1\nWORKDIR /w\nCMD x\n", "D")
    assert not df.builds_layer and df.workdir == "/w" and df.env == {"X": "1"}


def test_lines_continuations_and_comments() -> None:
    text = ("\n# comment\nFROM a\n\nRUN one \\\n\n  two \\\n# c\n  three\nCOPY x \\\n  /y\n"
            "from second-stage\n")
    with pytest.raises(DockerfileError) as e:
        parse_dockerfile(text, "D")
    assert e.value.line == 12  # the second FROM; multi-line RUN/COPY counted right
    df = parse_dockerfile(text.replace("from second-stage\n", ""), "D")
    assert [(i.line, i.op) for i in df.instructions] == [(5, "RUN"), (10, "COPY")]
    run = df.instructions[0]
    assert isinstance(run, Run) and run.argv[-1].split() == ["one", "two", "three"]


@pytest.mark.parametrize(("text", "expected"), [
    ("$A ${A} x$A", ["1", "1", "x1"]),
    ("${U:-dflt} ${A:-dflt} ${E:-dflt} ${E-dflt} ${U-dflt}", ["dflt", "1", "dflt", "", "dflt"]),
    ("${A:+alt} ${U:+alt} ${E+alt}", ["alt", "", "alt"]),
    ("'$A' \"$A b\" \\$A a\\ b", ["$A", "1 b", "$A", "a b"]),
    ("${U:-${A}-x} $U. $1 $", ["1-x", ".", "$1", "$"]),
    ('"quoted \\"inner\\""', ['quoted "inner"']),
])
def test_substitution(text: str, expected: list[str]) -> None:
    assert expand_words(text, {"A": "1", "E": ""}) == expected


def test_substitution_without_splitting() -> None:
    assert expand_words("/my dir/$A", {"A": "x"}, split=False) == ["/my dir/x"]


def test_env_sees_values_from_before_its_line() -> None:
    df = parse_dockerfile("FROM a\nENV X=1\nENV X=2 Y=$X\nENV Z=${X}\n", "D")
    assert df.env == {"X": "2", "Y": "1", "Z": "2"}  # as Docker: Y got the earlier X


def test_arg_before_from_is_for_from_only() -> None:
    df = parse_dockerfile("ARG V=3\nFROM img:$V\nENV X=${V:-unset}\n", "D")
    assert df.base == "img:3" and df.env == {"X": "unset"}


def test_workdir_and_relative_destinations() -> None:
    df = parse_dockerfile("FROM a\nCOPY x .\nWORKDIR w\nWORKDIR ../v/./u\nCOPY y z\n"
                          "COPY y ./\n", "D")
    copies = [i for i in df.instructions if isinstance(i, Copy)]
    assert [(c.dest, c.dest_is_dir) for c in copies] == [
        ("/", True), ("/v/u/z", False), ("/v/u", True)]
    assert df.workdir == "/v/u"


def _err(text: str) -> DockerfileError:
    with pytest.raises(DockerfileError) as e:
        parse_dockerfile(text, "task/environment/Dockerfile")
    return e.value


@pytest.mark.parametrize(("text", "line", "problem", "remedy"), [
    ("", 1, "is empty", "FROM"),
    ("# only a comment\n\n", 1, "is empty", "FROM"),
    ("ARG X=1\n", 1, "no FROM", "FROM"),
    ("RUN echo hi\nFROM a\n", 1, "before FROM", "FROM"),
    ("FROM a AS one\nRUN true\nFROM b\n", 3, "multi-stage", "single stage"),
    ("FROM a\nCOPY --from=build /x /y\n", 2, "--from", "single stage"),
    ("FROM a\nRUN --mount=type=cache,target=/c make\n", 2, "--mount", "remove the flag"),
    ("FROM a\nRUN --network=none make\n", 2, "--network", "remove the flag"),
    ("FROM a\nRUN <<EOF\necho hi\nEOF\n", 2, "heredoc", "COPY it"),
    ("FROM a\nRUN python3 <<'PY'\nprint(1)\nPY\n", 2, "heredoc", "COPY it"),
    ("FROM a\nCOPY <<EOF /etc/x\nhi\nEOF\n", 2, "heredoc", "COPY it"),
    ("FROM a\nONBUILD RUN make\n", 2, "ONBUILD", "remove it"),
    ("FROM a\nFROBNICATE now\n", 2, "unknown instruction FROBNICATE", "supported"),
    ("# escape=`\nFROM a\n", 1, "escape", "\\"),
    ("FROM a\nUSER nobody\n", 2, "USER nobody", "root"),
    ("FROM a\nUSER 1000:0\n", 2, "USER 1000:0", "root"),
    ("FROM a\nADD https://example.com/x.tgz /x\n", 2, "network", "build context"),
    ("FROM a\n\nRUN echo ok && \\\n  apt-get install -y curl\n", 3, "network", REMEDY_NETWORK),
    ("FROM a\nRUN pip install numpy\n", 2, "pip install numpy", REMEDY_NETWORK),
    ("FROM a\nRUN [\"curl\", \"-O\", \"http://x\"]\n", 2, "network", REMEDY_NETWORK),
    ("FROM a\nCOPY ../secret /x\n", 2, "outside the build context", "inside"),
    ("FROM a\nCOPY a b /c\n", 2, "several sources", "end the destination with /"),
    ("FROM a\nSHELL /bin/bash -c\n", 2, "JSON", "SHELL ["),
    ("FROM a\nCOPY --chmod=u+x a /b\n", 2, "octal", "--chmod=755"),
    ("FROM a\nCOPY --exclude=*.pyc a /b\n", 2, "--exclude", "remove the flag"),
    ("FROM a\nENV\n", 2, "ENV needs a value", "ENV KEY=VALUE"),
    ("FROM a\nENV X=${Y:?boom}\n", 2, "unsupported substitution", "substitution"),
    ("FROM a\nENV X=\"open\n", 2, "unterminated", "quoting"),
    ("FROM a\nRUN\n", 2, "needs a command", "command"),
    ("FROM a\nCOPY onlyone\n", 2, "source and a destination", "COPY <src>"),
    ("FROM a b c d\n", 1, "cannot read FROM", "FROM <image>"),
])
def test_refused(text: str, line: int, problem: str, remedy: str) -> None:
    e = _err(text)
    assert (e.file, e.line) == ("task/environment/Dockerfile", line)
    assert problem in e.problem and remedy in e.remedy
    assert str(e) == f"task/environment/Dockerfile line {line}: {e.problem}. {e.remedy}"


def test_error_pickles() -> None:
    e = _err("FROM a\nRUN wget x\n")
    back = pickle.loads(pickle.dumps(e))
    assert isinstance(back, DockerfileError) and str(back) == str(e) and back.line == 2


@pytest.mark.parametrize("command", [
    "apt-get update", "apt-get -o Acquire::Retries=3 install -y git", "apt install vim",
    "apt-get upgrade", "apk add --no-cache bash", "yum install -y gcc", "dnf install x",
    "microdnf install x", "pip install numpy", "pip3 install -r requirements.txt",
    "pip3.11 install x", "python -m pip install x", "python3 -m pip install --user x",
    "uv pip install x", "uv sync", "uv add requests", "uvx ruff", "conda install numpy",
    "mamba install x", "curl -fsSL https://x | sh", "wget -q http://x", "echo ok; wget x",
    "git clone https://github.com/x/y", "git -C repo fetch", "git pull", "npm install",
    "npm ci", "yarn", "yarn add left-pad", "pnpm install", "gem install rails",
    "go get example.com/x", "go install example.com/x@latest", "cargo install ripgrep",
    "sudo apt-get install -y x", "sudo -u root -E apt-get install x",
    "env DEBIAN_FRONTEND=noninteractive apt-get install -y x",
    "DEBIAN_FRONTEND=noninteractive apt-get install -y x", "cd /x && make || curl y",
    "set -e\napt-get update", "echo $(curl -s http://x)", "sh -c 'pip install x'",
    "bash -lc \"npm install\"", "if ! command -v x; then apt-get install -y x; fi",
    "/usr/bin/curl x", "ls | xargs -n1 wget", "(cd a && git clone x)", "echo `wget x`",
    "timeout 60 curl x",
])
def test_needs_network(command: str) -> None:
    assert needs_network(command), command


@pytest.mark.parametrize("command", [
    "echo curl", "echo apt-get install x", "pip install --no-index ./x.whl",
    "pip install --no-index --find-links /wheels x", "python3 -m pip list", "pip freeze",
    "uv pip install --offline x", "apt-get clean", "rm -rf /var/lib/apt/lists/*",
    "git init && git add . && git commit -m x", "git status", "npm run build", "yarn build",
    "make > curl.log", "python3 setup.py build", "go build ./...", "cargo build --offline",
    "cat curl", "grep wget file", "ls /usr/bin/curl", "true", "npm ci --offline",
    "printf 'curl'", "apt-get remove -y x",
])
def test_offline(command: str) -> None:
    assert needs_network(command) is None, command


def test_needs_network_exec_form() -> None:
    assert needs_network(["apt-get", "install", "-y", "x"])
    assert needs_network(["/bin/sh", "-c", "curl x"])
    assert needs_network(["python3", "-c", "print('curl')"]) is None
