#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("tracker/tasks.py")
s = p.read_text()
for old, new in [
    ("def __init__(self, title, labels=[], assignee=None):",
     "def __init__(self, title, labels=None, assignee=None):"),
    ("        self.labels = labels\n",
     "        self.labels = list(labels) if labels is not None else []\n"),
]:
    assert s.count(old) == 1, f"patch target not found: {old!r}"
    s = s.replace(old, new)
p.write_text(s)
EOF
