#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("pkgver/semver.py")
s = p.read_text()
old = "        self.core = (match.group(1), match.group(2), match.group(3))\n"
new = "        self.core = (int(match.group(1)), int(match.group(2)), int(match.group(3)))\n"
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
