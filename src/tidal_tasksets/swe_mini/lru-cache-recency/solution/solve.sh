#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("memo/lru.py")
s = p.read_text()
for old, new in [
    ("""        if key in self._data:
            self.hits += 1
            return self._data[key]
""", """        if key in self._data:
            self.hits += 1
            self._data.move_to_end(key)
            return self._data[key]
"""),
    ("""        if key not in self._data and len(self._data) >= self.capacity:
            self._data.popitem(last=False)
        self._data[key] = value
""", """        if key in self._data:
            self._data.move_to_end(key)
        elif len(self._data) >= self.capacity:
            self._data.popitem(last=False)
        self._data[key] = value
"""),
]:
    assert s.count(old) == 1, f"patch target not found: {old!r}"
    s = s.replace(old, new)
p.write_text(s)
EOF
