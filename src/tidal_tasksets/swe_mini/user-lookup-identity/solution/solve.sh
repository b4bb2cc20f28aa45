#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("accounts/store.py")
s = p.read_text()
old = "if user.id is user_id:"
new = "if user.id == user_id:"
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
