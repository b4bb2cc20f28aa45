#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("logstats/stats.py")
s = p.read_text()
for old, new in [
    ('    """The fraction of well-formed lines at ERROR or CRITICAL (0.0 for none)."""\n'
     "    total = sum(1 for _ in entries(lines))\n",
     '    """The fraction of well-formed lines at ERROR or CRITICAL (0.0 for none)."""\n'
     "    parsed = list(entries(lines))\n"
     "    total = len(parsed)\n"),
    ("    errors = sum(1 for e in entries(lines) if e.level in ERROR_LEVELS)\n",
     "    errors = sum(1 for e in parsed if e.level in ERROR_LEVELS)\n"),
    ('    """{\'total\', \'levels\', \'error_rate\', \'top_error_source\'} for the dashboard."""\n',
     '    """{\'total\', \'levels\', \'error_rate\', \'top_error_source\'} for the dashboard."""\n'
     "    lines = list(lines)  # it is read several times below\n"),
]:
    assert s.count(old) == 1, f"patch target not found: {old!r}"
    s = s.replace(old, new)
p.write_text(s)
EOF
