#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("gridgame/board.py")
s = p.read_text()
old = "        other.grid = list(self.grid)\n"
new = "        other.grid = [list(row) for row in self.grid]\n"
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
