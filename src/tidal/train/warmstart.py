"""The supervised warm start: fine-tune on demonstrations that tidal generates itself.

Each demonstration (chat messages with ideal tool calls, `tidal.agent.demonstrations`)
is rendered as rollouts are: the context before each assistant turn is the prompt the
gateway builds for that request (the model's own chat template, block by block), so the
tokens trained for an assistant turn are exactly those the model must later generate
after the gateway's prompt (`<|im_start|>assistant\\n`): the turn's text through its
end-of-turn token. Everything else (system, user, tool results, the role headers) is
context only.

Deliberately simple: plain cross-entropy with AdamW on right-padded batches; no packing,
no scheduler. It runs for a few dozen steps on a tiny model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tidal.agent.tasks import Demonstration
from tidal.agent.tools import tool_schemas
from tidal.gateway.family import detect_family
from tidal.gateway.messages import parse_messages
from tidal.gateway.render import Renderer
from tidal.gateway.tito import SessionTurns, assemble_prompt
from tidal.train.distributed import Ranks
from tidal.train.trainer import logits_at


@dataclass(frozen=True)
class Example:
    """Token ids of one rendered demonstration; `train_mask[i]` marks assistant tokens."""

    ids: tuple[int, ...]
    train_mask: tuple[bool, ...]


def render_demonstration(tokenizer: Any, demo: Demonstration, end_token: str,
                         renderer: Renderer | None = None) -> Example:
    """Render a demonstration turn by turn: the context before each assistant turn is
    the prompt the gateway builds for that request (`tidal.gateway.tito.assemble_prompt`
    over the chat template, as in rollouts); the turn is its template text through
    `end_token` (the token the engine stops on), the tokens the model must generate."""
    renderer = renderer or Renderer(tokenizer, detect_family(tokenizer.chat_template))
    tools = tool_schemas(demo.tools)
    msgs = list(demo.messages)
    ids: list[int] = []
    mask: list[bool] = []
    for i, msg in enumerate(msgs):
        if msg["role"] != "assistant":
            continue
        prompt = assemble_prompt(parse_messages(msgs[:i]), tools, SessionTurns(),
                                 renderer).prompt_ids.tolist()
        if prompt[: len(ids)] != ids:
            raise ValueError(f"the gateway's prompt for assistant turn {i} does not extend "
                             "the demonstration so far: the chat template does not render "
                             "incrementally")
        head = tokenizer.apply_chat_template(
            msgs[:i], tools=tools, tokenize=False, add_generation_prompt=True
        )
        full = tokenizer.apply_chat_template(msgs[: i + 1], tools=tools, tokenize=False)
        if not full.startswith(head):
            raise ValueError("chat template does not render incrementally")
        turn_text = full[len(head):]
        end = turn_text.find(end_token)
        if end < 0:
            raise ValueError(f"assistant turn {i} has no {end_token!r} in the template")
        turn = tokenizer.encode(turn_text[: end + len(end_token)], add_special_tokens=False)
        mask += [False] * (len(prompt) - len(ids)) + [True] * len(turn)
        ids = prompt + turn
    return Example(tuple(ids), tuple(mask))


def end_of_turn(tokenizer: Any) -> str:
    """The token that ends an assistant turn in this tokenizer's chat format."""
    for tok in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        if tok in tokenizer.get_vocab():
            return tok
    return str(tokenizer.eos_token)


def render_all(tokenizer: Any, demos: Sequence[Demonstration]) -> list[Example]:
    end = end_of_turn(tokenizer)
    renderer = Renderer(tokenizer, detect_family(tokenizer.chat_template))
    return [render_demonstration(tokenizer, d, end, renderer) for d in demos]


def _batch(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), -100, dtype=torch.long)
    for i, e in enumerate(examples):
        t = torch.tensor(e.ids, dtype=torch.long)
        ids[i, : len(e.ids)] = t
        m = torch.tensor(e.train_mask, dtype=torch.bool)
        labels[i, : len(e.ids)] = torch.where(m, t, torch.full_like(t, -100))
    return ids, labels


def masked_lm_loss(model: Any, ids_B_T: torch.Tensor, labels_B_T: torch.Tensor,
                   n_total: float | None = None) -> torch.Tensor:
    """Cross-entropy on labelled positions only, summed and divided by `n_total` (all
    ranks' labelled tokens; this batch's by default: the mean). The vocabulary
    projection runs on those positions alone (`target_logits`). Right padding needs no
    attention mask: pads only follow the real tokens."""
    target_B_T = labels_B_T[:, 1:]
    keep_B_T = target_B_T != -100
    b, t = keep_B_T.nonzero(as_tuple=True)
    logits_N_V = logits_at(model, ids_B_T, b * ids_B_T.shape[1] + t)
    loss = torch.nn.functional.cross_entropy(logits_N_V, target_B_T[keep_B_T], reduction="sum")
    return loss / (n_total if n_total is not None else max(int(keep_B_T.sum()), 1))


def warm_start(
    model: torch.nn.Module,
    examples: Sequence[Example],
    *,
    batches: Sequence[Sequence[int]],
    lr: float,
    pad_id: int,
    on_step: Callable[[int, float, float], None] | None = None,
    ranks: Ranks | None = None,
) -> list[float]:
    """Fine-tune `model` in place (its trainable parameters), one step per batch of
    indices into `examples` (the recipe draws them: `tidal.schedule.curriculum`); returns
    each step's loss. Across `ranks`, every rank is given the same batches and trains
    rows rank, rank + world, ...; the loss is normalised by the whole batch's labelled
    tokens, so the ranks' summed gradients are the one-rank gradient."""
    ranks = ranks or Ranks()
    if not examples:
        raise ValueError("warm start needs at least one demonstration")
    bad = [i for b in batches for i in b if not 0 <= i < len(examples)]
    if bad:
        raise ValueError(f"warm-start batch index {bad[0]} is outside the {len(examples)} "
                         "demonstrations")
    if batches and min(len(b) for b in batches) < ranks.world:
        raise ValueError(f"a warm-start batch of {min(len(b) for b in batches)} "
                         f"demonstrations cannot give each of {ranks.world} ranks one")
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step, indices in enumerate(batches):
        t0 = time.perf_counter()
        batch = [examples[i] for i in indices]
        ids, labels = _batch(batch[ranks.rank :: ranks.world], pad_id)
        ids, labels = ids.to(device), labels.to(device)
        n_total = ranks.sum_(torch.tensor([float((labels[:, 1:] != -100).sum())],
                                          dtype=torch.float64))
        loss = masked_lm_loss(model, ids, labels, max(float(n_total[0]), 1.0))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        value = float(ranks.sum_(loss.detach().double().reshape(1))[0])
        losses.append(value)
        if on_step is not None:
            on_step(step, value, time.perf_counter() - t0)
    opt.zero_grad(set_to_none=True)  # nothing holds on to the last step's gradients
    model.eval()
    return losses
