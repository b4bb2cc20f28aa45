#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("auth/sessions.py")
s = p.read_text()
old = "        now = now or datetime.utcnow()\n"
assert s.count(old) == 2, "patch target not found"
s = s.replace(old, "        now = _utc(now)\n")
helper = '''

def _utc(now):
    """`now` as an aware UTC datetime: the current time for None, naive means UTC."""
    if now is None:
        return datetime.now(timezone.utc)
    if now.tzinfo is None:
        return now.replace(tzinfo=timezone.utc)
    return now.astimezone(timezone.utc)
'''
anchor = "\n\nclass Session:"
assert s.count(anchor) == 1
s = s.replace(anchor, helper + anchor)
p.write_text(s)
EOF
