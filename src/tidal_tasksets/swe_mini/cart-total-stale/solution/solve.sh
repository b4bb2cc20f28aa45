#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("shop/cart.py")
s = p.read_text()
for old, new in [
    ("            self._lines[sku] -= qty\n",
     "            self._lines[sku] -= qty\n        self._total = None\n"),
    ("        self._prices[sku] = cents\n",
     "        self._prices[sku] = cents\n        self._total = None\n"),
]:
    assert s.count(old) == 1, f"patch target not found: {old!r}"
    s = s.replace(old, new)
p.write_text(s)
EOF
