#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("urltools/query.py")
s = p.read_text()
old = 'name, value = piece.split("=")'
new = 'name, value = piece.split("=", 1)'
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
