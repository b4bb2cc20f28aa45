"""A tiny command-line option parser."""


class UsageError(Exception):
    """The command line does not match the command's Spec."""


class Spec:
    """The options a command accepts.

    flags: long names of boolean options (--verbose); options: long names of options
    that take a value (--output FILE); aliases: {letter: long name} (-v, -o);
    defaults: {option: default value}.
    """

    def __init__(self, flags=(), options=(), aliases=None, defaults=None):
        self.flags = tuple(flags)
        self.options = tuple(options)
        self.aliases = dict(aliases or {})
        self.defaults = dict(defaults or {})
        names = set(self.flags) | set(self.options)
        if len(names) != len(self.flags) + len(self.options):
            raise ValueError("a name cannot be both a flag and an option")
        for letter, name in self.aliases.items():
            if len(letter) != 1 or name not in names:
                raise ValueError(f"bad alias -{letter} for {name!r}")
        for name in self.defaults:
            if name not in self.options:
                raise ValueError(f"default for unknown option {name!r}")


def parse_args(spec, argv):
    """Parse argv (without the program name) against spec: (opts, positionals)."""
    raise NotImplementedError("parse_args is not implemented yet")


def format_usage(spec, prog):
    short = {name: letter for letter, name in spec.aliases.items()}
    parts = [prog]
    for name in spec.flags:
        parts.append(f"[-{short[name]}|--{name}]" if name in short else f"[--{name}]")
    for name in spec.options:
        flag = f"-{short[name]}|--{name}" if name in short else f"--{name}"
        parts.append(f"[{flag} {name.upper()}]")
    return "usage: " + " ".join(parts) + " [ARGS...]"
