#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("billing/discounts.py")
s = p.read_text()
old = "    for minimum, rate in TIERS:\n"
new = "    for minimum, rate in sorted(TIERS, reverse=True):\n"
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
