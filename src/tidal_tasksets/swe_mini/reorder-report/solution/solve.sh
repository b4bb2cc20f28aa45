#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("inventory/reorder.py")
s = p.read_text()
old = "return item.on_hand <= item.reorder_point or not item.discontinued"
new = "return item.on_hand <= item.reorder_point and not item.discontinued"
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
