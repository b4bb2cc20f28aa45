#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("metrics/smoothing.py")
s = p.read_text()
old = "for start in range(len(values) - window):"
new = "for start in range(len(values) - window + 1):"
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
