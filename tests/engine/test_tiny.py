"""The tiny model: real Qwen2.5 tokenizer and tool-calling template, loadable checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.engine.tiny import (
    TinyModelError,
    ensure_tiny,
    gguf_chunk_path,
    load_tokenizer,
    read_gguf_metadata,
    resolve_model,
    tiny_cache_key,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_gguf_header_has_the_qwen_tokenizer() -> None:
    meta = read_gguf_metadata(gguf_chunk_path())
    assert meta["general.architecture"] == "qwen2"
    assert meta["tokenizer.ggml.pre"] == "qwen2"
    assert len(meta["tokenizer.ggml.tokens"]) == 151936
    assert "<tool_call>" in meta["tokenizer.chat_template"]


def test_gguf_reader_rejects_non_gguf_and_truncation(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 32)
    with pytest.raises(TinyModelError, match="magic"):
        read_gguf_metadata(bad)
    head = gguf_chunk_path().read_bytes()[:4096]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(TinyModelError, match="truncated"):
        read_gguf_metadata(cut)


def test_special_tokens_are_single_ids(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    assert len(tok) == 151665
    for text, want in [
        ("<|endoftext|>", 151643),
        ("<|im_start|>", 151644),
        ("<|im_end|>", 151645),
        ("<tool_call>", 151657),
        ("</tool_call>", 151658),
    ]:
        assert tok.encode(text, add_special_tokens=False) == [want]
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None


def test_encode_decode_round_trip(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    # Known Qwen2.5 ids: "Hello" = 9707, " world" = 1879.
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    texts = [
        "def f(x):\n    return x ** 2  # square\n",
        "中文 テキスト, emoji 🤖 and tabs\t\tend",
        '<|im_start|>user\n{"on": false, "n": 3}<|im_end|>\n',
        "  leading spaces and trailing  ",
    ]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text


def test_chat_template_renders_tool_instructions(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    text = tok.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert isinstance(text, str)
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert "return a json object with function name and arguments within <tool_call>" in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    assert ids[0] == 151644
    # "within <tool_call></tool_call> XML tags", the example, and the real call
    assert ids.count(151657) == 3
    assert ids.count(151658) == 3


def test_tiny_checkpoint_is_a_real_qwen2(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] == 151665
    assert config["head_dim"] == 64
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] >= 8192
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert "top_k" not in gen and "temperature" not in gen


def test_ensure_tiny_is_cached_and_keyed_by_seed(tiny_dir: Path) -> None:
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny() == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before
    assert tiny_cache_key(0) != tiny_cache_key(1)
    assert tiny_dir.name == f"tiny-{tiny_cache_key(0)}"


def test_ensure_tiny_refuses_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "something.txt").write_text("mine")
    with pytest.raises(TinyModelError, match="not empty"):
        ensure_tiny(tmp_path)


def test_resolve_model(tiny_dir: Path, tmp_path: Path) -> None:
    assert resolve_model("tiny") == tiny_dir
    assert resolve_model(tiny_dir) == tiny_dir
    assert resolve_model(str(tiny_dir)) == tiny_dir
    with pytest.raises(TinyModelError, match="hub"):
        resolve_model("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(TinyModelError, match="no checkpoint directory"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(TinyModelError, match=r"no config\.json"):
        resolve_model(tmp_path)
