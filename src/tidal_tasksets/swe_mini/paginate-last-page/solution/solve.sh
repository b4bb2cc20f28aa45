#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("catalog/pagination.py")
s = p.read_text()
old = "return max(1, total_items // per_page)"
new = "return max(1, -(-total_items // per_page))  # ceiling division"
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
