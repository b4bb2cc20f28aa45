#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("blog/slugs.py")
s = p.read_text()
s = s.replace("import re\n", "import re\nimport unicodedata\n", 1)
old = "    text = title.lower()\n"
new = """    decomposed = unicodedata.normalize("NFKD", title)
    text = decomposed.encode("ascii", "ignore").decode("ascii").lower()
"""
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
