#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("netgraph/routes.py")
s = p.read_text()
old = "    return len(path)\n"
new = "    return len(path) - 1  # links, not nodes\n"
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
