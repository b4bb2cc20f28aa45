#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
from pathlib import Path

p = Path("confdoc/pointer.py")
s = p.read_text()
for old, new in [
    ('    raise NotImplementedError("split_pointer is not implemented yet")\n',
     '''    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PointerError(f"a JSON pointer must start with '/': {pointer!r}")
    return [token.replace("~1", "/").replace("~0", "~") for token in pointer[1:].split("/")]
'''),
    ('    raise NotImplementedError("resolve is not implemented yet")\n',
     '''    value = doc
    for token in split_pointer(pointer):
        if isinstance(value, dict):
            if token not in value:
                raise PointerError(f"{pointer!r}: no key {token!r}")
            value = value[token]
        elif isinstance(value, list):
            if not (token.isascii() and token.isdigit()) or (len(token) > 1 and token[0] == "0"):
                raise PointerError(f"{pointer!r}: {token!r} is not a list index")
            index = int(token)
            if index >= len(value):
                raise PointerError(f"{pointer!r}: index {index} out of range")
            value = value[index]
        else:
            raise PointerError(f"{pointer!r}: cannot look up {token!r} in a "
                               f"{type(value).__name__}")
    return value
'''),
]:
    assert s.count(old) == 1, f"patch target not found: {old!r}"
    s = s.replace(old, new)
p.write_text(s)
EOF
