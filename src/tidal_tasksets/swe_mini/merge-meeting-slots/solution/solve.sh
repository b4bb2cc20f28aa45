#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("meetings/slots.py")
s = p.read_text()
old = '    raise NotImplementedError("merge_slots is not implemented yet")\n'
new = '''    merged = []
    for start, end in sorted(tuple(slot) for slot in slots):
        if start >= end:
            raise ValueError(f"slot ({start}, {end}) does not end after it starts")
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
'''
assert s.count(old) == 1, "patch target not found"
p.write_text(s.replace(old, new))
EOF
