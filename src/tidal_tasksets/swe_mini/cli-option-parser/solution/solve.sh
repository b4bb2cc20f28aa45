#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("minicli/args.py")
s = p.read_text()
old = '    raise NotImplementedError("parse_args is not implemented yet")\n'
new = '''    opts = dict.fromkeys(spec.flags, False)
    for name in spec.options:
        opts[name] = spec.defaults.get(name)
    positionals = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            positionals.extend(args[i:])
            break
        if arg.startswith("--"):
            name, has_value, value = arg[2:].partition("=")
        elif arg.startswith("-") and arg != "-":
            if arg[1:] not in spec.aliases:
                raise UsageError(f"unknown option {arg}")
            name, has_value, value = spec.aliases[arg[1:]], "", ""
        else:
            positionals.append(arg)
            continue
        if name in spec.flags:
            if has_value:
                raise UsageError(f"--{name} takes no value")
            opts[name] = True
        elif name in spec.options:
            if not has_value:
                if i >= len(args):
                    raise UsageError(f"--{name} needs a value")
                value = args[i]
                i += 1
            opts[name] = value
        else:
            raise UsageError(f"unknown option {arg}")
    return opts, positionals
'''
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
