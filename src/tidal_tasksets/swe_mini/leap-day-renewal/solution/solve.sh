#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("subscriptions/renewals.py")
s = p.read_text()
old = "    return d.replace(year=d.year + years)\n"
new = """    year = d.year + years
    if d.month == 2 and d.day == 29 and not calendar.isleap(year):
        return date(year, 2, 28)
    return d.replace(year=year)
"""
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
