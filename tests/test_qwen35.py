"""model.py's Qwen3.5 path (hybrid Gated DeltaNet + gated attention) against transformers' qwen3_5
and peft, on tiny random checkpoints with every parameter moved away from its initial value (the
default init, zeros for the zero-centred norms, would hide a `w` vs `1 + w` bug)."""

import json

import pytest
import torch
from helpers import Q35_TEXT, check_cache_against_full_forward, close, hf_greedy, ids, randomize

import model as M
from tokenizer import CheckpointError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    num_position_embeddings=16,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_text"])
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    # image-text checkpoint: text under model.language_model., a vision tower
    if request.param == "qwen3_5":
        cfg = transformers.Qwen3_5Config(
            text_config=Q35_TEXT, vision_config=VISION, tie_word_embeddings=False
        )
        hf = transformers.Qwen3_5ForConditionalGeneration(cfg)
    else:
        hf = transformers.Qwen3_5ForCausalLM(
            transformers.Qwen3_5TextConfig(**Q35_TEXT, tie_word_embeddings=False)
        )
    hf = hf.float().eval()
    randomize(hf)
    hf.save_pretrained(path)
    return hf, M.Qwen.from_pretrained(path, dtype="float32"), path


def test_checkpoint_layout_and_logits_match_transformers(pair):
    hf, ours, path = pair
    assert [layer.mixer_name for layer in ours.model.layers] == ["linear_attn"] * 3 + ["self_attn"]
    if ours.config.weight_prefix == "model.language_model.":
        index = (path / "model.safetensors").read_bytes()[:20000]
        assert (
            b"model.visual." in index
            and b"model.language_model.layers.0.linear_attn.A_log" in index
        )
    x = ids(2, 150)  # three 64-token chunks, the last one partial
    with torch.no_grad():
        close(ours(x), hf(x).logits)


def test_chunked_and_recurrent_forms_agree():
    g = torch.Generator().manual_seed(0)
    B, H, T, dk, dv = 2, 3, 150, 8, 5
    q, k = (M.l2norm(torch.randn(B, H, T, dk, generator=g)) for _ in range(2))
    v = torch.randn(B, H, T, dv, generator=g)
    decay = -torch.rand(B, H, T, generator=g) * 2  # log-decay <= 0
    beta = torch.rand(B, H, T, generator=g)
    state = torch.randn(B, H, dk, dv, generator=g)
    o_rec, s_rec = M.delta_rule_recurrent(q, k, v, decay, beta, state)
    o_chunk, s_chunk = M.delta_rule_chunked(q, k, v, decay, beta, state)
    close(o_chunk, o_rec, 1e-5)
    close(s_chunk, s_rec, 1e-5)
    # and the recurrent form is the delta rule written
    # out: decay, then correct against the decayed state
    S = state.clone()
    for t in range(3):
        S = S * decay[:, :, t, None, None].exp()
        error = v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], beta[:, :, t, None] * error)
    first3 = (x[:, :, :3] for x in (q, k, v, decay, beta))
    close(M.delta_rule_recurrent(*first3, state)[1], S, 1e-6)


@pytest.mark.slow
def test_the_chunked_form_compiles_as_one_graph_with_its_values_and_gradients():
    """torch.compile(fullgraph=True) of the chunk loop (about 15 s of compilation on the CPU): no
    graph break, the same output, state and gradients as eager."""
    g = torch.Generator().manual_seed(1)
    B, H, T, dk, dv = 2, 3, 150, 8, 5
    q, k = (M.l2norm(torch.randn(B, H, T, dk, generator=g)).requires_grad_() for _ in range(2))
    v = torch.randn(B, H, T, dv, generator=g, requires_grad=True)
    decay = -torch.rand(B, H, T, generator=g) * 2
    beta = torch.rand(B, H, T, generator=g)
    state = torch.randn(B, H, dk, dv, generator=g)
    results = []
    for fn in (M.delta_rule_chunked, torch.compile(M.delta_rule_chunked, fullgraph=True)):
        o, s = fn(q, k, v, decay, beta, state)
        grads = torch.autograd.grad((o * o).sum() + s.sum(), (q, k, v))
        results.append((o, s, *grads))
    for a, b in zip(*results):
        close(a, b, 1e-4)


def test_cached_prefill_decode_and_continuation_equal_full_forward(pair):
    # 70 tokens: a full 64-token chunk and a partial one; row 1's padding must not reach its state
    check_cache_against_full_forward(pair[1], lengths=[70, 66], steps=20, chunk=10)


def test_greedy_generate_equals_transformers(pair):
    hf, ours, _ = pair
    prompts = [ids(1, n, seed=20 + n)[0].tolist() for n in (9, 3, 70)]
    expected = [hf_greedy(hf, p, 10, []) for p in prompts]
    assert (
        M.generate(ours, prompts + [prompts[0]], max_new_tokens=10, temperature=0)
        == expected + expected[:1]
    )


def test_adapter_we_save_loads_in_peft_with_equal_logits(pair, tmp_path):
    hf, _, path = pair
    ours = M.Qwen.from_pretrained(path, dtype="float32")
    params = M.add_lora(
        ours, rank=4, alpha=8, targets=M.LORA_TARGETS + ("in_proj_qkv", "in_proj_z", "out_proj")
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    M.save_adapter(ours, tmp_path)
    names = json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]
    assert "in_proj_qkv" in names and "in_proj_a" not in names and "conv1d" not in names
    prefix = "base_model.model." + ours.config.weight_prefix
    with open(tmp_path / "adapter_model.safetensors", "rb") as f:
        assert f"{prefix}layers.0.linear_attn.in_proj_qkv.lora_A.weight".encode() in f.read(
            4096 * 4
        )
    base = type(hf).from_pretrained(path, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    x = ids(2, 80)
    with torch.no_grad():
        close(ours(x), peft_model(x).logits)
        reloaded = M.load_adapter(M.Qwen.from_pretrained(path, dtype="float32"), tmp_path)
        close(reloaded(x), ours(x), 1e-6)


def test_merged_checkpoint_loads_in_transformers(pair, tmp_path):
    hf, _, path = pair
    ours = M.Qwen.from_pretrained(path, dtype="float32")
    params = M.add_lora(ours, rank=4, alpha=8)
    with torch.no_grad():
        for p in params:
            p.add_(0.01)

    class NoTokenizer:
        def save(self, out):
            pass

    M.save_merged(ours, NoTokenizer(), tmp_path)
    merged = type(hf).from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = ids(1, 40)
    with torch.no_grad():
        close(merged(x).logits, ours(x))
    # the vision tower travels along unchanged
    if ours.config.weight_prefix == "model.language_model.":
        assert torch.equal(
            merged.model.visual.patch_embed.proj.weight, hf.model.visual.patch_embed.proj.weight
        )


def test_nine_billion_config_parameter_count():
    """The Qwen3.5-9B text sizes (transformers' defaults) give about 9B parameters without
    vision."""
    cfg = transformers.Qwen3_5TextConfig()
    raw = dict(cfg.to_dict(), model_type="qwen3_5_text")
    with torch.device("meta"):
        ours = M.Qwen(M.QwenConfig.from_dict(raw))
    n = sum(p.numel() for p in ours.parameters())
    assert [t for t in ours.config.layer_types].count("full_attention") == 8
    with torch.device("meta"):
        reference = sum(p.numel() for p in transformers.Qwen3_5ForCausalLM(cfg).parameters())
    assert n == reference and 8.5e9 < n < 9.5e9, n


def test_bad_qwen35_configs_are_clear_errors(pair, tmp_path):
    _, _, path = pair
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    text["layer_types"] = ["linear_attention", "sliding_attention"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="field 'layer_types'"):
        M.QwenConfig.from_json(tmp_path / "config.json")


def test_bfloat16_load_keeps_the_decay_parameters_in_float32(pair):
    _, ours, path = pair
    bf16 = M.Qwen.from_pretrained(path, dtype="bfloat16")
    gdn = bf16.model.layers[0].linear_attn
    assert (
        gdn.A_log.dtype == gdn.dt_bias.dtype == torch.float32
        and gdn.in_proj_qkv.weight.dtype == torch.bfloat16
    )
    x = ids(1, 70)
    with torch.no_grad():
        close(bf16(x).float(), ours(x), tol=5e-2)
        cache = bf16.new_cache(1, 80)
        assert (
            cache.layers[0][1].dtype == torch.float32 and cache.layers[0][0].dtype == torch.bfloat16
        )
