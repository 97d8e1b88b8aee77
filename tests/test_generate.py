"""generate on batches whose rows end at different steps: lazy compaction of finished rows, the
rows-per-chunk cap and the sampler, against transformers' greedy generate, one-row-at-a-time
generation, a hand-built model whose outputs are known in advance, and the sampling distribution;
the static decode step (decode="static", "compiled") against the eager one."""

import pytest
import torch
from helpers import (
    FAMILIES,
    Q35_TEXT,
    close,
    hf_checkpoint,
    hf_greedy,
    ids,
    prompt_sampler,
    random_model,
    randomize,
)

import model as M

transformers = pytest.importorskip("transformers")
scipy_stats = pytest.importorskip("scipy.stats")

# the default, never compacting, compacting at every check, a cap of 3 rows, and one row at a time
POLICIES = [dict(), dict(compact_below=0.0), dict(compact_below=1.0, max_rows=3), dict(max_rows=1)]


# qwen3_5_text in the slow tier only: test_qwen35 compares
# its greedy decode and its cache in the fast one
@pytest.fixture(
    scope="module", params=["qwen2", pytest.param("qwen3_5_text", marks=pytest.mark.slow)]
)
def pair(request, tmp_path_factory):
    # its greedy paths vary more than the qwen3 fixtures', which soon repeat a token
    if request.param == "qwen2":
        hf, path = hf_checkpoint(tmp_path_factory, "qwen2")
    else:
        path = tmp_path_factory.mktemp("qwen3_5_text")
        torch.manual_seed(0)
        hf = transformers.Qwen3_5ForCausalLM(
            transformers.Qwen3_5TextConfig(**Q35_TEXT, tie_word_embeddings=False)
        )
        randomize(hf.float().eval())
        hf.save_pretrained(path)
    return hf, M.Qwen.from_pretrained(path, dtype="float32")


def ragged_prompts():
    prompts = [ids(1, n, seed=30 + n)[0].tolist() for n in (9, 3, 14, 6, 11, 4, 8)]
    return prompts + [prompts[2], prompts[0]]  # two repeated prompts, as in a GRPO group


def eos_apart(free: list[list[int]], n: int) -> list[int]:
    """EOS ids, picked greedily from the rows' free-running outputs, under which the rows end at as
    many different steps as possible while some row never ends. The result is asserted, so a changed
    fixture cannot quietly test less."""

    def ends(eos):
        return [next((i + 1 for i, t in enumerate(row) if t in eos), n) for row in free]

    eos = []
    for t in sorted({t for row in free for t in row}):
        if n in ends(eos + [t]) and len(set(ends(eos + [t]))) > len(set(ends(eos))):
            eos.append(t)
    lengths = ends(eos)
    assert len(set(lengths)) >= 4 and min(lengths) <= M.FINISHED_CHECK_EVERY < max(lengths), lengths
    return eos


def test_greedy_with_eos_equals_transformers_under_every_compaction_policy(pair):
    hf, ours = pair
    prompts, n = ragged_prompts(), 20
    eos = eos_apart(M.generate(ours, prompts, max_new_tokens=n, temperature=0), n)
    expected = {tuple(p): hf_greedy(hf, p, n, eos) for p in prompts}
    for policy in POLICIES:
        got = M.generate(
            ours, prompts, max_new_tokens=n, temperature=0, eos_token_ids=eos, **policy
        )
        assert got == [expected[tuple(p)] for p in prompts]


def test_repetition_penalty_and_logprobs_survive_compaction(pair):
    _, ours = pair
    prompts, n = ragged_prompts(), 20
    kw = dict(max_new_tokens=n, temperature=0, repetition_penalty=1.3, return_logprobs=True)
    kw["eos_token_ids"] = eos_apart(M.generate(ours, prompts, **kw)[0], n)
    # one row at a time: nothing to compact
    tokens, logps = M.generate(ours, prompts, **kw, max_rows=1)
    for policy in POLICIES[:-1]:
        got = M.generate(ours, prompts, **kw, **policy)
        assert got[0] == tokens
        close(torch.tensor(sum(got[1], [])), torch.tensor(sum(logps, [])), 1e-4)


def test_seeded_sampling_is_repeatable_and_independent_of_the_batch(pair):
    _, ours = pair
    prompts, n = ragged_prompts(), 20
    kw = dict(max_new_tokens=n, temperature=1.2, top_k=60, top_p=0.95, seed=3)
    free = M.generate(ours, prompts, **kw)
    kw["eos_token_ids"] = eos = eos_apart(free, n)
    first = M.generate(ours, prompts, **kw)
    # a row draws with its own uniforms, so an EOS only cuts it short
    assert first == [row[: next((i + 1 for i, t in enumerate(row) if t in eos), n)] for row in free]
    for policy in POLICIES[1:]:
        assert M.generate(ours, prompts, **kw, **policy) == first
    # row i depends on row i only
    assert M.generate(ours, prompts[:4] + [[1, 2, 3]], **kw)[:4] == first[:4]
    assert M.generate(ours, prompts, **dict(kw, seed=4)) != first
    group = M.generate(ours, [prompts[0]] * 6, **kw)
    assert len({tuple(t) for t in group}) > 1  # the rows of a group draw independently


def counter_model(family: str) -> M.Qwen:
    """A model whose greedy next token is (previous token + 1) mod 128: every layer's output
    projection is zero, so the residual stream is the one-hot embedding of the last token, and
    lm_head row j is the embedding of j - 1. Layers still run and fill the cache as usual."""
    raw = dict(
        model_type=family,
        vocab_size=128,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=1e6,
        tie_word_embeddings=False,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
    )
    model = M.Qwen(M.QwenConfig.from_dict(raw, "counter"))
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                p.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(128))
        model.lm_head.weight.copy_(torch.eye(128).roll(1, 0))
        model.model.norm.weight.fill_(1.0 if family == "qwen3" else 0.0)  # qwen3_5 stores 1 + w
    return model.eval()


def cache_bytes_per_row(cfg: M.QwenConfig, slots: int) -> int:
    """By hand: float32 K and V per attention layer; conv inputs and the delta-rule state per Gated
    DeltaNet layer."""
    n_full = cfg.layer_types.count("full_attention")
    channels = 2 * cfg.linear_k_heads * cfg.linear_k_dim + cfg.linear_v_heads * cfg.linear_v_dim
    linear = (
        channels * (cfg.conv_kernel - 1) + cfg.linear_v_heads * cfg.linear_k_dim * cfg.linear_v_dim
    )
    return 4 * (
        n_full * 2 * cfg.num_kv_heads * slots * cfg.head_dim + (cfg.num_layers - n_full) * linear
    )


class CacheWatch:
    """Watches the caches that generate allocates (new_cache, and share_prompts for a group's rows),
    from outside: the most bytes a cache's tensors held at once (each layer's state list is swapped
    for one that records, before any tensor is replaced, the bytes of every tensor then held, a
    shared prefix's included, plus the new one) and the number of Cache.select calls."""

    def __init__(self, model, monkeypatch):
        self.caches, self.peaks, self.copies = [], [], 0
        new_cache, share_prompts, select = model.new_cache, M.share_prompts, M.Cache.select

        def watched(cache):
            cache.layers = [self.Layer(layer, self, len(self.caches)) for layer in cache.layers]
            self.caches.append(cache)
            self.peaks.append(self.held(cache))
            return cache

        def counted_select(cache, rows):
            self.copies += 1
            return select(cache, rows)

        monkeypatch.setattr(model, "new_cache", lambda *args: watched(new_cache(*args)))
        monkeypatch.setattr(M, "share_prompts", lambda *args: watched(share_prompts(*args)))
        monkeypatch.setattr(M.Cache, "select", counted_select)

    @staticmethod
    def held(cache) -> int:
        assert all(isinstance(layer, CacheWatch.Layer) for layer in cache.layers)  # still watched
        shared = (
            []
            if cache.prefix is None
            else [t for layer in cache.prefix.layers.values() for t in layer]
        )
        return sum(t.nbytes for layer in cache.layers for t in layer) + sum(
            t.nbytes for t in shared
        )

    class Layer(list):
        def __init__(self, tensors, watch, index):
            super().__init__(tensors)
            self.watch, self.index = watch, index

        def __setitem__(self, i, tensor):
            peaks = self.watch.peaks
            peaks[self.index] = max(
                peaks[self.index], self.watch.held(self.watch.caches[self.index]) + tensor.nbytes
            )
            super().__setitem__(i, tensor)

    def reset(self):
        self.caches, self.peaks, self.copies = [], [], 0


@pytest.mark.parametrize("family", ["qwen3", pytest.param("qwen3_5_text", marks=pytest.mark.slow)])
def test_64_rows_ending_at_64_steps_copy_the_cache_log_b_times(family, monkeypatch):
    model = counter_model(family)
    watch = CacheWatch(model, monkeypatch)
    # row r emits 64 + r, 65 + r, ... and ends on 127 at step 63 - r
    prompts = [[5, 63 + r] for r in range(64)]
    expected = [list(range(64 + r, 128)) for r in range(64)]
    need = 64 * cache_bytes_per_row(model.config, 2 + 64)
    # a copy adds one tensor of at most compact_below x its rows, and K (or V) is at most half
    # the cache; the hybrid's recurrent state, replaced at every step, adds one layer's state
    checks = 64 // M.FINISHED_CHECK_EVERY
    for policy, most_copies, most_bytes in (
        ({}, 6, 1.25),
        (dict(compact_below=1.0), checks, 1.5),
        (dict(compact_below=0.0), 0, 1.1),
    ):
        watch.reset()
        assert (
            M.generate(
                model, prompts, max_new_tokens=64, temperature=0, eos_token_ids=[127], **policy
            )
            == expected
        )
        assert len(watch.caches) == 1 and watch.copies <= most_copies
        assert need <= watch.peaks[0] <= most_bytes * need
    watch.reset()
    assert (
        M.generate(
            model, prompts, max_new_tokens=64, temperature=0, eos_token_ids=[127], max_rows=16
        )
        == expected
    )
    assert len(watch.caches) == 4 and all(
        need / 4 <= peak <= 1.25 * need / 4 for peak in watch.peaks
    )
    watch.reset()
    prompt = [5] * 30 + [100]
    group = M.generate(model, [prompt] * 8, max_new_tokens=40, temperature=0, eos_token_ids=[127])
    assert group == [list(range(101, 128))] * 8 and watch.copies == 0 and len(watch.caches) == 2
    # the prompt is prefilled once and its K/V kept once (copies per row
    # would add 8 x 31 slots); each row holds its 40 new tokens (and its
    # own DeltaNet states, the recurrent one briefly twice when replaced)
    cfg = model.config
    once, rows = cache_bytes_per_row(cfg, len(prompt)), 8 * cache_bytes_per_row(cfg, 40)
    state = (
        4 * cfg.linear_v_heads * cfg.linear_k_dim * cfg.linear_v_dim
        if family == "qwen3_5_text"
        else 0
    )
    assert (
        once <= watch.peaks[0] <= once + state and rows < watch.peaks[1] <= once + rows + 8 * state
    )


def test_host_reads_come_every_few_steps_not_every_token(monkeypatch):
    """Reading a tensor on the host is a GPU sync: generate may do it at the start, every
    FINISHED_CHECK_EVERY steps and at the end, never once per token."""
    model = counter_model("qwen3")
    reads = []
    for name in ("__bool__", "__int__", "__float__", "item", "tolist"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda t, *a, _m=method, _n=name: reads.append(_n) or _m(t, *a)
        )
    prompts = [[5, 63 + r] for r in range(64)]
    assert M.generate(model, prompts, max_new_tokens=64, temperature=0, eos_token_ids=[127])[
        0
    ] == list(range(64, 128))
    assert 64 // M.FINISHED_CHECK_EVERY <= len(reads) <= 64 // M.FINISHED_CHECK_EVERY + 4, reads


def test_sampler_draws_from_the_filtered_softmax():
    from transformers.generation import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.tensor([[2.0, 1.5, 0.3, -1.0, 1.0, 0.0, -3.0, 1.9]])
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.9)):
        scaled = logits / temperature
        if top_k:
            scaled = TopKLogitsWarper(top_k)(None, scaled)
        if top_p < 1:
            scaled = TopPLogitsWarper(top_p)(None, scaled)
        probs = scaled.double().softmax(-1)[0]
        n = 40000
        uniform = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        drawn = M.sample_next(logits.expand(n, -1), temperature, top_k, top_p, uniform)
        counts = torch.bincount(drawn, minlength=8).double()
        assert counts[probs == 0].sum() == 0
        kept = probs > 0
        assert scipy_stats.chisquare(counts[kept], n * probs[kept]).pvalue > 1e-3
        # inverse CDF: the first token whose cumulative probability exceeds u
        for u in (0.0, 0.3, 0.999999):
            first = int((probs.cumsum(0) > u).nonzero()[0])
            assert (
                M.sample_next(
                    logits, temperature, top_k, top_p, torch.tensor([u], dtype=torch.float64)
                )
                == first
            )


def test_bad_chunk_settings_are_clear_errors():
    model = counter_model("qwen3")
    for bad in (
        dict(max_rows=0),
        dict(compact_below=1.5),
        dict(compact_below=-0.1),
        dict(decode="graph"),
    ):
        with pytest.raises(ValueError, match="generate: invalid settings"):
            M.generate(model, [[1, 2]], max_new_tokens=2, **bad)


# ----------------------------------------------------------------------------- the static step


def decode_cases(model):
    """(rows, generate's settings) under which the static step must give the eager tokens: unique
    prompts (a cache of prompt + new slots); GRPO groups sharing their prompts (a SharedPrefix),
    greedy with rows ending at different steps (frozen rows), sampled with log-probabilities, and
    with a repetition penalty."""
    vocab = model.config.vocab_size
    prompts = [ids(1, n, vocab=vocab, seed=40 + n)[0].tolist() for n in (9, 3, 70)]
    grouped = prompts + [prompts[0]] * 3 + [prompts[2]] * 2
    free = M.generate(model, grouped, 12, temperature=0)
    eos = sorted({row[3] for row in free[:2]} | {free[2][7]})  # ends at steps 4 and 8, or never
    return [
        (prompts, dict(temperature=0)),
        (grouped, dict(temperature=0, eos_token_ids=eos)),
        (grouped, dict(temperature=1.0, seed=3, return_logprobs=True, eos_token_ids=eos)),
        (grouped, dict(temperature=0.7, top_k=20, repetition_penalty=1.3, seed=4)),
    ]


def cache_addresses(cache) -> list[int]:
    return [cache.lens.data_ptr()] + [t.data_ptr() for layer in cache.layers for t in layer]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_static_decode_gives_the_eager_tokens_with_fixed_shapes_and_addresses(family, monkeypatch):
    """The static step is what a CUDA graph captures: every step the same shapes (width), every
    cache tensor written in place (the same addresses before and after each step), no compaction;
    the tokens are the eager path's."""
    model = random_model(family)
    steps = []
    decode_logits = M.decode_logits

    def watched(model, token, cache, live):
        before = (cache_addresses(cache), cache.width, token.shape)
        logits = decode_logits(model, token, cache, live)
        steps.append((before, (cache_addresses(cache), cache.width, token.shape)))
        return logits

    cases = decode_cases(model)
    ends = {len(row) for row in M.generate(model, *cases[1][0:1], 12, **cases[1][1])}
    assert len(ends) > 1  # the greedy rows end at different steps: frozen rows
    for rows, settings in cases:
        eager = M.generate(model, rows, 12, **settings)
        monkeypatch.setattr(M, "decode_logits", watched)
        monkeypatch.setattr(M.Cache, "select", None)  # a static cache keeps its rows
        static = M.generate(model, rows, 12, decode="static", **settings)
        monkeypatch.undo()
        if settings.get("return_logprobs"):
            assert static[0] == eager[0]
            for a, b in zip(static[1], eager[1]):
                assert a == pytest.approx(b, abs=1e-5)
        else:
            assert static == eager
        assert len(steps) >= 5 and all(before == after == steps[0][0] for before, after in steps)
        steps.clear()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_compiled_decode_gives_the_eager_tokens(family):
    """torch.compile of the static step (about 15 s of compilation per shape on the CPU)."""
    model = random_model(family)
    for rows, settings in decode_cases(model)[:3]:
        eager = M.generate(model, rows, 12, **settings)
        compiled = M.generate(model, rows, 12, decode="compiled", **settings)
        assert compiled[0] == eager[0] if settings.get("return_logprobs") else compiled == eager


# ------------------------------------------------------------------ LoRA off the decode path


def lora_policy(dtype: torch.dtype) -> M.Qwen:
    """A Qwen3 of FAMILIES' shape in `dtype`, matrices N(0, 0.1), with a LoRA whose B is N(0, 0.05)
    (its delta counts)."""
    torch.manual_seed(0)
    model = M.Qwen(M.QwenConfig.from_dict(dict(FAMILIES["qwen3"]))).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    model.to(dtype)
    M.add_lora(model, rank=4, alpha=8)
    with torch.no_grad():
        for m in M.lora_modules(model).values():
            m.lora_B.normal_(0, 0.05)
    return model


def sampler_trainer_gap(model, rows, tokens, logps) -> float:
    """GRPO's logp_mismatch/max: the largest gap between the sampler's log-probabilities and the
    trainer's (token_logprobs, through the LoRA's side path) of the sampled tokens."""
    gaps = []
    with torch.no_grad():
        for prompt, new, logp in zip(rows, tokens, logps):
            trained = M.token_logprobs(model, torch.tensor([prompt + new]))[0, len(prompt) - 1 :]
            gaps.append((trained - torch.tensor(logp)).abs().max().item())
    return max(gaps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_rollout_decodes_off_the_lora_side_path_with_its_tokens_and_weights_unchanged(dtype):
    """rollout.PromptSampler decodes with the LoRA merged (model.lora_merged): no adapted
    projection runs its side path, and every parameter is the same tensor with the same bits after
    the rollout. float32: the tokens and log-probabilities of the unmerged decode (plain generate
    on the LoRA model). bfloat16, where a sampled draw flips with the rounding: the gap between the
    sampler's log-probabilities and the trainer's stays of the unmerged decode's order (measured:
    0.018 against 0.013)."""
    model = lora_policy(dtype)
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    sampler = prompt_sampler(model, 3, 10, temperature=1.0, decode="eager")
    prompts = [[1, 2, 3, 4], [5, 6]]
    rows = [p for p in prompts for _ in range(3)]
    side_path = []
    hooks = [
        m.register_forward_pre_hook(lambda m, args: side_path.append(m.lora_enabled))
        for m in M.lora_modules(model).values()
    ]
    tokens, logps = sampler.complete(prompts, seed=7)
    for hook in hooks:
        hook.remove()
    assert side_path and not any(side_path)
    for name, p in model.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1]), name
    expected, expected_logps = M.generate(
        model, rows, 10, temperature=1.0, seed=7, return_logprobs=True
    )
    if dtype == torch.float32:
        assert tokens == expected
        for a, b in zip(logps, expected_logps):
            assert a == pytest.approx(b, abs=1e-4)
    else:
        unmerged = sampler_trainer_gap(model, rows, expected, expected_logps)
        assert 0 < sampler_trainer_gap(model, rows, tokens, logps) < min(2 * unmerged, 0.05)
