#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("events/bus.py")
s = p.read_text()
old = """    handlers = {}   # event name -> list of handlers
    published = []  # names of the events published, oldest first
"""
new = """    def __init__(self):
        self.handlers = {}   # event name -> list of handlers
        self.published = []  # names of the events published, oldest first
"""
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
