"""How learnable is a built-in task set for the tiny model? A quick supervised probe.

Fine-tunes the random-initialised `tiny` model on the task set's demonstrations (plain
cross-entropy on the assistant turns, rendered through the real Qwen2.5 chat template
with the harness's tools) and, every few steps, decodes the held-out tasks' first turn
(greedy, and sampled at temperature 1) to measure how often the written answer is right.
No gateway, no HTTP: this only tells how fast the skill is learnt and whether it
transfers to held-out tasks, which is what RL after a short warm start needs.

    .venv/bin/python examples/agent_learnability.py --steps 300 --eval-every 50
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from tidal.agent.tasks import DEFAULT_SYSTEM_PROMPT, Task, demonstrations, load_taskset
from tidal.agent.tools import ALL_TOOLS, format_tool_call_text, tool_schemas
from tidal.engine.tiny import ensure_tiny, load_tokenizer

Batch = list[tuple[list[int], list[int]]]


def assistant_mask(ids: list[int], start_ids: list[int], end_id: int) -> list[int]:
    """1 on tokens the assistant wrote: after each '<|im_start|>assistant\\n' up to and
    including the next <|im_end|>."""
    mask = [0] * len(ids)
    i, k = 0, len(start_ids)
    while i < len(ids):
        if ids[i : i + k] == start_ids:
            j = i + k
            while j < len(ids) and ids[j] != end_id:
                mask[j] = 1
                j += 1
            if j < len(ids):
                mask[j] = 1
            i = j
        i += 1
    return mask


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--taskset", default="digits")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--n-eval", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", default="", help="comma-separated digits families")
    ap.add_argument("--show", type=int, default=2, help="print this many decoded outputs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    from transformers import AutoModelForCausalLM

    path = ensure_tiny()
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tools = tool_schemas(ALL_TOOLS)
    ts = load_taskset(args.taskset)
    if args.families:
        from tidal.agent.tasks import digits_taskset

        ts = digits_taskset(families=tuple(args.families.split(",")))
    start_ids = tok.encode("<|im_start|>assistant\n")
    end_id = tok.convert_tokens_to_ids("<|im_end|>")

    def encode(task: Task) -> tuple[list[int], list[int]]:  # main-session demo only
        demo = demonstrations(task)[0]
        ids = tok.apply_chat_template(list(demo.messages), tools=tools, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids), assistant_mask(list(ids), start_ids, end_id)

    train = [encode(t) for t in ts.train]
    print(
        f"train examples {len(train)}, tokens/example {len(train[0][0])}, "
        f"trained tokens/example {sum(train[0][1])}",
        flush=True,
    )
    heldout = rng.sample(list(ts.heldout), min(args.n_eval, len(ts.heldout)))

    def prompt_ids(task: Task) -> list[int]:
        msgs = [
            {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
            {"role": "user", "content": task.prompt},
        ]
        out = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    eval_prompts = [prompt_ids(t) for t in heldout]

    @torch.no_grad()
    def evaluate(sample: bool) -> dict[str, float]:
        model.eval()
        ok_exact = ok_answer = ok_path = shown = 0
        per_fam: dict[str, list[int]] = {}
        bs = 20
        for s in range(0, len(heldout), bs):
            chunk = eval_prompts[s : s + bs]
            L = max(map(len, chunk))
            pad = tok.pad_token_id
            inp = torch.tensor([[pad] * (L - len(p)) + p for p in chunk])
            att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(
                input_ids=inp,
                attention_mask=att,
                max_new_tokens=40,
                do_sample=sample,
                temperature=1.0 if sample else None,
                top_k=0,
                top_p=1.0,
                eos_token_id=end_id,
                pad_token_id=pad,
            )
            for task, row in zip(heldout[s : s + bs], out[:, L:], strict=True):
                text = tok.decode(row, skip_special_tokens=False).split("<|im_end|>")[0]
                fn = demonstrations(task)[0].messages[2]["tool_calls"][0]["function"]
                expect = format_tool_call_text(fn["name"], fn["arguments"])
                body = text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
                try:
                    got = json.loads(body).get("arguments")
                except (json.JSONDecodeError, AttributeError):
                    got = None
                good = got == fn["arguments"]
                ok_answer += good
                ok_path += isinstance(got, dict) and got.get("path") == fn["arguments"]["path"]
                per_fam.setdefault(task.family, []).append(int(good))
                ok_exact += text == expect
                if shown < args.show:
                    shown += 1
                    print(f"  [{'ok' if text == expect else '--'}] {task.prompt!r} -> {text!r}")
        model.train()
        n = len(heldout)
        res = {"exact_call": ok_exact / n, "args_ok": ok_answer / n, "path_ok": ok_path / n}
        res.update({f"fam_{k}": sum(v) / len(v) for k, v in per_fam.items()})
        return res

    # Every example starts with the same system prompt and tools: run that prefix once
    # per step and share its keys/values across the batch (exact, gradients included).
    P = 0
    first = train[0][0]
    while all(len(i) > P and i[P] == first[P] for i, _ in train):
        P += 1
    prefix = torch.tensor([first[:P]])
    print(f"shared prefix {P} tokens", flush=True)

    def shared_prefix_loss(batch: Batch) -> torch.Tensor:
        B = len(batch)
        sufs = [(i[P:], m[P:]) for i, m in batch]
        S = max(len(i) for i, _ in sufs)
        ids = torch.tensor([i + [0] * (S - len(i)) for i, _ in sufs])
        att = torch.tensor([[1] * (P + len(i)) + [0] * (S - len(i)) for i, _ in sufs])
        msk = torch.tensor([m + [0] * (S - len(m)) for _, m in sufs])
        cache = model.model(input_ids=prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(B)
        pos = torch.arange(P, P + S)[None].expand(B, S)
        hidden = model.model(
            input_ids=ids, attention_mask=att, past_key_values=cache, position_ids=pos
        ).last_hidden_state
        sel = msk[:, 1:].bool()
        logits = model.lm_head(hidden[:, :-1][sel])
        return torch.nn.functional.cross_entropy(logits, ids[:, 1:][sel])

    def full_loss(batch: Batch) -> torch.Tensor:
        L = max(len(i) for i, _ in batch)
        ids = torch.tensor([i + [0] * (L - len(i)) for i, _ in batch])
        att = torch.tensor([[1] * len(i) + [0] * (L - len(i)) for i, _ in batch])
        msk = torch.tensor([m + [0] * (L - len(m)) for _, m in batch])
        hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state
        sel = msk[:, 1:].bool()
        logits = model.lm_head(hidden[:, :-1][sel])
        return torch.nn.functional.cross_entropy(logits, ids[:, 1:][sel])

    with torch.no_grad():
        b = train[:4]
        a, f = shared_prefix_loss(b).item(), full_loss(b).item()
        print(f"check: shared-prefix loss {a:.6f} vs full {f:.6f}", flush=True)
        assert abs(a - f) < 1e-4 * max(1.0, abs(f))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    t0 = time.time()
    for step in range(1, args.steps + 1):
        batch = rng.sample(train, args.batch)
        loss = shared_prefix_loss(batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f} t={time.time() - t0:.0f}s", flush=True)
        if step % args.eval_every == 0:
            g = evaluate(False)
            smp = evaluate(True)
            print(
                f"EVAL step {step} t={time.time() - t0:.0f}s greedy {g} sampled {smp}", flush=True
            )


if __name__ == "__main__":
    main()
