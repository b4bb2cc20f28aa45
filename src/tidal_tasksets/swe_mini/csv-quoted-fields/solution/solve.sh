#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("bankimport/importer.py")
s = p.read_text()
old = s[s.index("def parse_rows(text):"):s.index("\n\n\ndef load_transactions")]
new = '''def parse_rows(text):
    """The data rows as dicts keyed by lower-case header names; blank lines skipped."""
    rows = [row for row in csv.reader(io.StringIO(text)) if any(f.strip() for f in row)]
    if not rows:
        return []
    header = [name.strip().lower() for name in rows[0]]
    return [dict(zip(header, row)) for row in rows[1:]]'''
s = s.replace(old, new)
s = s.replace("from dataclasses import dataclass\n",
              "import csv\nimport io\nfrom dataclasses import dataclass\n", 1)
p.write_text(s)
EOF
