#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("ratelimit/limiter.py")
s = p.read_text()
old = "if len(self._hits) > self.limit:"
new = "if len(self._hits) >= self.limit:"
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
