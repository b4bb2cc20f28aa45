#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("timespec/durations.py")
s = p.read_text()
old = '_PART = re.compile(r"(\\d)([dhms])")'
new = '_PART = re.compile(r"(\\d+)([dhms])")'
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
