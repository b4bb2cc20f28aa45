"""Package dependency graphs: parsing and build order."""


class CycleError(ValueError):
    """No build order exists; `packages` are the packages that could not be placed."""

    def __init__(self, packages):
        self.packages = sorted(packages)
        super().__init__("dependency cycle among: " + ", ".join(self.packages))


def parse_deps(text):
    """{package: set(dependencies)} from lines like 'app: lib utils'. Blank lines and
    '#' comments are ignored; 'pkg:' alone declares a package without dependencies."""
    deps = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, rest = line.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"bad line: {raw!r}")
        deps.setdefault(name.strip(), set()).update(rest.split())
    return deps


def build_order(deps):
    """Every package, each after all of its dependencies; ties broken alphabetically.
    Raises CycleError when some packages can never be placed."""
    raise NotImplementedError("build_order is not implemented yet")
