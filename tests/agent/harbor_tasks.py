"""Task directories laid out exactly as Terminal-Bench 2's (Harbor format), for tests.

`write_task(root, name, ...)` writes instruction.md, task.toml (TB2's fields: version,
[metadata] with author and time estimates, [verifier]/[agent] timeout_sec, [environment]
build_timeout_sec, docker_image, cpus, and the older `memory = "2G"` / `storage = "10G"`),
environment/Dockerfile, tests/test.sh + tests/test_outputs.py and solution/solve.sh.
The default task is TB2's hello-world shape, graded by a test.sh that needs no network
(TB2's own scripts fetch uv and pytest at test time, which tidal's sandboxes cannot):
two checks, so partial credit shows.
"""

from __future__ import annotations

from pathlib import Path

TB2_TOML = """version = "1.0"

[metadata]
author_name = "Test Author"
author_email = "author@example.com"
difficulty = "easy"
category = "file-operations"
tags = ["file-operations", "shell"]
expert_time_estimate_min = 1.0
junior_time_estimate_min = 2.0

[verifier]
timeout_sec = {verifier_timeout}

[agent]
timeout_sec = {agent_timeout}

[environment]
build_timeout_sec = 600.0
docker_image = "alexgshaw/hello-world:20251031"
cpus = 1
memory = "2G"
storage = "10G"
"""

DOCKERFILE = """FROM ubuntu:24.04

WORKDIR /app
"""

# tests/test.sh: runs the python checks and writes the fraction passed (partial credit)
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
cd /app
python3 /tests/test_outputs.py > /logs/verifier/checks.txt
passed=$(grep -c '^PASS' /logs/verifier/checks.txt)
python3 -c "print($passed / 2)" > /logs/verifier/reward.txt
cat /logs/verifier/checks.txt
"""

TEST_OUTPUTS = """from pathlib import Path

hello = Path("/app/hello.txt")
print("PASS exists" if hello.exists() else "FAIL exists")
ok = hello.exists() and hello.read_text().strip() == "Hello, world!"
print("PASS content" if ok else "FAIL content")
"""

SOLVE_SH = """#!/bin/bash
echo "Hello, world!" > hello.txt
"""

INSTRUCTION = "Create a file called hello.txt in /app with the text \"Hello, world!\" in it.\n"


def write_task(
    root: Path,
    name: str = "hello-world",
    *,
    instruction: str | None = INSTRUCTION,
    toml: str | None = None,
    dockerfile: str | None = DOCKERFILE,
    test_sh: str | None = TEST_SH,
    solve_sh: str | None = SOLVE_SH,
    agent_timeout: float = 120.0,
    verifier_timeout: float = 60.0,
    extra: dict[str, str] | None = None,
) -> Path:
    """One task directory under `root`; a None part is left out (to test refusals)."""
    d = root / name
    d.mkdir(parents=True)
    parts = {
        "instruction.md": instruction,
        "task.toml": toml if toml is not None else TB2_TOML.format(
            agent_timeout=agent_timeout, verifier_timeout=verifier_timeout),
        "environment/Dockerfile": dockerfile,
        "tests/test.sh": test_sh,
        "tests/test_outputs.py": TEST_OUTPUTS if test_sh is not None else None,
        "solution/solve.sh": solve_sh,
        **(extra or {}),
    }
    for rel, text in parts.items():
        if text is None:
            continue
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        if rel.endswith(".sh"):
            p.chmod(0o755)
    return d


# --------------------------------------------------------------------------- separate verifiers

# the oracle writes its answer (the declared artifact), a file it does not declare, and a
# log in Harbor's convention directory; test.sh earns 1 only when the verifier sees the
# first and the last and not the other (plus `check`: what only its own image has)
SEPARATE_SOLVE = """#!/bin/bash
echo 42 > /app/out.txt
echo scratch > /app/notes.txt
mkdir -p /logs/artifacts && echo ran > /logs/artifacts/run.log
"""
SEPARATE_TEST = """#!/bin/bash
ok=1
[ "$(cat /app/out.txt 2>/dev/null)" = 42 ] || ok=0
[ -f /logs/artifacts/run.log ] || ok=0
[ -e /app/notes.txt ] && ok=0
{check}
echo $ok > /logs/verifier/reward.txt
"""
# a verifier image of its own: a grading tool the task's image lacks, the tests bundled
GRADER_ONLY = '[ "$(grader-only 2>/dev/null)" = graded ] || ok=0'
VERIFIER_DOCKERFILE = """FROM ubuntu:24.04
RUN printf '#!/bin/sh\\necho graded\\n' > /usr/local/bin/grader-only \\
    && chmod +x /usr/local/bin/grader-only
COPY test.sh /tests/test.sh
WORKDIR /app
"""


def write_separate_task(root: Path, name: str, *, toml: str, own_image: bool = False,
                        extra: dict[str, str] | None = None) -> Path:
    """A task graded by a separate verifier (`toml` says how), whose artifact is
    /app/out.txt; `own_image`: its test.sh needs what only VERIFIER_DOCKERFILE has."""
    return write_task(root, name, toml=toml, solve_sh=SEPARATE_SOLVE,
                      instruction="Write 42 to /app/out.txt.",
                      test_sh=SEPARATE_TEST.format(check=GRADER_ONLY if own_image else ""),
                      extra=extra)


# the images map a test run uses: TB2's FROM ubuntu:24.04 on tidal's default image
IMAGES = {"ubuntu:24.04": "default"}


# --------------------------------------------------------------------------- containers

BASE = "localhost/tidal-base:bookworm"  # .ci/podman.sh's image: Debian, python3, procps
HARBOR_TEMPLATE = next(
    (Path(__file__).resolve().parents[2] / ".venv-harbor" / "lib").glob(
        "python3.*/site-packages/harbor/cli/template-task"), None)


def engine_problem() -> str | None:
    """Why the container tests cannot run here (None: they can)."""
    import os

    from tidal.agent.containers import ContainerError, connect

    try:
        connect().images.get(BASE)
    except ContainerError as e:
        return f"no container engine answers ({e})"
    except Exception as e:
        return f"the engine has no {BASE} ({type(e).__name__}): run .ci/podman.sh"
    if os.geteuid() != 0:
        return "the container runtime kills timed-out commands by host pid: needs root"
    return None


def from_harbor_template(root: Path, name: str = "greeting-template") -> Path:
    """A task made as `harbor tasks init` makes one (its own template), then filled in."""
    import shutil

    assert HARBOR_TEMPLATE is not None
    d = root / name
    shutil.copytree(HARBOR_TEMPLATE, d)
    (d / "instruction.md").write_text("Write the word hello to /app/greeting.txt.\n")
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\necho hello > /app/greeting.txt\n")
    (d / "tests" / "test.sh").write_text(
        '#!/bin/bash\nif [ "$(cat /app/greeting.txt 2>/dev/null)" = hello ]; then\n'
        "  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\n"
        "fi\n")
    return d
