#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("textfmt/wrap.py")
s = p.read_text()
old = '    raise NotImplementedError("wrap is not implemented yet")\n'
new = '''    if width < 1:
        raise ValueError("width must be at least 1")
    lines = []
    current = ""
    for word in text.split():
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines
'''
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
