#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("ledger/money.py")
s = p.read_text()
old = """    dollars = cents // 100
    rest = cents % 100
    return f"{dollars}.{rest:02d}"
"""
new = """    sign = "-" if cents < 0 else ""
    dollars, rest = divmod(abs(cents), 100)
    return f"{sign}{dollars}.{rest:02d}"
"""
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
