"""Chat templates tidal gives models whose own template has no tools.

SmolLM2-135M-Instruct's template renders `role + content` per ChatML block and nothing
else: `tools=` is ignored, an assistant turn's `tool_calls` vanish and a tool result
becomes a `tool` block the model never saw in training. An agent cannot be trained on
that. `SMOLLM2_TOOLS` is its template with a tool-calling format added; `tidal.engine.
pretrained` saves it into the checkpoint it builds, so the tokenizer, the gateway, the
warm start and vLLM all read the same template from `tokenizer_config.json`.

The format (Hermes-style, the one the gateway's `hermes` parser reads, the same blocks as
Qwen2.5's template so the ChatML family's block rules hold unchanged):

    <|im_start|>system
    {system prompt}

    Tools:
    - bash(command): Run a bash command.
    - write_file(path, content): Write text to a file.
    Call a tool with:
    <tool_call>
    {"name": "<tool>", "arguments": {...}}
    </tool_call><|im_end|>
    <|im_start|>user
    {task}<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "bash", "arguments": {"command": "ls"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    exit code 0
    ...
    </tool_response><|im_end|>

- Tools are listed one line each, `name(parameters): description`, not as JSON schemas:
  a 135M model with a 8k context reads ~60 tokens instead of ~400, on every call.
- An assistant turn is its text (if any), then each call on its own lines; arguments
  given as a JSON string are written as sent, an object through `tojson` (the JSON the
  gateway's parser reads back and `tidal.agent.tools.format_tool_call_text` writes).
- Consecutive tool results share one user block, each in `<tool_response>` tags.
- Without tools the template renders exactly as SmolLM2's own (its default system prompt
  when the conversation has none).

Deliberately simplified: parameter types and required-ness are not shown (every built-in
tool takes strings); a tool whose schema has no `properties` is listed as `name()`.
"""

from __future__ import annotations

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

SMOLLM2_TOOLS = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set rest = messages[1:] %}"
    "{%- else %}"
    "{%- set system = '" + SMOLLM2_DEFAULT_SYSTEM + "' %}{%- set rest = messages %}"
    "{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\nTools:' }}"
    "{%- for tool in tools %}{%- set fn = tool.function if tool.function is defined else tool %}"
    "{{- '\\n- ' + fn.name + '(' }}"
    "{%- if fn.parameters is defined and fn.parameters.properties is defined %}"
    "{{- fn.parameters.properties | list | join(', ') }}{%- endif %}"
    "{{- ')' }}{%- if fn.description is defined and fn.description %}"
    "{{- ': ' + fn.description }}{%- endif %}"
    "{%- endfor %}"
    "{{- '\\nCall a tool with:\\n<tool_call>\\n{\"name\": \"<tool>\", \"arguments\": {...}}"
    "\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls is defined and message.tool_calls %}"
    "{%- for tc in message.tool_calls %}"
    "{%- set call = tc.function if tc.function is defined else tc %}"
    "{%- if (loop.first and message.content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
