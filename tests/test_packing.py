"""Packed training batches (model.Packing): sequences concatenated into one row without padding
must give the logits, losses and gradients of the same sequences as right-padded rows (the oracle),
in every family: positions restart per sequence (RoPE), attention stays within a sequence, and
Qwen3.5's causal conv and delta-rule recurrence start from zeros at each sequence."""

import pytest
import torch
import torch.nn.functional as F
from helpers import FAMILIES, random_model

import model as M
import train as T

LENGTHS = [70, 5, 33, 1]  # 70: Qwen3.5's recurrence crosses a 64-token chunk; 1: nothing to predict


def sequences(vocab: int, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g) for n in LENGTHS]


def loss_weights(seed=1) -> list[torch.Tensor]:
    """Per next-token target weights of each sequence [n - 1], some zero (masked out)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.rand(n - 1, generator=g) * (torch.rand(n - 1, generator=g) > 0.3) for n in LENGTHS
    ]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_logits_equal_each_sequence_alone(family):
    model = random_model(family)
    seqs = sequences(model.config.vocab_size)
    packing = M.Packing.of(LENGTHS, "cpu")
    with torch.no_grad():
        packed = model(torch.cat(seqs)[None], packing=packing)[0]
        alone = torch.cat([model(s[None])[0] for s in seqs])
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


def cpu_varlen_attn(calls: list):
    """torch.nn.attention.varlen.varlen_attn (torch 2.13's signature) with its documented meaning,
    computed on the CPU, where torch's own runs nowhere: q [N, H, D] attends to the k, v [N, Hkv,
    D] of its own sequence (cu_seq offsets), causally for window_size (-1, 0), all of it for (-1,
    -1); GQA only with enable_gqa. SDPA with a block mask computes it. `calls` gets each call's
    keywords and maxima."""

    def varlen_attn(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
        calls.append((window_size, enable_gqa, max_q, max_k))
        lens = cu_seq_q.diff().long()
        seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
        allowed = seq[:, None] == seq[None, :]
        if window_size == (-1, 0):
            allowed &= torch.arange(len(seq))[None, :] <= torch.arange(len(seq))[:, None]
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, allowed, scale=scale, enable_gqa=enable_gqa)
        return out[0].transpose(0, 1)

    return varlen_attn


@pytest.fixture
def torch_varlen(monkeypatch):
    """model.varlen_kernel finding no flash-attn and torch's varlen_attn as `cpu_varlen_attn`;
    yields the calls made."""
    calls = []
    monkeypatch.setattr(
        M,
        "KERNELS",
        {
            ("flash_attn", "flash_attn_varlen_func"): None,
            ("torch.nn.attention.varlen", "varlen_attn"): cpu_varlen_attn(calls),
        },
    )
    yield calls


def test_torchs_varlen_attention_is_called_causal_with_gqa_and_gives_each_sequence_alone(
    torch_varlen,
):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, sum(LENGTHS), 4, 8, generator=g)
    k, v = (torch.randn(1, sum(LENGTHS), 2, 8, generator=g) for _ in "kv")
    packing = M.Packing.of(LENGTHS, "cpu")
    per_sequence = M.packed_attention(q, k, v, packing)  # the CPU's way, no kernel
    assert torch_varlen == []
    found = M.varlen_kernel()(q[0], k[0], v[0], packing.cu, max(LENGTHS))
    assert torch_varlen == [((-1, 0), True, 70, 70)]
    torch.testing.assert_close(found[None], per_sequence, rtol=1e-5, atol=1e-6)


def test_packing_runs_a_varlen_kernel_only_on_cuda_in_half_precision_and_with_gqa(
    torch_varlen, monkeypatch
):
    assert M.varlen_kernel() is not None
    for dtype in (torch.float32, torch.bfloat16):
        assert M.packed_kernel(torch.zeros(1, dtype=dtype)) is None  # no flash kernel on a CPU

    def without_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1)):
        raise AssertionError("a varlen_attn without enable_gqa is never called")

    monkeypatch.setattr(M, "KERNELS", {("torch.nn.attention.varlen", "varlen_attn"): without_gqa})
    assert M.varlen_kernel() is None  # this torch's packed batches take the per-sequence loop


@pytest.mark.parametrize("kernel", ["per-sequence SDPA", "varlen"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_loss_and_gradients_equal_the_padded_batch(family, kernel, request, monkeypatch):
    """ "varlen": the packed batch through torch's varlen attention as model.py calls it on a GPU
    (`cpu_varlen_attn` standing in for its CUDA kernel)."""
    calls = request.getfixturevalue("torch_varlen") if kernel == "varlen" else []
    if kernel == "varlen":
        monkeypatch.setattr(M, "packed_kernel", lambda q: M.varlen_kernel())
    model = random_model(family).train()
    params = list(model.parameters())
    seqs, weights = sequences(model.config.vocab_size), loss_weights()

    def loss_and_grads(logp_fn):
        loss = -logp_fn()
        return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)

    width = max(LENGTHS)
    padded = torch.zeros(len(seqs), width, dtype=torch.long)
    padded_w = torch.zeros(len(seqs), width - 1)
    for i, (s, w) in enumerate(zip(seqs, weights)):
        padded[i, : len(s)], padded_w[i, : len(w)] = s, w
    packed_w = torch.cat([torch.cat([w, torch.zeros(1)]) for w in weights])[:-1][None]
    packing = M.Packing.of(LENGTHS, "cpu")

    expected, expected_grads = loss_and_grads(
        lambda: (padded_w * M.token_logprobs(model, padded, padded_w > 0)).sum()
    )
    found, found_grads = loss_and_grads(
        lambda: (
            packed_w * M.token_logprobs(model, torch.cat(seqs)[None], packed_w > 0, packing=packing)
        ).sum()
    )
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)
    assert sum(g is not None and g.abs().sum() > 0 for g in expected_grads) > len(params) // 2
    for name, a, b in zip([n for n, _ in model.named_parameters()], found_grads, expected_grads):
        assert (a is None) == (b is None), name
        if a is not None:  # float32 sums in another order: tolerance relative to the largest
            scale = b.abs().max().item()
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * scale + 1e-8, msg=name)
    assert bool(calls) == (kernel == "varlen")


def test_the_default_mask_of_a_packed_row_leaves_out_each_sequences_last_token():
    model = random_model("qwen3")
    seqs = sequences(model.config.vocab_size)
    packing = M.Packing.of(LENGTHS, "cpu")
    with torch.no_grad():
        found = M.token_logprobs(model, torch.cat(seqs)[None], packing=packing)[0]
        expected = [M.token_logprobs(model, s[None])[0] for s in seqs]
    boundaries = packing.cu[1:-1].long() - 1
    assert (found[boundaries] == 0).all()
    kept = torch.ones_like(found, dtype=torch.bool).index_fill_(0, boundaries, False)
    torch.testing.assert_close(found[kept], torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_token_budget_parts_take_the_longest_first_and_never_exceed_the_budget():
    assert T.token_budget_parts([3, 9, 4, 12, 2, 5], 10) == [[3], [1], [5, 2], [0, 4]]
    # one sequence longer than the budget goes alone; every index once
    parts = T.token_budget_parts([30, 1, 1], 10)
    assert parts == [[0], [1, 2]]


def test_packing_positions_restart_and_offsets_are_flash_attns():
    # RoPE depends on position differences only, so positions running on across sequences would
    # change the logits by rounding alone: the restart is checked here, on the layout itself
    packing = M.Packing.of([3, 1, 2], "cpu")
    assert packing.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert packing.seq.tolist() == [0, 0, 0, 1, 2, 2]
    assert packing.cu.tolist() == [0, 3, 4, 6] and packing.cu.dtype == torch.int32
    x = torch.arange(6.0)[None, :, None]
    rows = packing.to_rows(x)
    assert rows[..., 0].tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    assert torch.equal(packing.from_rows(rows), x)


def test_a_packed_batch_is_one_row_of_its_lengths_without_a_cache():
    model = random_model("qwen3")
    with pytest.raises(ValueError, match="one row of sum"):
        model(torch.ones(2, 3, dtype=torch.long), packing=M.Packing.of([3], "cpu"))
    with pytest.raises(ValueError, match="positive"):
        M.Packing.of([3, 0], "cpu")
