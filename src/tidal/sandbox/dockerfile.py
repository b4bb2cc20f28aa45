"""Dockerfiles without Docker: the subset tidal can build into a read-only layer.

Harbor-format tasks (Terminal-Bench 2 style) describe their environment as a Dockerfile
and a build context. tidal runs episodes in bubblewrap sandboxes, with no Docker daemon
and no network, so `tidal.sandbox.build` applies a Dockerfile itself: COPY/ADD through
the sandbox's file API, RUN as a sandbox command, the result kept as a layer. This
module is the front half: it parses the text into the instructions the builder applies,
with ARG/ENV substitution, WORKDIR and relative destinations already resolved, and
refuses up front, with the file, the line and what to do instead, everything that
cannot work here: multi-stage builds, RUN that needs the network, BuildKit mounts and
heredocs, users other than root, ONBUILD, unknown instructions.

Pure: text and a file name in, a `Dockerfile` out; no I/O.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_SHELL = ("/bin/sh", "-c")
DEFAULT_IMAGE_REF = "tidal/default"  # always tidal's default image, no mapping needed
# `LABEL tidal.image="default"`: the Dockerfile's author declares that tidal's default image
# stands in for its FROM when a run maps no image for it (tidal's built-in sets say so)
DEFAULT_IMAGE_LABEL = "tidal.image"
IGNORED = frozenset({"LABEL", "MAINTAINER", "EXPOSE", "CMD", "ENTRYPOINT", "VOLUME",
                     "HEALTHCHECK", "STOPSIGNAL"})

REMEDY_NETWORK = ("tidal builds without network: install this in a base image directory and "
                  "map FROM to it (`tidal tasks check --image REF=DIR`; in a run, [environment] "
                  "images), or run the task on a container engine, which builds it as written "
                  "(`tidal tasks check --sandbox docker`; in a run, rollout.sandbox = "
                  "\"docker\")")
REMEDY_UNMAPPED = ("map it to a local image directory (`tidal tasks check --image REF=DIR`; in a "
                   "run, [environment] images), or build on tidal's default image instead "
                   "(`--fallback default`; in a run, [environment] fallback = \"default\")")
REMEDY_ONE_STAGE = ("use a single stage: build the earlier stage into an image directory and "
                    "map FROM to it (`tidal tasks check --image REF=DIR`; in a run, "
                    "[environment] images)")
REMEDY_HEREDOC = "write the script into the build context, COPY it and RUN it"
REMEDY_SUPPORTED = "remove it or rewrite it with the supported instructions (docs/sandbox.md)"


class DockerfileError(ValueError):
    """A Dockerfile that tidal cannot build: where, what, and what to do instead."""

    def __init__(self, file: str, line: int, problem: str, remedy: str) -> None:
        self.file, self.line, self.problem, self.remedy = file, line, problem, remedy
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.file} line {self.line}" if self.line else self.file
        head = f"{where}: " if where else ""
        return f"{head}{self.problem}. {self.remedy}"

    def __reduce__(self) -> tuple[type[DockerfileError], tuple[str, int, str, str]]:
        return type(self), (self.file, self.line, self.problem, self.remedy)


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Instruction:
    """One instruction: `line` is the 1-based line where it starts, `op` its keyword."""

    line: int
    op: str


@dataclass(frozen=True)
class Run(Instruction):
    """A command. `argv` is what runs: SHELL (default /bin/sh -c) + the command for the
    shell form, the list itself for the exec form. `env` holds the ARG and ENV values in
    effect (ENV wins), `workdir` the working directory."""

    argv: tuple[str, ...]
    shell_form: bool
    env: tuple[tuple[str, str], ...]
    workdir: str


@dataclass(frozen=True)
class Copy(Instruction):
    """COPY or ADD (`op`). `sources` are normalized paths relative to the build context
    ("." is all of it; globs allowed); `dest` is absolute; `dest_is_dir` when the
    destination is a directory (it ends with "/", or several sources). ADD extracts
    local tar archives."""

    sources: tuple[str, ...]
    dest: str
    dest_is_dir: bool
    chmod: int | None


@dataclass(frozen=True)
class Workdir(Instruction):
    path: str  # absolute


@dataclass(frozen=True)
class Env(Instruction):
    values: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Arg(Instruction):
    values: tuple[tuple[str, str | None], ...]  # None: declared without a value


@dataclass(frozen=True)
class Shell(Instruction):
    argv: tuple[str, ...]


@dataclass(frozen=True)
class User(Instruction):
    user: str  # always root here


@dataclass(frozen=True)
class Ignored(Instruction):
    """LABEL, MAINTAINER, EXPOSE, CMD, ENTRYPOINT, VOLUME, HEALTHCHECK, STOPSIGNAL: no
    effect on the environment an episode runs in."""

    text: str


@dataclass(frozen=True)
class Dockerfile:
    """A parsed Dockerfile. `base` is the FROM reference (after ARG substitution),
    `workdir` the last WORKDIR (None if none), `env` the ENV at the end, `labels` the
    LABEL values at the end (they change nothing that is built)."""

    file: str
    base: str
    base_line: int
    stage: str | None
    instructions: tuple[Instruction, ...]
    workdir: str | None
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def builds_layer(self) -> bool:
        """Whether anything changes files (RUN, COPY, ADD); else no layer is needed."""
        return any(isinstance(i, Run | Copy) for i in self.instructions)

    @property
    def declares_default_image(self) -> bool:
        """Whether the file says `LABEL tidal.image="default"`: tidal's default image may
        stand in for FROM where the run maps no image for it (`build.resolve_base`)."""
        return self.labels.get(DEFAULT_IMAGE_LABEL) == "default"


# --------------------------------------------------------------------------- lines


def _logical_lines(text: str, file: str) -> Iterator[tuple[int, str]]:
    """(first line number, instruction text) with comments dropped and continuation
    lines joined; parser directives at the top are checked and skipped."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.fullmatch(r"\s*#\s*([A-Za-z][A-Za-z0-9_-]*)\s*=\s*(.*?)\s*", lines[i])
        if m is None or m[1].lower() not in ("syntax", "escape", "check"):
            break  # anything else ends the directives (it is a comment, or an instruction)
        if m[1].lower() == "escape" and m[2] != "\\":
            raise DockerfileError(file, i + 1, f"the escape directive {m[2]!r} is not supported",
                                  "remove it and continue lines with \\")
        i += 1
    buf: str | None = None
    start = 0
    for n in range(i, len(lines)):
        raw = lines[n]
        s = raw.strip()
        if buf is None and (not s or s.startswith("#")):
            continue
        if buf is None:
            start, buf = n + 1, ""
        elif not s or s.startswith("#"):
            continue  # comments and blank lines inside a continued instruction
        stripped = raw.rstrip()
        if stripped.endswith("\\"):
            buf += stripped[:-1]
            continue
        yield start, (buf + raw).strip()
        buf = None
    if buf is not None and buf.strip():
        yield start, buf.strip()


# --------------------------------------------------------------------------- words


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand_words(text: str, variables: Mapping[str, str], *, split: bool = True) -> list[str]:
    """Words of `text` as Docker reads them for ENV, ARG, COPY, WORKDIR, ...: quotes
    removed ('...' literal, "..." with substitution), backslash escapes, and `$VAR`,
    `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:+alt}`, `${VAR+alt}` from
    `variables` (unset: empty). `split=False` keeps whitespace (one word).
    ValueError for an unterminated quote or an unsupported substitution."""
    words: list[str] = []
    cur: list[str] = []
    have = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if split and c.isspace():
            if have:
                words.append("".join(cur))
                cur, have = [], False
            i += 1
            continue
        have = True
        if c == "\\":
            cur.append(text[i + 1] if i + 1 < n else c)
            i += 2
        elif c == "'":
            j = text.find("'", i + 1)
            if j < 0:
                raise ValueError("unterminated single quote")
            cur.append(text[i + 1:j])
            i = j + 1
        elif c == '"':
            i = _double_quoted(text, i + 1, variables, cur)
        elif c == "$":
            value, i = _dollar(text, i, variables)
            cur.append(value)
        else:
            cur.append(c)
            i += 1
    if have:
        words.append("".join(cur))
    return words


def _double_quoted(text: str, i: int, variables: Mapping[str, str], cur: list[str]) -> int:
    n = len(text)
    while i < n:
        c = text[i]
        if c == '"':
            return i + 1
        if c == "\\" and i + 1 < n and text[i + 1] in '"\\$':
            cur.append(text[i + 1])
            i += 2
        elif c == "$":
            value, i = _dollar(text, i, variables)
            cur.append(value)
        else:
            cur.append(c)
            i += 1
    raise ValueError("unterminated double quote")


def _dollar(text: str, i: int, variables: Mapping[str, str]) -> tuple[str, int]:
    """The value of the substitution at text[i] == "$" and the index after it."""
    j = i + 1
    if j < len(text) and text[j] == "{":
        end = _closing_brace(text, j)
        body = text[j + 1:end]
        m = _NAME.match(body)
        if m is None:
            raise ValueError(f"bad substitution ${{{body}}}")
        name, rest = m[0], body[m.end():]
        value = variables.get(name)
        if not rest:
            return value or "", end + 1
        for op in (":-", ":+", "-", "+"):
            if rest.startswith(op):
                word = "".join(expand_words(rest[len(op):], variables, split=False))
                is_set = bool(value) if op.startswith(":") else value is not None
                if op.endswith("-"):
                    return (value or "") if is_set else word, end + 1
                return word if is_set else "", end + 1
        raise ValueError(f"unsupported substitution ${{{body}}} (tidal supports ${{VAR}}, "
                         "${VAR:-default} and ${VAR:+alternative})")
    m = _NAME.match(text, j)
    if m is None:
        return "$", j
    return variables.get(m[0], ""), m.end()


def _closing_brace(text: str, j: int) -> int:
    depth, k = 1, j + 1
    while k < len(text):
        if text.startswith("${", k):
            depth, k = depth + 1, k + 2
            continue
        if text[k] == "}":
            depth -= 1
            if depth == 0:
                return k
        k += 1
    raise ValueError("unterminated ${...}")


def _json_list(rest: str) -> list[str] | None:
    """The exec (JSON array) form, or None for the shell form (as Docker: text that is
    not a JSON array of strings is the shell form)."""
    if not rest.startswith("["):
        return None
    try:
        value = json.loads(rest)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def _abspath(path: str, base: str) -> str:
    """`path` made absolute against `base` and normalized ("/a/../b" -> "/b")."""
    full = posixpath.normpath(posixpath.join(base, path))
    return "/" + full.lstrip("/")


# --------------------------------------------------------------------------- network


# A RUN needs the network when one of its commands is one of these (the command word,
# after `sudo`, `env`, VAR=value, ...), with one of the listed subcommands (None: any).
NETWORK_COMMANDS: dict[str, tuple[tuple[str, ...], ...] | None] = {
    "curl": None, "wget": None, "aria2c": None, "uvx": None, "npx": None,
    "apt-get": (("install",), ("update",), ("upgrade",), ("dist-upgrade",),
                ("full-upgrade",), ("build-dep",), ("source",), ("download",)),
    "apt": (("install",), ("update",), ("upgrade",), ("full-upgrade",), ("reinstall",)),
    "aptitude": (("install",), ("update",), ("upgrade",), ("safe-upgrade",)),
    "apk": (("add",), ("update",), ("upgrade",), ("fetch",)),
    "yum": (("install",), ("update",), ("upgrade",), ("reinstall",), ("groupinstall",),
            ("makecache",)),
    "dnf": (("install",), ("update",), ("upgrade",), ("reinstall",), ("makecache",)),
    "microdnf": (("install",), ("update",), ("upgrade",)),
    "zypper": (("install",), ("in",), ("refresh",), ("update",), ("dist-upgrade",)),
    "pip": (("install",), ("download",), ("wheel",)),
    "pipx": (("install",), ("run",), ("upgrade",)),
    "uv": (("pip", "install"), ("pip", "sync"), ("sync",), ("add",), ("tool", "install"),
           ("python", "install")),
    "conda": (("install",), ("create",), ("update",)),
    "mamba": (("install",), ("create",), ("update",)),
    "micromamba": (("install",), ("create",), ("update",)),
    "poetry": (("install",), ("add",), ("update",)),
    "pipenv": (("install",), ("sync",)),
    "git": (("clone",), ("fetch",), ("pull",), ("submodule",), ("ls-remote",)),
    "npm": (("install",), ("i",), ("ci",), ("add",), ("update",)),
    "yarn": ((), ),  # plain `yarn` installs; `yarn add`, `yarn install` too
    "pnpm": (("install",), ("i",), ("add",), ("update",), ("dlx",)),
    "gem": (("install",), ("update",)),
    "bundle": (("install",), ("update",)),
    "go": (("get",), ("install",), ("mod", "download")),
    "cargo": (("install",), ("fetch",)),
}
# Flags that keep those commands offline (pip install --no-index ./x.whl).
OFFLINE_FLAGS: dict[str, frozenset[str]] = {
    "pip": frozenset({"--no-index"}), "uv": frozenset({"--no-index", "--offline"}),
    "conda": frozenset({"--offline"}), "mamba": frozenset({"--offline"}),
    "micromamba": frozenset({"--offline"}), "npm": frozenset({"--offline"}),
    "yarn": frozenset({"--offline"}), "pnpm": frozenset({"--offline"}),
    "cargo": frozenset({"--offline"}),
}
_VALUE_OPTS: dict[str, frozenset[str]] = {  # options whose value is the next word
    "apt-get": frozenset({"-o", "-c", "-t"}), "apt": frozenset({"-o", "-c", "-t"}),
    "git": frozenset({"-C", "-c"}), "yum": frozenset({"-c"}), "dnf": frozenset({"-c"}),
}
_SKIP_WORDS = frozenset({"if", "then", "else", "elif", "do", "while", "until", "!", "{",
                         "time", "exec", "nohup", "command", "builtin", "eval"})
_WRAPPERS = {"sudo": frozenset({"-u", "-g", "-h", "-p", "-C", "-D"}),
             "env": frozenset({"-u", "-C", "-S"}), "nice": frozenset({"-n"}),
             "xargs": frozenset({"-n", "-I", "-P", "-L", "-d", "-s", "-E"}),
             "timeout": frozenset({"-s", "-k"})}
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ash", "ksh"})
_SEPARATORS = frozenset({"&&", "||", ";", "|", "&", "(", ")", "|&", ";;", "`", ";&"})
_ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def needs_network(command: str | Sequence[str]) -> str | None:
    """The first command of a RUN that needs the network (as text), or None.

    A str is shell text: it is split into commands at `&&`, `||`, `;`, `|`, `&`,
    newlines, parentheses and backticks; `$(...)` and `sh -c '...'` are looked into. A
    list is an argv. Only the command word counts (`echo curl` is fine), after leading
    `sudo`, `env`, `VAR=value`, `nice`, `timeout`, `xargs`, shell keywords."""
    if isinstance(command, str):
        for seg in _segments(command):
            hit = _segment_needs_network(seg)
            if hit:
                return hit
        return None
    return _segment_needs_network(list(command))


def _segments(text: str) -> Iterator[list[str]]:
    lex = shlex.shlex(text.replace("\n", " ; "), posix=True, punctuation_chars="();<>|&`")
    lex.whitespace_split = True
    try:
        tokens = list(lex)
    except ValueError:  # unbalanced quotes: fall back to whitespace
        tokens = text.split()
    seg: list[str] = []
    skip_next = False
    for tok in tokens:
        if skip_next:
            skip_next = False
            continue
        if tok in _SEPARATORS:
            if seg:
                yield seg
            seg = []
        elif tok and set(tok) <= set("<>&|"):
            skip_next = True  # a redirection: the next word is a file, not a command
        else:
            seg.append(tok)
            yield from _substitutions(tok)
    if seg:
        yield seg


def _substitutions(word: str) -> Iterator[list[str]]:
    """Commands inside `$(...)` or backticks kept whole in one (quoted) word."""
    for inner in re.findall(r"\$\(([^()]*)\)|`([^`]*)`", word):
        for text in inner:
            if text:
                yield from _segments(text)


def _strip_wrappers(words: list[str]) -> list[str]:
    i = 0
    while i < len(words):
        w = words[i]
        if w in _SKIP_WORDS or _ASSIGN.match(w):
            i += 1
        elif posixpath.basename(w) in _WRAPPERS:
            value_opts = _WRAPPERS[posixpath.basename(w)]
            i += 1
            while i < len(words) and (words[i].startswith("-") or _ASSIGN.match(words[i])):
                i += 2 if words[i] in value_opts else 1
            if w == "timeout" and i < len(words):
                i += 1  # the duration
        else:
            break
    return words[i:]


def _segment_needs_network(words: list[str]) -> str | None:
    words = _strip_wrappers(words)
    if not words:
        return None
    cmd, args = posixpath.basename(words[0]), words[1:]
    if re.fullmatch(r"python[0-9.]*", cmd) and "-m" in args[:-1]:
        k = args.index("-m")
        cmd, args = args[k + 1], args[k + 2:]
    if re.fullmatch(r"pip[0-9.]*", cmd):
        cmd = "pip"
    if cmd in _SHELLS:
        for k, a in enumerate(args[:-1]):
            if re.fullmatch(r"-[a-z]*c[a-z]*", a):
                return needs_network(args[k + 1])
        return None
    if cmd not in NETWORK_COMMANDS:
        return None
    rules = NETWORK_COMMANDS[cmd]
    text = " ".join(words)
    if rules is None:
        return text
    if OFFLINE_FLAGS.get(cmd, frozenset()) & set(args):
        return None
    positional = _positionals(args, _VALUE_OPTS.get(cmd, frozenset()))
    if cmd == "yarn":  # `yarn` alone installs, as do `yarn install` and `yarn add`
        return text if not positional or positional[0] in ("install", "add", "upgrade") else None
    for rule in rules:
        if tuple(positional[:len(rule)]) == rule:
            return text
    return None


def _positionals(args: list[str], value_opts: frozenset[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a.startswith("-"):
            skip = a in value_opts
        else:
            out.append(a)
    return out


# --------------------------------------------------------------------------- parser


_HEREDOC = re.compile(r"(?<!<)<<-?\s*(['\"]?)[A-Za-z_][A-Za-z0-9_]*\1")
_URL = re.compile(r"^([a-z][a-z0-9+.-]*://|git@)", re.IGNORECASE)
ROOT_USERS = frozenset({"root", "0"})


class _Parser:
    """State while reading one Dockerfile (ARG, ENV, WORKDIR, SHELL so far)."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.meta_args: dict[str, str | None] = {}  # ARGs before FROM
        self.args: dict[str, str | None] = {}
        self.env: dict[str, str] = {}
        self.labels: dict[str, str] = {}
        self.workdir: str | None = None
        self.shell: tuple[str, ...] = DEFAULT_SHELL
        self.base: str | None = None
        self.base_line = 0
        self.stage: str | None = None
        self.out: list[Instruction] = []
        self.line = 0

    def error(self, problem: str, remedy: str) -> DockerfileError:
        return DockerfileError(self.file, self.line, problem, remedy)

    @property
    def variables(self) -> dict[str, str]:
        """What $VAR means now: ARGs of the stage (before FROM: the meta ARGs), then ENV."""
        if self.base is None:
            return {k: v for k, v in self.meta_args.items() if v is not None}
        return {**{k: v for k, v in self.args.items() if v is not None}, **self.env}

    def words(self, text: str, *, split: bool = True) -> list[str]:
        try:
            return expand_words(text, self.variables, split=split)
        except ValueError as e:
            raise self.error(str(e), "fix the quoting or the substitution") from None

    def word(self, op: str, text: str) -> str:
        value = "".join(self.words(text, split=False)).strip()
        if not value:
            raise self.error(f"{op} needs a value", f"write {op} <value>")
        return value

    def flags(self, op: str, rest: str) -> tuple[dict[str, str], str]:
        out: dict[str, str] = {}
        while rest.startswith("--"):
            m = re.match(r"--([A-Za-z][A-Za-z0-9-]*)(?:=(\S*))?\s*", rest)
            if m is None:
                raise self.error(f"{op}: malformed flag in {rest.split(maxsplit=1)[0]!r}",
                                 "write flags as --name=value")
            out[m[1].lower()] = "".join(self.words(m[2] or "", split=False))
            rest = rest[m.end():]
        return out, rest

    # ----------------------------------------------------------------- instructions

    def parse(self, line: int, text: str) -> None:
        self.line = line
        m = re.fullmatch(r"([A-Za-z]+)(?:\s+(.*))?", text, re.DOTALL)
        if m is None:
            raise self.error(f"cannot read the instruction {text.split(maxsplit=1)[0]!r}",
                             REMEDY_SUPPORTED)
        op, rest = m[1].upper(), (m[2] or "").strip()
        if self.base is None and op not in ("FROM", "ARG"):
            raise self.error(f"{op} comes before FROM",
                             "start the Dockerfile with FROM <image> (only ARG may come before)")
        handler = self._handlers().get(op)
        if handler is not None:
            handler(op, rest)
        elif op in IGNORED:
            if op == "LABEL":
                self.label(rest)
            self.out.append(Ignored(line, op, rest))
        elif op == "ONBUILD":
            raise self.error("ONBUILD is not supported",
                             "remove it: no image is built on top of a tidal environment")
        else:
            raise self.error(f"unknown instruction {op}", REMEDY_SUPPORTED)

    def _handlers(self) -> dict[str, Callable[[str, str], None]]:
        return {"FROM": self.from_, "ARG": self.arg, "ENV": self.env_, "WORKDIR": self.workdir_,
                "COPY": self.copy, "ADD": self.copy, "RUN": self.run, "SHELL": self.shell_,
                "USER": self.user}

    def from_(self, op: str, rest: str) -> None:
        if self.base is not None:
            raise self.error("a second FROM: multi-stage builds are not supported",
                             REMEDY_ONE_STAGE)
        flags, rest = self.flags("FROM", rest)
        unknown = set(flags) - {"platform"}
        if unknown:
            raise self.error(f"FROM --{sorted(unknown)[0]} is not supported", "remove the flag")
        words = self.words(rest)
        if len(words) == 3 and words[1].lower() == "as":
            self.stage = words[2]
        elif len(words) != 1:
            raise self.error(f"cannot read FROM {rest!r}", "write FROM <image> [AS <name>]")
        self.base, self.base_line = words[0], self.line

    def arg(self, op: str, rest: str) -> None:
        values: list[tuple[str, str | None]] = []
        for w in self.words(rest):
            name, sep, default = w.partition("=")
            if not _NAME.fullmatch(name):
                raise self.error(f"bad ARG name {name!r}", "write ARG <name>[=<default>]")
            if self.base is None:
                value: str | None = default if sep else None
                self.meta_args[name] = value
            else:
                value = default if sep else self.meta_args.get(name)
                self.args[name] = value
            values.append((name, value))
        if not values:
            raise self.error("ARG needs a name", "write ARG <name>[=<default>]")
        self.out.append(Arg(self.line, "ARG", tuple(values)))

    def pairs(self, op: str, rest: str) -> list[tuple[str, str]]:
        """ENV's and LABEL's `KEY=VALUE ...`, or the older `KEY VALUE` (one pair)."""
        first = rest.split(None, 1)[0] if rest else ""
        pairs: list[tuple[str, str]] = []
        if "=" in first:
            for w in self.words(rest):
                key, sep, value = w.partition("=")
                if not sep or not key:
                    raise self.error(f"{op} {w!r} is not KEY=VALUE",
                                     f"write {op} KEY=VALUE [KEY2=VALUE2 ...]")
                pairs.append((key, value))
        else:
            parts = rest.split(None, 1)
            if len(parts) != 2:
                raise self.error(f"{op} needs a value", f"write {op} KEY=VALUE")
            pairs.append((self.word(op, parts[0]),
                          "".join(self.words(parts[1], split=False))))
        return pairs

    def label(self, rest: str) -> None:
        """LABEL changes nothing built; tidal reads one of them (DEFAULT_IMAGE_LABEL). A
        LABEL it cannot read stays ignored, as before, unless it names that one."""
        remedy = (f"write LABEL {DEFAULT_IMAGE_LABEL}=\"default\", or map FROM to an image "
                  "directory (`tidal tasks check --image REF=DIR`; in a run, [environment] "
                  "images)")
        try:
            pairs = self.pairs("LABEL", rest)
        except DockerfileError as e:
            if DEFAULT_IMAGE_LABEL not in rest:
                return
            raise self.error(f"cannot read LABEL {rest} ({e.problem})", remedy) from None
        for key, value in pairs:
            if key == DEFAULT_IMAGE_LABEL and value != "default":
                raise self.error(f"LABEL {DEFAULT_IMAGE_LABEL}={value!r}: the only value tidal "
                                 "reads is \"default\" (its default image stands in for FROM)",
                                 remedy)
            self.labels[key] = value

    def env_(self, op: str, rest: str) -> None:
        pairs = self.pairs("ENV", rest)
        for key, value in pairs:
            if "\0" in key + value:
                raise self.error(f"ENV {key!r} contains NUL", "remove it")
            self.env[key] = value
        self.out.append(Env(self.line, "ENV", tuple(pairs)))

    def workdir_(self, op: str, rest: str) -> None:
        self.workdir = _abspath(self.word("WORKDIR", rest), self.workdir or "/")
        self.out.append(Workdir(self.line, "WORKDIR", self.workdir))

    def user(self, op: str, rest: str) -> None:
        user = self.word("USER", rest)
        if not set(user.split(":", 1)) <= ROOT_USERS:
            raise self.error(f"USER {user} is not supported",
                             "remove USER or write USER root: commands run as root in the sandbox")
        self.out.append(User(self.line, "USER", user))

    def shell_(self, op: str, rest: str) -> None:
        argv = _json_list(rest)
        if not argv:
            raise self.error("SHELL needs the JSON form",
                             'write it as SHELL ["/bin/bash", "-c"]')
        self.shell = tuple(argv)
        self.out.append(Shell(self.line, "SHELL", self.shell))

    def run(self, op: str, rest: str) -> None:
        flags, rest = self.flags("RUN", rest)
        if flags:
            name = sorted(flags)[0]
            raise self.error(f"RUN --{name} is not supported",
                             "remove the flag: builds have no cache or secret mounts and no "
                             "network")
        if _HEREDOC.search(rest):
            raise self.error("heredocs (<<EOF) are not supported", REMEDY_HEREDOC)
        argv = _json_list(rest)
        if argv is not None and not argv:
            raise self.error("RUN [] has no command", "write a command")
        if not rest:
            raise self.error("RUN needs a command", "write a command")
        hit = needs_network(rest if argv is None else argv)
        if hit:
            raise self.error(f"this RUN needs the network (`{hit}`)", REMEDY_NETWORK)
        full = tuple(argv) if argv is not None else (*self.shell, rest)
        self.out.append(Run(self.line, "RUN", full, argv is None,
                            tuple(self.variables.items()), self.workdir or "/"))

    def copy(self, op: str, rest: str) -> None:
        """COPY and ADD."""
        flags, rest = self.flags(op, rest)
        if "from" in flags:
            raise self.error(f"{op} --from is not supported: it needs another stage or image",
                             REMEDY_ONE_STAGE)
        unknown = sorted(set(flags) - {"chmod", "chown", "link"})
        if unknown:
            raise self.error(f"{op} --{unknown[0]} is not supported", "remove the flag")
        chmod = None
        if "chmod" in flags:
            if not re.fullmatch(r"[0-7]{3,4}", flags["chmod"]):
                raise self.error(f"{op} --chmod={flags['chmod']} is not an octal mode",
                                 "write an octal mode such as --chmod=755")
            chmod = int(flags["chmod"], 8)
        if _HEREDOC.search(rest):
            raise self.error("heredocs (<<EOF) are not supported", REMEDY_HEREDOC)
        items = _json_list(rest)
        if items is not None:
            words = ["".join(self.words(w, split=False)) for w in items]
        else:
            words = self.words(rest)
        if len(words) < 2:
            raise self.error(f"{op} needs a source and a destination",
                             f"write {op} <src>... <dest>")
        *sources, dest = words
        srcs = tuple(self.context_path(op, s) for s in sources)
        dest_is_dir = dest.endswith(("/", "/.", "/..")) or dest in (".", "..")
        if len(srcs) > 1 and not dest_is_dir:
            raise self.error(f"{op} with several sources needs a directory destination",
                             f"end the destination with /: {dest}/")
        self.out.append(Copy(self.line, op, srcs, _abspath(dest, self.workdir or "/"),
                             dest_is_dir, chmod))

    def context_path(self, op: str, src: str) -> str:
        """A COPY/ADD source as a normalized path inside the build context."""
        if _URL.match(src):
            if op == "ADD":
                raise self.error(f"ADD {src} downloads from the network",
                                 "download it into the build context beforehand and COPY "
                                 "the file")
            raise self.error(f"COPY source {src!r} is a URL", "copy a file of the build context")
        rel = posixpath.normpath(src.lstrip("/") or ".")
        if rel == ".." or rel.startswith("../"):
            raise self.error(f"{op} source {src!r} is outside the build context",
                             "copy files that are inside the context directory")
        return rel


def parse_dockerfile(text: str, file: str) -> Dockerfile:
    """Parse `text` (the contents of the Dockerfile `file`, used in messages) into the
    instructions tidal builds; DockerfileError for what it cannot build."""
    p = _Parser(file)
    last = 0
    for line, instr in _logical_lines(text, file):
        p.parse(line, instr)
        last = line
    if p.base is None:
        p.line = max(last, 1)
        if not last:
            raise p.error("the Dockerfile is empty", "start it with FROM <image>")
        raise p.error("there is no FROM instruction", "start the Dockerfile with FROM <image>")
    return Dockerfile(file=file, base=p.base, base_line=p.base_line, stage=p.stage,
                      instructions=tuple(p.out), workdir=p.workdir, env=dict(p.env),
                      labels=dict(p.labels))
