"""LoRA through peft: only the adapters train, the merge is peft's, tree training stays exact."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.train.conftest import (
    VOCAB,
    compare_to_paths,
    random_trees,
    tiny_qwen2,
    tiny_qwen3,
    with_rollout,
)
from tests.train.synthetic import random_tree
from tidal.train.attention import enable_tree_attention
from tidal.train.lora import (
    PEFT_PREFIX,
    LoraError,
    LoraSpec,
    apply_lora,
    has_lora_dropout,
    lora_dropout,
    merged_state_dict,
    trainable_parameters,
)
from tidal.train.loss import LossConfig, per_path_loss
from tidal.train.packing import pack_trees
from tidal.train.trainer import (
    TreeTrainer,
    recompute_logprobs,
)
from tidal.tree.types import TrainTree

Factory = Callable[[int], torch.nn.Module]
SPEC = LoraSpec(r=4, alpha=8.0)


def _nonzero_b(model: torch.nn.Module, seed: int) -> None:
    """peft starts B at zero (the adapter a no-op); make it matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=gen)


def _lora(factory: Factory, seed: int, spec: LoraSpec = SPEC) -> torch.nn.Module:
    model = apply_lora(factory(seed).eval(), spec)
    _nonzero_b(model, seed)
    return model


def _tied_qwen3(seed: int) -> torch.nn.Module:
    return tiny_qwen3(seed, tied=True).eval()


def _ids(seed: int, n: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


# --- apply_lora -----------------------------------------------------------------------


@pytest.mark.parametrize("targets", [SPEC.targets, ("q_proj", "v_proj", "down_proj")])
def test_only_adapters_train_and_the_trainer_sees_the_model(targets: tuple[str, ...]) -> None:
    plain = tiny_qwen3(0).eval()
    decoder, head, config = plain.model, plain.lm_head, plain.config
    model = apply_lora(plain, LoraSpec(r=4, alpha=8.0, targets=targets))
    train = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(".lora_A." in n or ".lora_B." in n for n in train), train
    assert len(train) == len(targets) * config.num_hidden_layers * 2
    assert trainable_parameters(model) == [model.get_parameter(n) for n in train]
    assert sum(1 for _ in model.parameters()) > len(train)  # the base weights are frozen
    # what the trainer calls resolves through peft's delegation to the adapted model
    assert model.get_decoder() is decoder
    assert model.get_output_embeddings() is head
    assert model.config is config
    assert any(".lora_A" in n for n, _ in decoder.named_modules())
    # peft creates its modules in train mode; apply_lora keeps the model's eval mode
    assert not any(m.training for m in model.modules())
    assert all(m.training for m in apply_lora(tiny_qwen3(0).train(), SPEC).modules())


def test_bad_targets_and_settings_name_their_key() -> None:
    with pytest.raises(
        LoraError,
        match=r"train\.lora\.targets: no Linear .* matches nope, "
        r"qproj; .*q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
        r"lm_head$",
    ):
        apply_lora(tiny_qwen3(0), LoraSpec(targets=("q_proj", "nope", "qproj")))
    with pytest.raises(LoraError, match=r"train\.lora\.targets: no Linear .* matches mlp;"):
        apply_lora(tiny_qwen3(0), LoraSpec(targets=("q_proj", "mlp")))
    odd = tiny_qwen3(0)  # a target that names a Linear in one layer and a block in another
    odd.model.layers[1].self_attn.q_proj = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with pytest.raises(
        LoraError,
        match=r"train\.lora\.targets also name .*not Linear: "
        r"model\.layers\.1\.self_attn\.q_proj \(Sequential\)",
    ):
        apply_lora(odd, LoraSpec(targets=("q_proj",)))
    with pytest.raises(
        LoraError,
        match=r"train\.lora\.targets: lm_head \(tied to "
        r"model\.embed_tokens\.weight\)",
    ):
        apply_lora(_tied_qwen3(0), LoraSpec(targets=("q_proj", "lm_head")))
    for key, bad in [
        ("r", 0),
        ("r", 2.0),
        ("r", True),
        ("alpha", 0.0),
        ("alpha", -1.0),
        ("alpha", float("nan")),
        ("alpha", float("inf")),
        ("dropout", 1.0),
        ("dropout", -0.1),
        ("targets", ()),
        ("targets", "q_proj"),
    ]:
        with pytest.raises(LoraError, match=rf"train\.lora\.{key}"):
            LoraSpec(**{key: bad})  # type: ignore[arg-type]
    assert LoraSpec(targets=["q_proj"]).targets == ("q_proj",)  # type: ignore[arg-type]
    assert LoraSpec(r=4, alpha=8.0).scaling == 2.0
    model = apply_lora(tiny_qwen3(0), SPEC)
    with pytest.raises(LoraError, match="already has LoRA"):
        apply_lora(model, SPEC)


# --- merged_state_dict ----------------------------------------------------------------


@pytest.mark.parametrize("factory", [tiny_qwen2, tiny_qwen3, _tied_qwen3])
def test_merged_state_dict_is_peft_merge_and_loads_into_a_plain_model(factory: Factory) -> None:
    targets = (*SPEC.targets, "gate_proj") + (("lm_head",) if factory is not _tied_qwen3 else ())
    spec = LoraSpec(r=4, alpha=8.0, targets=targets)
    model = _lora(factory, 1, spec)
    ids = _ids(1)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    sd = model.state_dict()
    snapshot = {k: v.clone() for k, v in sd.items()}
    merged = merged_state_dict(sd, spec)
    plain_keys = list(factory(2).state_dict())  # tied: lm_head.weight is there too
    assert list(merged) == plain_keys
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    for k, v in sd.items():  # pure
        assert torch.equal(v, snapshot[k]), k
    assert (
        merged_state_dict({k.removeprefix(PEFT_PREFIX): v for k, v in sd.items()}, spec).keys()
        == merged.keys()
    )
    peft_merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert list(peft_merged) == plain_keys
    for k, v in merged.items():
        assert v.dtype == peft_merged[k].dtype, k
        assert (v - peft_merged[k]).abs().max() <= 1e-6, k
    adapted = {
        k.removeprefix(PEFT_PREFIX).split(".lora_A.")[0] + ".weight" for k in sd if ".lora_A." in k
    }
    assert len(adapted) == 2 * (len(targets) - ("lm_head" in targets)) + ("lm_head" in targets)

    def source(key: str) -> str:  # the peft key a plain key comes from
        module, leaf = key.rsplit(".", 1)
        wrapped = f"{PEFT_PREFIX}{module}.base_layer.{leaf}"
        return wrapped if wrapped in snapshot else PEFT_PREFIX + key

    changed = {k for k, v in merged.items() if not torch.equal(v, snapshot[source(k)])}
    assert changed == adapted  # exactly the adapted weights are merged
    fresh = factory(2)
    fresh.load_state_dict(merged, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, want, rtol=0, atol=1e-5)
        assert (factory(1)(input_ids=ids).logits - want).abs().max() > 1e-3  # B matters


def test_merged_state_dict_refuses_what_it_cannot_merge() -> None:
    sd = _lora(tiny_qwen3, 3).state_dict()
    a_key = next(k for k in sd if ".lora_A." in k)
    without_b = {k: v for k, v in sd.items() if k != a_key.replace("lora_A", "lora_B")}
    with pytest.raises(LoraError, match="lora_A without lora_B"):
        merged_state_dict(without_b, SPEC)
    with pytest.raises(LoraError, match="full state dict"):
        merged_state_dict({k: v for k, v in sd.items() if "lora_" in k}, SPEC)
    with pytest.raises(LoraError, match=r"train\.lora\.r is 8 .* rank 4"):
        merged_state_dict(sd, LoraSpec(r=8))
    with pytest.raises(LoraError, match="twice"):
        merged_state_dict({**sd, **{k.removeprefix(PEFT_PREFIX): v for k, v in sd.items()}}, SPEC)
    # a tied weight that some other getter merged: refused rather than half-merged
    model = apply_lora(_tied_qwen3(3), SPEC)
    tied = dict(model.state_dict())
    tied[PEFT_PREFIX + "model.embed_tokens.weight"] = tied[
        PEFT_PREFIX + "model.layers.0.self_attn.q_proj.base_layer.weight"
    ]
    with pytest.raises(LoraError, match=r"q_proj shares its weight with model\.embed_tokens"):
        merged_state_dict(tied, SPEC)


# --- tree training --------------------------------------------------------------------


def _compare_lora(
    model: torch.nn.Module, trees: list[TrainTree], cfg: LossConfig, max_tokens: int, attention: str
) -> None:
    """Tree vs per-path gradients on the adapters; the frozen weights get none."""
    compare_to_paths(model, trees, cfg, max_tokens, attention=attention)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize(
    ("factory", "seed", "max_tokens", "attention"),
    [
        (tiny_qwen3, 0, 10_000, "blocks"),
        (tiny_qwen3, 2, 45, "blocks"),
        (tiny_qwen3, 3, 9, "dense"),
        (tiny_qwen2, 6, 16, "blocks"),
    ],
)
def test_lora_grads_equal_per_path(
    factory: Factory, seed: int, max_tokens: int, attention: str
) -> None:
    spec = LoraSpec(r=4, alpha=8.0, targets=(*SPEC.targets, "down_proj"))
    _compare_lora(
        _lora(factory, seed, spec),
        random_trees(seed),
        LossConfig(correction="tis"),
        max_tokens,
        attention,
    )


def test_tree_trainer_step_moves_only_the_adapters_like_per_path_sgd() -> None:
    model = _lora(tiny_qwen3, 4)
    rng = np.random.default_rng(4)
    trees = [random_tree(rng, f"e{i}", n_segments=int(rng.integers(2, 9))) for i in range(3)]
    enable_tree_attention(model)
    true = recompute_logprobs(model, pack_trees(trees, 10_000))
    rollout = true + 0.3 * torch.randn(true.shape, generator=torch.Generator().manual_seed(4))
    trees = with_rollout(trees, pack_trees(trees, 10_000).to_segment_arrays(rollout.numpy()))
    ref = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = LossConfig(correction="tis", C=1.2)
    trainer = TreeTrainer(
        model,
        torch.optim.SGD(trainable_parameters(model), lr=0.5),
        cfg,
        max_tokens=13,
        max_grad_norm=1.0,
    )
    metrics = trainer.step(trees)
    loss = per_path_loss(ref, trees, pack_trees(trees, 10_000).to_segment_arrays(true.numpy()), cfg)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    torch.optim.SGD(trainable_parameters(ref), lr=0.5).step()
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-5)
    assert metrics.grad_norm == pytest.approx(float(norm), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        moved = not torch.equal(p.detach(), before[name])
        assert moved == p.requires_grad, name


# --- lora_dropout ---------------------------------------------------------------------


def test_lora_dropout_only_inside_and_only_when_active() -> None:
    model = _lora(tiny_qwen3, 5, LoraSpec(r=4, alpha=8.0, dropout=0.5))
    ids = _ids(5)

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids).logits

    base = logits()
    torch.testing.assert_close(logits(), base, rtol=0, atol=0)  # eval: no dropout
    with lora_dropout(model, active=True):
        a, b = logits(), logits()
    assert (a - b).abs().max() > 1e-3
    torch.testing.assert_close(logits(), base, rtol=0, atol=0)  # restored
    assert not any(m.training for m in model.modules())
    model.train()
    with lora_dropout(model, active=False):  # off even in a model in train mode
        torch.testing.assert_close(logits(), base, rtol=0, atol=0)
    drops = [m for n, m in model.named_modules() if n.endswith("lora_dropout.default")]
    assert drops and all(isinstance(d, torch.nn.Dropout) and d.training for d in drops)
    plain = tiny_qwen3(5).eval()
    with lora_dropout(plain, active=True), torch.no_grad():  # no LoRA: nothing to do
        torch.testing.assert_close(plain(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_with_lora_dropout_the_old_logprobs_come_from_the_no_grad_pass() -> None:
    """With dropout in the adapters the gradient pass's log-probabilities are not the
    no-grad pass's, so the trainer keeps both passes (`one_pass` is not enough): the
    mismatch it reports is the rollout's against the dropout-free model."""
    model = _lora(tiny_qwen3, 6, LoraSpec(r=4, alpha=8.0, dropout=0.5))
    assert has_lora_dropout(model)
    assert not has_lora_dropout(_lora(tiny_qwen3, 6)) and not has_lora_dropout(tiny_qwen3(6))
    rng = np.random.default_rng(6)
    trees = [random_tree(rng, f"e{i}", n_segments=int(rng.integers(2, 9))) for i in range(3)]
    enable_tree_attention(model)
    batch = pack_trees(trees, 10_000)
    true = recompute_logprobs(model, batch)
    rollout = true + 0.3 * torch.randn(true.shape, generator=torch.Generator().manual_seed(6))
    trees = with_rollout(trees, batch.to_segment_arrays(rollout.numpy()))
    trainer = TreeTrainer(model, torch.optim.SGD(trainable_parameters(model), lr=0.0),
                          LossConfig(correction="tis"), merge=False)
    m = trainer.step(trees)
    assert m.token_kl == pytest.approx(float((rollout - true).double().mean()), rel=1e-5)
