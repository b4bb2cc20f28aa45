#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("buildgraph/deps.py")
s = p.read_text()
old = '    raise NotImplementedError("build_order is not implemented yet")\n'
new = '''    waiting = {}        # package -> dependencies not placed yet
    dependents = {}     # package -> packages that depend on it
    for package, needs in deps.items():
        waiting.setdefault(package, set()).update(needs)
        for dep in needs:
            waiting.setdefault(dep, set())
            dependents.setdefault(dep, set()).add(package)
    ready = [package for package, needs in waiting.items() if not needs]
    heapq.heapify(ready)
    order = []
    while ready:
        package = heapq.heappop(ready)
        order.append(package)
        for other in dependents.get(package, ()):
            waiting[other].discard(package)
            if not waiting[other]:
                heapq.heappush(ready, other)
    if len(order) != len(waiting):
        raise CycleError(set(waiting) - set(order))
    return order
'''
assert s.count(old) == 1, "patch target not found"
s = s.replace(old, new)
s = s.replace('"""Package dependency graphs: parsing and build order."""\n',
              '"""Package dependency graphs: parsing and build order."""\n\nimport heapq\n', 1)
p.write_text(s)
EOF
