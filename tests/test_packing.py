"""Packed training batches (model.Packing): sequences concatenated into one row without padding
must give the logits, losses and gradients of the same sequences as right-padded rows (the oracle),
in every family: positions restart per sequence (RoPE), attention stays within a sequence, and
Qwen3.5's causal conv and delta-rule recurrence start from zeros at each sequence."""

import pytest
import torch
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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_loss_and_gradients_equal_the_padded_batch(family):
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
