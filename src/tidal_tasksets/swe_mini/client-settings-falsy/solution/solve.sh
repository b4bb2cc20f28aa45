#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("httpclient/settings.py")
s = p.read_text()
old = s[s.index("    return Settings(\n"):s.index("\n\n\ndef _flag")]
new = '''    merged = dict(DEFAULTS)
    merged.update({name: value for name, value in options.items() if value is not None})
    return Settings(
        timeout=float(merged["timeout"]),
        retries=int(merged["retries"]),
        verify_tls=bool(merged["verify_tls"]),
        user_agent=str(merged["user_agent"]),
        proxy=merged["proxy"],
    )'''
p.write_text(s.replace(old, new))
EOF
