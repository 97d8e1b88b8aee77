"""token_logprobs against a full float32 log-softmax under plain autograd as the oracle: values,
entropy and every gradient (LoRA factors, trainable token rows, tied and untied heads, temperature,
bfloat16), and the lm_head work the fused gradient saves."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import close, hf_checkpoint, ids

import model as M

pytest.importorskip("transformers")
ROWS = [5, 7]  # token ids given trainable rows; they occur in the inputs and as targets


@pytest.fixture(scope="module", params=["qwen2", "qwen3_tied", "qwen3_odd"])
def path(request, tmp_path_factory):
    return hf_checkpoint(tmp_path_factory, request.param)[1]


def trainable(path, dtype="float32", rows=True):
    """A model with LoRA on every projection and (optionally) trainable rows, all moved off their
    start."""
    model = M.Qwen.from_pretrained(path, dtype=dtype)
    params = M.add_lora(model, rank=4, alpha=8) + (M.train_token_rows(model, ROWS) if rows else [])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.shape[0] == len(ROWS) else 0.05))
    return model


def batch(vocab=200):
    x = ids(2, 23, vocab)
    x[0, 4], x[0, 9], x[1, 2], x[1, 15] = ROWS * 2
    mask = torch.rand(2, 22, generator=torch.Generator().manual_seed(2)) > 0.3
    return x, mask


def oracle(model, x, mask, temperature):
    """log p of each target and the entropy from the full [B, T, vocab] log-softmax, masked."""
    logp = F.log_softmax(model(x)[:, :-1].float() / temperature, -1)
    return logp.gather(-1, x[:, 1:, None])[..., 0] * mask, -(logp.exp() * logp).sum(-1) * mask


def values_and_grads(fn, model, upstream):
    """fn() -> (logp, ent); the values and the gradients of sum(upstream * outputs) for every
    trainable tensor."""
    out = fn()
    params = [p for p in model.parameters() if p.requires_grad]
    loss = sum((u * o).sum() for u, o in zip(upstream, out))
    return [o.detach() for o in out], torch.autograd.grad(loss, params)


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize(
    "temperature,entropy,chunk", [(0.7, True, 5), (1.0, False, 1024), (1.3, True, 64)]
)
def test_values_and_gradients_equal_full_log_softmax(path, temperature, entropy, chunk):
    model = trainable(path)
    x, mask = batch()
    g = torch.Generator().manual_seed(3)
    upstream = [
        torch.randn(2, 22, generator=g),
        torch.randn(2, 22, generator=g) if entropy else torch.zeros(2, 22),
    ]

    def ours():
        out = M.token_logprobs(model, x, mask, temperature, entropy=entropy, chunk_size=chunk)
        return out if entropy else (out, torch.zeros(2, 22))

    (logp, ent), grads = values_and_grads(ours, model, upstream)
    (ref_logp, ref_ent), ref_grads = values_and_grads(
        lambda: oracle(model, x, mask, temperature), model, upstream
    )
    close(logp, ref_logp)
    if entropy:
        close(ent, ref_ent)
    assert len(grads) == len(ref_grads) and len(grads) > 2 * 7 * 2  # LoRA factors and the rows
    for a, b in zip(grads, ref_grads):
        assert b.abs().max() > 0 and relative_error(a, b) < 1e-5, relative_error(a, b)


def test_bfloat16_model_within_rounding_of_the_oracle(path):
    """bfloat16 weights and hidden states, float32 softmax: the values equal the oracle's on the
    same bfloat16 logits, and every gradient is as close to exact arithmetic (the same weights in
    float32) as the oracle's."""
    model = trainable(path, "bfloat16")
    exact = copy.deepcopy(model).float()
    x, mask = batch()
    upstream = [torch.randn(2, 22, generator=torch.Generator().manual_seed(4)), torch.ones(2, 22)]
    (logp, ent), grads = values_and_grads(
        lambda: M.token_logprobs(model, x, mask, 0.8, entropy=True, chunk_size=7), model, upstream
    )
    (ref_logp, ref_ent), ref_grads = values_and_grads(
        lambda: oracle(model, x, mask, 0.8), model, upstream
    )
    _, exact_grads = values_and_grads(lambda: oracle(exact, x, mask, 0.8), exact, upstream)
    close(logp, ref_logp)
    close(ent, ref_ent)
    for a, b, c in zip(grads, ref_grads, exact_grads):
        assert a.dtype == torch.float32 and relative_error(a, c) < 1.5 * relative_error(b, c) + 1e-3


def test_rows_switched_off_and_no_rows(path):
    """With lora_disabled the rows get no gradient and the base head is used; a model without rows
    works."""
    model = trainable(path)
    x, mask = batch()
    with M.lora_disabled(model):
        logp = M.token_logprobs(model, x, mask)
        close(logp, oracle(model, x, mask, 1.0)[0])
        assert not logp.requires_grad  # nothing trainable is in use
    model = trainable(path, rows=False)
    (logp,), grads = values_and_grads(
        lambda: [M.token_logprobs(model, x, mask, 0.9)], model, [torch.ones(2, 22)]
    )
    (ref,), ref_grads = values_and_grads(
        lambda: oracle(model, x, mask, 0.9)[:1], model, [torch.ones(2, 22)]
    )
    close(logp, ref)
    assert max(relative_error(a, b) for a, b in zip(grads, ref_grads)) < 1e-5


def test_trainable_lm_head_falls_back_with_exact_gradients(path):
    model = trainable(path)
    model.head_weight().requires_grad_(True)
    x, mask = batch()
    upstream = [torch.randn(2, 22, generator=torch.Generator().manual_seed(5)), torch.ones(2, 22)]
    (logp, ent), grads = values_and_grads(
        lambda: M.token_logprobs(model, x, mask, 0.7, entropy=True, chunk_size=6), model, upstream
    )
    (ref_logp, ref_ent), ref_grads = values_and_grads(
        lambda: oracle(model, x, mask, 0.7), model, upstream
    )
    close(logp, ref_logp)
    close(ent, ref_ent)
    assert max(relative_error(a, b) for a, b in zip(grads, ref_grads)) < 1e-5


def count_head_passes(model, fn):
    """How many times the lm_head runs (model.logits calls) during fn()."""
    calls = []
    logits = model.logits
    model.logits = lambda h: calls.append(len(h)) or logits(h)
    try:
        fn()
    finally:
        del model.logits
    return len(calls)


def test_the_head_runs_once_per_chunk_and_never_in_backward(path):
    model = trainable(path)
    x, mask = batch()
    chunks = -(-int(mask.sum()) // 8)

    def forward_backward(entropy):
        out = M.token_logprobs(model, x, mask, entropy=entropy, chunk_size=8)
        sum(o.sum() for o in (out if entropy else [out])).backward()

    assert count_head_passes(model, lambda: forward_backward(False)) == chunks
    assert count_head_passes(model, lambda: forward_backward(True)) == chunks
    model.head_weight().requires_grad_(True)  # the fallback recomputes each chunk in backward
    assert count_head_passes(model, lambda: forward_backward(False)) == 2 * chunks


def test_nothing_selected_and_inference(path):
    model = trainable(path)
    x, mask = batch()
    logp, ent = M.token_logprobs(model, x, torch.zeros_like(mask), entropy=True)
    assert torch.equal(logp, torch.zeros(2, 22)) and torch.equal(ent, torch.zeros(2, 22))
    (logp.sum() + ent.sum()).backward()
    with torch.inference_mode():
        logp, ent = M.token_logprobs(model, x, mask, 1.2, entropy=True, chunk_size=4)
    ref_logp, ref_ent = oracle(model, x, mask, 1.2)
    close(logp, ref_logp)
    close(ent, ref_ent)
