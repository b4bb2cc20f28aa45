#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("textkit/lines.py")
s = p.read_text()
old = "return lines[start:end]"
new = "return lines[start - 1:end]"
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
