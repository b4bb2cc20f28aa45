#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("leaderboard/ranking.py")
s = p.read_text()
old = """    if len(scores) < 2:
        return None
    ordered = sorted(scores, reverse=True)
    return ordered[1]
"""
new = """    distinct = sorted(set(scores), reverse=True)
    if len(distinct) < 2:
        return None
    return distinct[1]
"""
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
