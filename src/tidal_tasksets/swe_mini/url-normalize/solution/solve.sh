#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("urlnorm/normalize.py")
s = p.read_text()
old = '    raise NotImplementedError("normalize_url is not implemented yet")\n'
new = '''    parts = urlsplit(url.strip())
    if not (parts.scheme and parts.netloc):
        raise ValueError(f"not an absolute URL: {url!r}")
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    port = parts.port
    netloc = host if port is None or port == DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    query = urlencode(sorted(parse_qsl(parts.query, keep_blank_values=True)))
    return urlunsplit((scheme, netloc, parts.path or "/", query, ""))
'''
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
