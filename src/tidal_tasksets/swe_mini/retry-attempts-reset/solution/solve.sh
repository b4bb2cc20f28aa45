#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("netretry/retry.py")
s = p.read_text()
old = "        while True:\n            self.attempts += 1\n"
new = "        self.attempts = 0\n        while True:\n            self.attempts += 1\n"
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
