#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("playlist/playlist.py")
s = p.read_text()
for old, new in [
    ("""        self.tracks.sort(key=lambda t: t.seconds)
        return self.tracks
""", """        return sorted(self.tracks, key=lambda t: t.seconds)
"""),
    ("""        self.tracks.sort(key=lambda t: t.seconds, reverse=True)
        return self.tracks[:n]
""", """        return sorted(self.tracks, key=lambda t: t.seconds, reverse=True)[:n]
"""),
]:
    assert s.count(old) == 1, f"patch target not found: {old!r}"
    s = s.replace(old, new)
p.write_text(s)
EOF
