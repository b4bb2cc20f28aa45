"""Model-family specifics, kept in one small table.

Everything the gateway needs to know about a chat format lives in a `ChatFamily`: how a
rendered conversation splits into per-message blocks, the header that opens an assistant
turn (the generation prompt), what closes a turn and which tokens stop sampling. Which
tool-call formats a model writes is the parsers' business (`tidal.gateway.toolcalls`),
chosen apart from the block structure.

Built in: ChatML (Qwen2, Qwen2.5, Qwen3, and the many models that use
`<|im_start|>role\\n ... <|im_end|>\\n`). Adding a family means adding one entry to
`FAMILIES` and, if its template does not render one block per message, teaching
`tidal.gateway.render.map_blocks` its grouping rule.

Deliberately simplified: detection looks for the family's block marker in the chat
template text; a template that uses ChatML markers but a different block structure is
caught later, when `map_blocks` finds the blocks do not line up with the messages (a
clear error, never a silent re-render).
"""

from __future__ import annotations

from dataclasses import dataclass


class GatewayError(ValueError):
    """A request or configuration the gateway cannot serve; the message says why."""


@dataclass(frozen=True)
class ChatFamily:
    """The structure of one chat format.

    A rendered conversation is `block*`, each block `block_start + role + "\\n" + body +
    block_end + separator`; the prompt ends with `block_start + "assistant\\n"` (the
    generation prompt). `tool_results_grouped`: consecutive tool messages share one block
    (Qwen renders them inside one user block as `<tool_response>` sections).
    """

    name: str
    block_start: str
    block_end: str
    separator: str
    tool_block_role: str
    tool_results_grouped: bool
    stop_tokens: tuple[str, ...]
    think_open: str = "<think>"
    think_close: str = "</think>"

    def header(self, role: str) -> str:
        """The text that opens a block of `role` (for the assistant: the generation prompt)."""
        return f"{self.block_start}{role}\n"

    @property
    def closing(self) -> str:
        """What follows a complete assistant output in the rendered history."""
        return self.block_end + self.separator


CHATML = ChatFamily(
    name="chatml",
    block_start="<|im_start|>",
    block_end="<|im_end|>",
    separator="\n",
    tool_block_role="user",
    tool_results_grouped=True,
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
)

FAMILIES: dict[str, ChatFamily] = {CHATML.name: CHATML}


def detect_family(chat_template: str | None) -> ChatFamily:
    """Pick the family whose block marker the chat template uses."""
    if not chat_template:
        raise GatewayError("the tokenizer has no chat template; the gateway needs one")
    for fam in FAMILIES.values():
        if fam.block_start in chat_template:
            return fam
    raise GatewayError(
        "unsupported chat template: no known family's block marker found "
        f"(supported: {', '.join(FAMILIES)}); add a ChatFamily in tidal/gateway/family.py"
    )
