"""`shell-skills`: generated one-command shell tasks in the Harbor format, for RL on tiny models.

A small pretrained model (SmolLM2-135M and its like) gets no reward at all from realistic
agent tasks, so RL has nothing to climb. This module writes a task set it can climb: eight
everyday shell skills (count matching lines, read a CSV cell, read a JSON value, edit one
config line, find a file by its content, sum a column, rename by extension, print a line),
each solved by one command, graded with partial credit, in the same Harbor layout that
`tidal.agent.harbor.load_tasks` reads. Nothing has to be downloaded or written by hand:
`ensure_shell_skills()` generates the set once into tidal's cache and returns it.

    root/README.md                what the set is (written by `generate`)
    root/train/<skill>-train-NNN/ 30 per skill by default
    root/heldout/<skill>-heldout-NNN/ 8 per skill by default

Held-out tasks are drawn from pools of file names, searched words, column names, keys,
extensions and values that are disjoint from the training pools (`_POOLS`), so a model
that memorised its training answers scores nothing there. Generation is deterministic:
one `random.Random` per (seed, skill, split, index), JSON with sorted keys, files written
in a fixed order, so a rerun is byte-identical.

Each task directory: instruction.md (one or two short sentences), task.toml,
environment/Dockerfile (`FROM python:3.11-slim-bookworm`, `COPY files/ /app/`: below) and
environment/files/ (the inputs, each under 1.5 KB), tests/test.sh + tests/grade.py +
tests/expected.json (the expected result lives only under tests/, which the agent never
sees), solution/solve.sh (the oracle) and solution/tool_calls.json (the same commands as
tool calls of tidal's harness: `bash`, then `finish`). grade.py reads its paths from
SHELL_SKILLS_APP, SHELL_SKILLS_TESTS and SHELL_SKILLS_REWARD when set (defaults /app,
/tests, /logs/verifier/reward.txt), so the graders can be checked without a sandbox.

The base image: what the tasks, their graders and solutions run is bash, coreutils, grep,
sed, awk, find and python3 (standard library only). The official
`python:3.11-slim-bookworm` (Debian 12 with Python 3.11, the same Debian and Python as
tidal's default image) has all of them, so `docker build` works anywhere as written
(Harbor, Docker). tidal builds the Dockerfile on its default image, as before, because
the Dockerfile says so (`LABEL tidal.image="default"`, docs/sandbox.md): a run that maps
the reference in `[environment] images` gets that image instead.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHELL_SKILLS_VERSION = 3  # 3: the Dockerfiles name BASE_IMAGE instead of tidal/default
SKILLS: tuple[str, ...] = ("count-matches", "csv-field", "json-field", "fix-config",
                           "find-file", "sum-column", "rename-ext", "nth-line")
SPLITS: tuple[str, ...] = ("train", "heldout")
COMPLETE_MARKER = ".complete"
MAX_FILE_BYTES = 1536  # every input file stays below this, so tool outputs stay short

# A column's or setting's values: a range of integers or a tuple of words.
Values = range | tuple[str, ...]


@dataclass(frozen=True)
class _Table:
    """A CSV theme: where it lives, its first (key) column, and its other columns."""

    files: tuple[str, ...]
    key: str
    keys: tuple[str, ...]
    columns: dict[str, Values]


# --------------------------------------------------------------------------- pools
# Every pool has a train and a held-out side with nothing in common (tests assert it).

_FILLER_LEVELS = ("INFO", "DEBUG")
_COMPONENTS = ("auth", "db", "cache", "http", "queue", "mail", "jobs")
_FILLER_MESSAGES = ("request served in {n}ms", "user {n} logged in", "cache warmed",
                    "config loaded", "job {n} started", "heartbeat ok", "session {n} opened",
                    "backup finished", "index rebuilt", "sent {n} bytes", "worker {n} idle")
_WORD_MESSAGES = ("upstream {w} on port {n}", "request {w} for user {n}",
                  "{w} while syncing", "task {n} {w}", "{w} after {n}s")
_COMMENTS = ("# main settings", "# network", "# tuning", "# edited by ops",
             "# defaults below", "# keep in sync with prod")
_SENTENCES = ("Call the vendor before Friday.", "The meeting moved to room 4.",
              "Budget numbers are still open.", "Ask Sam about the new laptop.",
              "Print two copies for the review.", "Lunch is at noon on Tuesday.",
              "The backup drive is almost full.", "Send the slides to the whole team.",
              "Remember to water the plants.", "Check the invoice totals again.")

_POOLS: dict[str, dict[str, Any]] = {
    "train": {
        "count-matches": {
            "files": ("logs/app.log", "logs/server.log", "logs/worker.log", "var/log/web.log",
                      "logs/batch.log", "data/events.log"),
            "levels": ("ERROR", "WARN"),
            "words": ("timeout", "denied", "retry", "disconnected", "overflow", "stalled"),
        },
        "csv-field": (
            _Table(("data/fruit.csv", "market/fruit.csv"), "fruit",
                   ("apple", "banana", "cherry", "grape", "lemon", "mango", "melon", "peach",
                    "pear", "plum", "kiwi", "lime", "fig", "apricot"),
                   {"price": range(1, 100), "stock": range(500),
                    "origin": ("spain", "chile", "peru", "italy", "kenya", "brazil", "egypt"),
                    "color": ("red", "yellow", "green", "orange", "purple", "pink")}),
            _Table(("data/cities.csv", "geo/cities.csv"), "city",
                   ("paris", "berlin", "madrid", "rome", "vienna", "oslo", "lisbon", "dublin",
                    "prague", "warsaw", "athens", "zurich", "brussels", "helsinki"),
                   {"population": range(100, 9000), "elevation": range(1500),
                    "rainfall": range(300, 1500), "zone": ("north", "south", "east", "west"),
                    "area": range(50, 900)}),
            _Table(("inventory/servers.csv", "data/hosts.csv"), "host",
                   ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
                    "juliet", "kilo", "lima", "mike", "oscar", "papa"),
                   {"cpu": range(2, 65), "ram": range(4, 257),
                    "region": ("us", "eu", "asia", "africa"),
                    "os": ("debian", "ubuntu", "alpine", "fedora", "arch")}),
        ),
        "json-field": {
            "files": ("config/app.json", "settings.json", "conf/site.json", "app/config.json"),
            "sections": {
                "database": {"host": ("db1", "db2", "localhost", "pg.local"),
                             "port": range(3000, 6000), "user": ("admin", "app", "reader"),
                             "pool_size": range(2, 50)},
                "server": {"port": range(8000, 9000), "workers": range(1, 17),
                           "hostname": ("web1", "web2", "edge", "front")},
                "cache": {"ttl": range(10, 3600), "size": range(64, 2048),
                          "engine": ("redis", "memcached")},
                "logging": {"level": ("debug", "info", "warn"),
                            "file": ("app.log", "server.log"), "rotate": range(1, 30)},
            },
            "subsections": {
                "database": ("replica", {"host": ("db3", "db4", "standby"),
                                         "port": range(3000, 6000)}),
                "server": ("tls", {"cert": ("site.pem", "web.pem", "main.pem"),
                                   "port": range(400, 500)}),
            },
        },
        "fix-config": {
            "files": ("app.conf", "config/server.conf", "etc/service.conf", "settings/app.cfg"),
            "keys": {"port": range(1000, 9999),
                     "host": ("localhost", "web01", "db.local", "api.internal"),
                     "workers": range(1, 33), "log_level": ("debug", "info", "warn", "error"),
                     "timeout": range(5, 300), "cache_size": range(16, 1024),
                     "max_connections": range(10, 500), "debug": ("on", "off"),
                     "user": ("www", "app", "nobody", "deploy"), "theme": ("light", "dark")},
        },
        "find-file": {
            "dirs": ("docs", "notes", "wiki", "manuals"),
            "subdirs": ("drafts", "archive", "team", "old", "guides"),
            "stems": ("plan", "ideas", "todo", "meeting", "budget", "roadmap", "review",
                      "summary", "contacts", "travel"),
            "codes": ("AMBER", "COBALT", "CRIMSON", "INDIGO", "JASPER", "ONYX", "SAFFRON",
                      "TEAL"),
        },
        "sum-column": (
            _Table(("data/sales.csv", "reports/sales.csv"), "month",
                   ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct",
                    "nov", "dec"),
                   {"amount": range(10, 999), "units": range(1, 99), "returns": range(20)}),
            _Table(("shop/orders.csv", "data/orders.csv"), "order",
                   tuple(f"o{n}" for n in range(101, 140)),
                   {"qty": range(1, 20), "total": range(5, 500), "discount": range(50)}),
            _Table(("fleet/trips.csv", "data/trips.csv"), "driver",
                   ("ann", "bob", "cara", "dave", "erin", "finn", "gwen", "hugo", "iris",
                    "jack", "kate", "liam"),
                   {"km": range(5, 400), "fuel": range(1, 60), "stops": range(12)}),
        ),
        "rename-ext": {
            "dirs": ("photos", "pages", "files", "export"),
            "pairs": (("txt", "md"), ("jpeg", "jpg"), ("htm", "html"), ("log", "bak"),
                      ("dat", "bin")),
            "others": ("py", "json", "png", "xml"),
            "stems": ("report", "index", "summary", "photo", "chart", "intro", "notes",
                      "page"),
        },
        "nth-line": {
            "files": ("poem.txt", "notes/words.txt", "data/list.txt", "lines.txt"),
            "adjectives": ("red", "blue", "green", "amber", "black", "white", "silver",
                           "golden"),
            "nouns": ("fox", "river", "stone", "lamp", "tower", "garden", "bridge", "candle",
                      "mirror", "forest"),
        },
    },
    "heldout": {
        "count-matches": {
            "files": ("logs/api.log", "logs/gateway.log", "srv/proxy.log", "var/log/cron.log",
                      "logs/scheduler.log", "data/audit.log"),
            "levels": ("FATAL", "CRITICAL"),
            "words": ("refused", "expired", "throttled", "rejected", "corrupted", "skipped"),
        },
        "csv-field": (
            _Table(("zoo/animals.csv", "data/animals.csv"), "animal",
                   ("otter", "badger", "heron", "lynx", "moose", "bison", "walrus", "falcon",
                    "beaver", "gecko", "panda", "koala", "ibex", "tapir"),
                   {"weight": range(1, 900), "lifespan": range(3, 80),
                    "habitat": ("forest", "river", "desert", "tundra", "coast", "savanna"),
                    "diet": ("meat", "plants", "fish", "insects", "mixed")}),
            _Table(("school/students.csv", "data/pupils.csv"), "student",
                   ("alice", "bruno", "chen", "dmitri", "elena", "farah", "goran", "hana",
                    "ivan", "julia", "kofi", "lena", "marco", "nadia"),
                   {"score": range(101), "age": range(10, 19),
                    "house": ("oak", "ash", "elm", "pine", "birch"),
                    "grade": ("A", "B", "C", "D", "E")}),
            _Table(("office/devices.csv", "data/equipment.csv"), "device",
                   ("router", "printer", "scanner", "camera", "modem", "tablet", "laptop",
                    "monitor", "speaker", "keyboard", "projector", "phone", "webcam",
                    "headset"),
                   {"watts": range(2, 400), "floor": range(1, 12),
                    "vendor": ("acme", "globex", "initech", "umbrella", "hooli", "stark"),
                    "room": ("lab", "lobby", "hall", "studio", "basement")}),
        ),
        "json-field": {
            "files": ("service.json", "conf/pipeline.json", "etc/bot.json", "deploy/stack.json"),
            "sections": {
                "queue": {"broker": ("rabbit", "kafka", "nats"), "partitions": range(1, 64),
                          "prefetch": range(1, 100)},
                "mailer": {"sender": ("noreply", "alerts", "support"),
                           "smtp_port": range(1000, 2000), "retries": range(1, 10)},
                "storage": {"bucket": ("media", "backups", "uploads"),
                            "quota_gb": range(1, 500), "datacenter": ("ams", "fra", "sfo")},
                "auth": {"issuer": ("sso", "okta", "keycloak"), "token_ttl": range(60, 7200),
                         "max_attempts": range(3, 10)},
            },
            "subsections": {
                "queue": ("dead_letter", {"topic": ("failed", "parked", "poison"),
                                          "max_age": range(60, 900)}),
                "auth": ("oauth", {"client": ("webapp", "mobile", "cli"),
                                   "scope": ("read", "write", "admin")}),
            },
        },
        "fix-config": {
            "files": ("worker.conf", "config/daemon.cfg", "etc/backend.conf", "conf/node.cfg"),
            "keys": {"listen_port": range(1000, 9999),
                     "bind_address": ("0.0.0.0", "127.0.0.1", "10.0.0.5", "192.168.1.20"),
                     "threads": range(1, 65),
                     "verbosity": ("quiet", "normal", "verbose", "trace"),
                     "retry_limit": range(1, 20), "queue_depth": range(8, 4096),
                     "tracing": ("enabled", "disabled"),
                     "owner": ("svc", "daemon", "ops", "backup"),
                     "batch_size": range(10, 1000), "locale": ("nl", "de", "fr", "pt")},
        },
        "find-file": {
            "dirs": ("papers", "memos", "records", "journal"),
            "subdirs": ("inbox", "shared", "final", "backup", "pending"),
            "stems": ("agenda", "minutes", "report", "letter", "outline", "schedule",
                      "invoice", "feedback", "checklist", "proposal"),
            "codes": ("ORCHID", "TUNDRA", "BASALT", "MAGPIE", "QUARTZ", "NECTAR", "CINDER",
                      "FJORD"),
        },
        "sum-column": (
            _Table(("finance/expenses.csv", "data/costs.csv"), "week",
                   tuple(f"w{n:02d}" for n in range(1, 21)),
                   {"cost": range(10, 999), "hours": range(1, 60), "items": range(1, 30)}),
            _Table(("farm/harvest.csv", "data/crops.csv"), "field",
                   ("meadow", "orchard", "hillside", "valley", "ridge", "creek", "grove",
                    "prairie", "marsh", "terrace", "basin", "slope"),
                   {"tons": range(1, 90), "workers": range(2, 40), "acres": range(5, 300)}),
            _Table(("web/visits.csv", "data/traffic.csv"), "page",
                   ("home", "about", "blog", "pricing", "contact", "careers", "docs", "faq",
                    "login", "signup", "shop", "news"),
                   {"views": range(10, 999), "clicks": range(300), "errors": range(15)}),
        ),
        "rename-ext": {
            "dirs": ("assets", "uploads", "inbox", "batch"),
            "pairs": (("yml", "yaml"), ("tif", "tiff"), ("text", "rst"), ("cfg", "conf"),
                      ("csv", "tsv")),
            "others": ("sh", "gif", "ini", "toml"),
            "stems": ("chapter", "figure", "ledger", "banner", "sketch", "outline", "memo",
                      "survey"),
        },
        "nth-line": {
            "files": ("song.txt", "docs/phrases.txt", "data/items.txt", "verses.txt"),
            "adjectives": ("quiet", "rapid", "hollow", "bitter", "gentle", "frozen", "narrow",
                           "distant"),
            "nouns": ("harbor", "meadow", "engine", "violin", "lantern", "canyon", "orchard",
                      "compass", "glacier", "pillar"),
        },
    },
}


# --------------------------------------------------------------------------- one task


@dataclass(frozen=True)
class _Spec:
    """What one generated task needs: what the agent reads, its inputs, what the grader
    checks, and the commands that solve it (one bash call per turn)."""

    instruction: str
    description: str
    files: dict[str, str]
    expected: dict[str, Any]
    commands: tuple[str, ...]


def _value(rng: random.Random, values: Values) -> str:
    return str(rng.choice(values))


def _answer(answer: str, facts: dict[str, Any], *, path: bool = False) -> dict[str, Any]:
    return {"kind": "answer", "answer": answer, "path": path, "facts": facts}


def _count_matches(rng: random.Random, pool: dict[str, Any]) -> _Spec:
    file = rng.choice(pool["files"])
    levels: tuple[str, ...] = pool["levels"]
    word = rng.choice(levels + pool["words"])
    k = rng.randint(2, 15)
    n_filler = rng.randint(max(4, 10 - k), 24 - k)
    other_levels = tuple(lv for lv in levels if lv != word)
    kinds = ["hit"] * k + ["filler"] * n_filler + ["decoy"] * rng.randint(0, 2)
    rng.shuffle(kinds)
    decoy = word.lower() if word.isupper() else word.capitalize()
    lines, t = [], rng.randint(0, 3000)
    for kind in kinds:
        t += rng.randint(1, 90)
        ts = f"{8 + t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d}"
        comp, n = rng.choice(_COMPONENTS), rng.randint(1, 999)
        msg = rng.choice(_FILLER_MESSAGES).format(n=n)
        level = rng.choice(_FILLER_LEVELS + (other_levels if kind == "filler" else ()))
        if kind == "hit" and word in levels:
            level = word
        elif kind == "hit":
            msg = rng.choice(_WORD_MESSAGES).format(w=word, n=n)
        elif kind == "decoy":
            msg = f"{decoy} check passed" if word.islower() else f"no {decoy} found"
        lines.append(f"{ts} {level} {comp}: {msg}")
    count = sum(word in line for line in lines)
    if count != k:  # the filler vocabulary never holds a pool word
        raise AssertionError(f"count-matches: {word!r} in {count} lines, meant {k}")
    return _Spec(
        f"Count the lines of {file} that contain the word {word} (case-sensitive). "
        "Write the count to answer.txt.",
        f"Count the lines of {file} containing {word}.",
        {file: "\n".join(lines) + "\n"},
        _answer(str(k), {"file": file, "word": word}),
        (f"grep -c '{word}' {file} > answer.txt",))


def _table(rng: random.Random, table: _Table, n_columns: int,
           n_rows: int) -> tuple[list[str], list[list[str]]]:
    others = rng.sample(sorted(table.columns), n_columns - 1)
    header = [table.key, *others]
    keys = rng.sample(table.keys, n_rows)
    rows = [[key] + [_value(rng, table.columns[c]) for c in others] for key in keys]
    return header, rows


def _csv(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return "".join(",".join(r) + "\n" for r in [header, *rows])


def _csv_field(rng: random.Random, pool: tuple[_Table, ...]) -> _Spec:
    table = rng.choice(pool)
    file = rng.choice(table.files)
    header, rows = _table(rng, table, rng.randint(3, min(5, len(table.columns) + 1)),
                          rng.randint(5, 12))
    row, col = rng.choice(rows), rng.randint(1, len(header) - 1)
    key, column = row[0], header[col]
    return _Spec(
        f"{file} is a CSV file with a header row. Write the {column} value of the row whose "
        f"{table.key} is {key} to answer.txt.",
        f"Look up {column} for {key} in {file}.",
        {file: _csv(header, rows)},
        _answer(row[col], {"file": file, "key": key, "column": column}),
        (f"head -1 {file}", f"awk -F, '$1==\"{key}\" {{print ${col + 1}}}' {file} > answer.txt"))


def _json_field(rng: random.Random, pool: dict[str, Any]) -> _Spec:
    file = rng.choice(pool["files"])
    sections: dict[str, dict[str, Values]] = pool["sections"]
    doc: dict[str, Any] = {}
    leaves: list[tuple[str, ...]] = []
    for name in sorted(rng.sample(sorted(sections), rng.randint(2, len(sections)))):
        keys = sections[name]
        chosen = sorted(rng.sample(sorted(keys), rng.randint(2, len(keys))))
        body: dict[str, Any] = {k: rng.choice(keys[k]) for k in chosen}
        leaves += [(name, k) for k in chosen]
        if name in pool["subsections"] and rng.random() < 0.5:
            sub, sub_keys = pool["subsections"][name]
            body[sub] = {k: rng.choice(sub_keys[k]) for k in sorted(sub_keys)}
            leaves += [(name, sub, k) for k in sorted(sub_keys)]
        doc[name] = body
    path = rng.choice(leaves)
    value: Any = doc
    for part in path:
        value = value[part]
    dotted = ".".join(path)
    index = "".join(f"['{p}']" for p in path)
    return _Spec(
        f"In the JSON file {file}, find the value at {dotted} (dots separate nested keys). "
        "Write the value to answer.txt.",
        f"Read {dotted} from {file}.",
        {file: json.dumps(doc, indent=2, sort_keys=True) + "\n"},
        _answer(str(value), {"file": file, "path": dotted, "keys": sorted(set(path))}),
        (f"python3 -c \"import json; print(json.load(open('{file}')){index})\" > answer.txt",))


def _fix_config(rng: random.Random, pool: dict[str, Any]) -> _Spec:
    file = rng.choice(pool["files"])
    keys: dict[str, Values] = pool["keys"]
    chosen = rng.sample(sorted(keys), rng.randint(6, len(keys)))
    values = {k: _value(rng, keys[k]) for k in chosen}
    lines = [f"{k}={values[k]}" for k in chosen]
    for comment in rng.sample(_COMMENTS, rng.randint(0, min(2, 12 - len(lines)))):
        lines.insert(rng.randint(0, len(lines)), comment)
    key = rng.choice(chosen)
    new = _value(rng, keys[key])
    while new == values[key]:
        new = _value(rng, keys[key])
    return _Spec(
        f"In the config file {file}, change the value of {key} to {new}. "
        "Keep every other line exactly as it is.",
        f"Set {key} to {new} in {file}.",
        {file: "\n".join(lines) + "\n"},
        {"kind": "fix-config", "file": file, "key": key, "value": new,
         "original": "\n".join(lines) + "\n", "facts": {"file": file, "key": key}},
        (f"sed -i 's/^{key}=.*/{key}={new}/' {file}",))


def _find_file(rng: random.Random, pool: dict[str, Any]) -> _Spec:
    top = rng.choice(pool["dirs"])
    subdirs = rng.sample(pool["subdirs"], rng.randint(2, 3))
    n = rng.randint(5, 10)
    places = [(d, s) for d in ["", *subdirs] for s in pool["stems"]]
    paths = sorted("/".join(p for p in (top, d, f"{s}.txt") if p)
                   for d, s in rng.sample(places, n))
    codes = [f"{w}-{rng.randint(1000, 9999)}" for w in rng.sample(pool["codes"], 4)]
    code, target = codes[0], rng.choice(paths)
    files = {}
    for path in paths:
        lines = rng.sample(_SENTENCES, rng.randint(2, 4))
        if path == target:
            lines.insert(rng.randint(0, len(lines)), f"Reference code: {code}.")
        elif rng.random() < 0.4:
            lines.insert(rng.randint(0, len(lines)), f"Reference code: {rng.choice(codes[1:])}.")
        files[path] = "\n".join(lines) + "\n"
    return _Spec(
        f"Exactly one file under {top}/ contains the code {code}. "
        "Write the path of that file, relative to /app, to answer.txt.",
        f"Find the file under {top}/ that mentions {code}.",
        files,
        _answer(target, {"dir": top, "code": code, "paths": paths}, path=True),
        (f"grep -rl '{code}' {top} > answer.txt",))


def _sum_column(rng: random.Random, pool: tuple[_Table, ...]) -> _Spec:
    table = rng.choice(pool)
    file = rng.choice(table.files)
    header, rows = _table(rng, table, rng.randint(3, len(table.columns) + 1),
                          rng.randint(5, min(12, len(table.keys))))
    col = rng.randint(1, len(header) - 1)
    column = header[col]
    total = sum(int(r[col]) for r in rows)
    return _Spec(
        f"{file} is a CSV file with a header row. Write the sum of its {column} column "
        "to answer.txt.",
        f"Sum the {column} column of {file}.",
        {file: _csv(header, rows)},
        _answer(str(total), {"file": file, "column": column}),
        (f"head -1 {file}", f"awk -F, 'NR>1 {{s+=${col + 1}}} END {{print s}}' {file} "
         "> answer.txt"))


def _rename_ext(rng: random.Random, pool: dict[str, Any]) -> _Spec:
    top = rng.choice(pool["dirs"])
    a, b = rng.choice(pool["pairs"])
    stems = rng.sample(pool["stems"], rng.randint(3, 6))
    names = [f"{s}.{a}" for s in stems]
    names += [f"{s}.{e}" for s, e in zip(rng.sample(pool["stems"], rng.randint(1, 3)),
                                         rng.sample(pool["others"], 3), strict=False)]
    contents = {n: f"{n.split('.')[0]} draft {rng.randint(1, 99)}\n" for n in sorted(names)}
    return _Spec(
        f"In the directory {top}/, rename every file ending in .{a} so that it ends in .{b} "
        "instead, keeping the rest of the name. Leave all other files as they are.",
        f"Rename {top}/*.{a} to *.{b}.",
        {f"{top}/{n}": c for n, c in contents.items()},
        {"kind": "rename-ext", "dir": top, "from": a, "to": b, "files": contents,
         "facts": {"dir": top, "pair": [a, b], "names": sorted(names)}},
        (f'cd {top} && for f in *.{a}; do mv "$f" "${{f%.{a}}}.{b}"; done',))


def _nth_line(rng: random.Random, pool: dict[str, Any]) -> _Spec:
    file = rng.choice(pool["files"])
    pairs = [f"{adj} {noun}" for adj in pool["adjectives"] for noun in pool["nouns"]]
    lines = rng.sample(pairs, rng.randint(8, 30))
    n = rng.randint(1, len(lines))
    return _Spec(
        f"Write line {n} of {file} to answer.txt (the first line is line 1).",
        f"Print line {n} of {file}.",
        {file: "\n".join(lines) + "\n"},
        _answer(lines[n - 1], {"file": file, "line": lines[n - 1]}),
        (f"sed -n '{n}p' {file} > answer.txt",))


_MAKERS: dict[str, Callable[[random.Random, Any], _Spec]] = {
    "count-matches": _count_matches, "csv-field": _csv_field, "json-field": _json_field,
    "fix-config": _fix_config, "find-file": _find_file, "sum-column": _sum_column,
    "rename-ext": _rename_ext, "nth-line": _nth_line,
}


# --------------------------------------------------------------------------- files

BASE_IMAGE = "python:3.11-slim-bookworm"  # pinned: Debian 12, Python 3.11 (the docstring)
_DOCKERFILE = (f"FROM {BASE_IMAGE}\nLABEL tidal.image=\"default\"\nWORKDIR /app\n"
               "COPY files/ /app/\n")

_TEST_SH = """\
#!/bin/bash
# Verifier of a shell-skills task: grade.py compares /app with /tests/expected.json and
# writes the reward (partial credit, 0..1) to /logs/verifier/reward.txt. A reward is always
# written (0.0 unless grade.py gets further) and the script always exits 0. The
# SHELL_SKILLS_APP/TESTS/REWARD variables move those paths (for checks outside a sandbox).
REWARD="${SHELL_SKILLS_REWARD:-/logs/verifier/reward.txt}"
TESTS="${SHELL_SKILLS_TESTS:-/tests}"
mkdir -p "$(dirname "$REWARD")"
echo 0.0 > "$REWARD"
cd "${SHELL_SKILLS_APP:-/app}" 2>/dev/null || true
export PYTHONDONTWRITEBYTECODE=1
timeout 25 python3 "$TESTS/grade.py" || echo "grade.py exited with status $?"
[ -s "$REWARD" ] || echo 0.0 > "$REWARD"
echo "reward: $(cat "$REWARD")"
exit 0
"""

_GRADE_PY = '''\
"""Grade a shell-skills task: compare the files in /app with /tests/expected.json.

Answer tasks: answer.txt exists and is not empty: 0.25; its text, stripped of surrounding
whitespace (for paths also a leading "./" or "/app/"), equals the expected answer: +0.75.
fix-config: the key's line holds the new value: 0.6; the file was edited and every other
line is unchanged, in order, none added or removed: 0.4 (an untouched file earns 0).
rename-ext: the fraction of the directory's target files renamed (same stem, content
kept), times the fraction of its other files left as they were (an untouched directory
earns 0). One line per check goes to stdout; the reward goes to the reward file, which
holds 0.0 from the start.
"""

import json
import os
import sys

APP = os.environ.get("SHELL_SKILLS_APP", "/app")
TESTS = os.environ.get("SHELL_SKILLS_TESTS", "/tests")
REWARD = os.environ.get("SHELL_SKILLS_REWARD", "/logs/verifier/reward.txt")


def write_reward(value):
    os.makedirs(os.path.dirname(REWARD) or ".", exist_ok=True)
    with open(REWARD, "w") as f:
        f.write("%.6f\\n" % value)


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def check(what, ok, points):
    print("%s (%.2f of %.2f) %s" % ("PASS" if ok else "FAIL", points if ok else 0.0,
                                     points, what))
    return points if ok else 0.0


def grade_answer(exp):
    text = read(os.path.join(APP, "answer.txt"))
    got = (text or "").strip()
    if exp.get("path"):
        for prefix in ("./", "/app/"):
            if got.startswith(prefix):
                got = got[len(prefix):]
                break
    reward = check("answer.txt exists and is not empty", got != "", 0.25)
    return reward + check("answer is %r (got %r)" % (exp["answer"], got[:80]),
                          got == exp["answer"], 0.75)


def grade_fix_config(exp):
    text = read(os.path.join(APP, exp["file"]))
    if text is None:
        print("FAIL %s is missing" % exp["file"])
        return 0.0
    key, want = exp["key"], "%s=%s" % (exp["key"], exp["value"])
    lines, before = text.splitlines(), exp["original"].splitlines()
    mine = [line.strip() for line in lines if line.strip().startswith(key + "=")]
    reward = check("the line of %s reads %s (found %r)" % (key, want, mine[:3]),
                   mine == [want], 0.6)
    target = [i for i, line in enumerate(before) if line.startswith(key + "=")][0]
    same = text != exp["original"] and len(lines) == len(before) and all(
        lines[i] == before[i] for i in range(len(before)) if i != target)
    return reward + check("edited, every other line unchanged, in order, none added or "
                          "removed", same, 0.4)


def grade_rename(exp):
    top, a, b = os.path.join(APP, exp["dir"]), "." + exp["from"], "." + exp["to"]
    renamed, kept, others = 0, 0, 0
    for name, content in sorted(exp["files"].items()):
        if name.endswith(a):
            new = name[:-len(a)] + b
            ok = not os.path.lexists(os.path.join(top, name)) and \\
                read(os.path.join(top, new)) == content
            renamed += check("%s renamed to %s, content kept" % (name, new), ok, 1.0) > 0
        else:
            others += 1
            ok = read(os.path.join(top, name)) == content
            kept += check("%s left as it was" % name, ok, 1.0) > 0
    targets = len(exp["files"]) - others
    return renamed / targets * (kept / others if others else 1.0)


def main():
    write_reward(0.0)
    with open(os.path.join(TESTS, "expected.json")) as f:
        exp = json.load(f)
    grade = {"answer": grade_answer, "fix-config": grade_fix_config,
             "rename-ext": grade_rename}[exp["kind"]]
    reward = min(1.0, max(0.0, grade(exp)))
    write_reward(reward)
    print("reward %.6f" % reward)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the reward file keeps its 0.0
        print("grader error: %s: %s" % (type(e).__name__, e))
        sys.exit(1)
'''


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string of printable text is a TOML basic string


def _task_toml(task_id: str, skill: str, split: str, description: str) -> str:
    return (f'version = "1.0"\n\n[task]\nname = {_toml_str(f"tidal/shell-skills-{task_id}")}\n'
            f"description = {_toml_str(description)}\n\n"
            f'[metadata]\ncategory = "{skill}"\nsplit = "{split}"\ndifficulty = "easy"\n'
            f'tags = ["shell", "{skill}"]\n\n[verifier]\ntimeout_sec = 30.0\n\n'
            "[agent]\ntimeout_sec = 180.0\n\n"
            '[environment]\nworkdir = "/app"\nmemory_mb = 512\nnetwork_mode = "no-network"\n')


def _solve_sh(task_id: str, commands: Sequence[str]) -> str:
    return ("#!/bin/bash\n"
            f"# Oracle for {task_id}: the commands of solution/tool_calls.json, run from /app.\n"
            "set -euo pipefail\n" + "".join(c + "\n" for c in commands))


def _tool_calls(commands: Sequence[str]) -> str:
    turns: list[list[dict[str, Any]]] = [
        [{"name": "bash", "arguments": {"command": c}}] for c in commands]
    turns.append([{"name": "finish", "arguments": {"answer": "done"}}])
    return json.dumps(turns, indent=2) + "\n"


def _write(path: Path, text: str, *, executable: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))
    if executable:
        path.chmod(0o755)


def _write_task(out: Path, task_id: str, skill: str, split: str, spec: _Spec) -> None:
    _write(out / "instruction.md", spec.instruction + "\n")
    _write(out / "task.toml", _task_toml(task_id, skill, split, spec.description))
    _write(out / "environment" / "Dockerfile", _DOCKERFILE)
    for rel, content in sorted(spec.files.items()):
        if len(content.encode("utf-8")) > MAX_FILE_BYTES:
            raise AssertionError(f"{task_id}: {rel} is over {MAX_FILE_BYTES} bytes")
        _write(out / "environment" / "files" / rel, content)
    expected = {"skill": skill, **spec.expected}
    _write(out / "tests" / "expected.json", json.dumps(expected, indent=2, sort_keys=True) + "\n")
    _write(out / "tests" / "test.sh", _TEST_SH, executable=True)
    _write(out / "tests" / "grade.py", _GRADE_PY)
    _write(out / "solution" / "solve.sh", _solve_sh(task_id, spec.commands), executable=True)
    _write(out / "solution" / "tool_calls.json", _tool_calls(spec.commands))


def _readme(seed: int, train_per_skill: int, heldout_per_skill: int) -> str:
    skills = "\n".join(f"- `{s}`: {d}" for s, d in (
        ("count-matches", "count the lines of a log containing a word (`grep -c`)"),
        ("csv-field", "one cell of a CSV, by row key and column name (`awk -F,`)"),
        ("json-field", "the value at a dotted path in a JSON file (`python3 -c`)"),
        ("fix-config", "set one key of a key=value config file, nothing else (`sed -i`)"),
        ("find-file", "the one file of a directory tree holding a code (`grep -rl`)"),
        ("sum-column", "the sum of an integer CSV column (`awk`)"),
        ("rename-ext", "rename every *.A in a directory to *.B (a `for` loop and `mv`)"),
        ("nth-line", "line N of a text file (`sed -n Np`)"),
    ))
    return f"""# shell-skills v{SHELL_SKILLS_VERSION}: one-command shell tasks (Harbor format)

Generated by `tidal.agent.shellskills.generate` (seed {seed}); do not edit by hand.
Each task is solved by one shell command run in /app (see `solution/solve.sh` and
`solution/tool_calls.json`), small enough for a tiny model to learn by RL.

{skills}

Each environment/Dockerfile builds FROM {BASE_IMAGE} (Debian 12, Python 3.11: bash,
coreutils, grep, sed, awk, find and python3 are all the tasks use) with Docker anywhere;
tidal builds it on its default image, the same Debian and Python, as its
`LABEL tidal.image="default"` says.

Splits: `train/` holds {train_per_skill} tasks per skill, `heldout/` {heldout_per_skill}.
Held-out tasks use file and directory names, searched words, codes, column names, keys,
extensions and values from pools disjoint from the training ones, so memorised answers
do not carry over.

Partial credit (tests/grade.py, against tests/expected.json):

- answer skills (all but fix-config and rename-ext): answer.txt exists and is not empty
  0.25; its stripped text (for paths, without a leading `./` or `/app/`) equals the
  expected answer +0.75.
- fix-config: the key's line holds the new value 0.6; every other line unchanged, in
  order, none added or removed 0.4 (only for an edited file: an untouched one earns 0).
- rename-ext: the fraction of the target files renamed (stem and content kept), times
  the fraction of the other files left as they were (an untouched directory earns 0).
"""


# --------------------------------------------------------------------------- the set


def generate(root: Path, *, seed: int = 0, train_per_skill: int = 30,
             heldout_per_skill: int = 8) -> None:
    """Write the set under `root` (`train/`, `heldout/`, README.md); the same seed gives
    byte-identical files. Refuses a `root` that already holds a split."""
    root = Path(root)
    for split in SPLITS:
        if (root / split).exists():
            raise FileExistsError(f"{root / split} exists: generate into a fresh directory")
    counts = {"train": train_per_skill, "heldout": heldout_per_skill}
    for split in SPLITS:
        pools = _POOLS[split]
        for skill in SKILLS:
            for i in range(counts[split]):
                rng = random.Random(f"{seed}/{skill}/{split}/{i}")
                task_id = f"{skill}-{split}-{i:03d}"
                spec = _MAKERS[skill](rng, pools[skill])
                _write_task(root / split / task_id, task_id, skill, split, spec)
    _write(root / "README.md", _readme(seed, train_per_skill, heldout_per_skill))


def ensure_shell_skills(root: Path | None = None) -> Path:
    """The directory holding `train/` and `heldout/`, generated (seed 0, default sizes) on
    the first call: into `root`, or tidal's cache
    (`<cache>/tasksets/shell-skills-v{SHELL_SKILLS_VERSION}`). It is written to a sibling
    `.partial-<pid>` directory and renamed into place, so an interrupted run is never
    used; a complete set holds a `.complete` marker and later calls return at once."""
    if root is None:
        from tidal.engine.tiny import default_cache_root

        root = default_cache_root() / "tasksets" / f"shell-skills-v{SHELL_SKILLS_VERSION}"
    root = Path(root)
    if (root / COMPLETE_MARKER).is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    partial = root.parent / f"{root.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    generate(partial)
    _write(partial / COMPLETE_MARKER, f"shell-skills v{SHELL_SKILLS_VERSION}\n")
    if root.is_dir() and not any(root.iterdir()):
        root.rmdir()  # an empty directory made by the caller
    try:
        partial.rename(root)  # os.rename: atomic on one file system
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        if (root / COMPLETE_MARKER).is_file():  # another process finished first
            return root
        raise FileExistsError(f"{root} exists but holds no complete shell-skills set "
                              f"(no {COMPLETE_MARKER}): remove it and retry") from None
    return root
