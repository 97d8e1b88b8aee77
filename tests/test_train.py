"""train.py: the LR schedules against hand-computed values, the optimizer groups, checkpoints that
resume bitwise, the gradient all-reduce across two gloo processes, and the stop signal."""

import os
import random
import signal
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import gloo_rank, random_model
from instruments import free_port
from safetensors import safe_open

import checkpoint as CK
import distributed as D
import model as M
import train as T

TINY = dict(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rope_theta=1e4,
    tie_word_embeddings=False,
)


def tiny_model(lora_seed=0, rows=(5, 9), dropout=0.1):
    """The same random base every time; LoRA factors (B too, so they matter) drawn from
    `lora_seed`."""
    torch.manual_seed(0)
    model = M.Qwen(M.QwenConfig.from_dict(dict(TINY)))
    M.add_lora(model, rank=4, alpha=8, dropout=dropout)
    M.train_token_rows(model, list(rows))
    g = torch.Generator().manual_seed(lora_seed)
    with torch.no_grad():
        lora, rows = T.trainable_groups(model)
        for p in lora + rows:
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def batch(seed=0):
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))


def train_steps(model, optimizer, steps, first=0):
    model.train()
    for step in range(first, first + steps):
        T.set_lr(optimizer, T.linear_warmup_decay(step, 10, 1e-2))
        optimizer.zero_grad()
        logp = M.token_logprobs(model, batch(step))
        (-logp.mean()).backward()
        optimizer.step()


# ----------------------------------------------------------------------------- schedules


def test_sft_schedule_hand_values():
    # 200 steps: warm-up over ceil(1% of 200) = 2 steps, then linear to 0 at step 200
    lr = [T.linear_warmup_decay(s, 200, 1e-4) for s in range(200)]
    assert lr[0] == pytest.approx(0.5e-4) and lr[1] == pytest.approx(1e-4)
    assert lr[2] == pytest.approx(1e-4 * 198 / 198)
    assert lr[100] == pytest.approx(1e-4 * 100 / 198)
    assert lr[199] == pytest.approx(1e-4 / 198)
    assert T.linear_warmup_decay(200, 200, 1e-4) == 0.0
    assert T.linear_warmup_decay(0, 10, 1e-4) == pytest.approx(1e-4)  # at least one warm-up step


def test_sft_schedule_with_a_warmup_of_fixed_steps():
    # EmoLLM D.1: 100 warm-up steps; over 300 steps the LR
    # peaks at step 99, then falls linearly over 200 steps
    lr = [T.linear_warmup_decay(s, 300, 2e-4, warmup_steps=100) for s in range(300)]
    assert (
        lr[0] == pytest.approx(2e-6)
        and lr[49] == pytest.approx(1e-4)
        and lr[99] == pytest.approx(2e-4)
    )
    assert (
        lr[100] == pytest.approx(2e-4)
        and lr[200] == pytest.approx(1e-4)
        and lr[299] == pytest.approx(1e-6)
    )
    # fewer steps than the warm-up: the LR is still rising when the run ends
    assert T.linear_warmup_decay(49, 50, 1e-4, warmup_steps=100) == pytest.approx(0.5e-4)


# ----------------------------------------------------------------------------- optimizer


def test_optimizer_groups_rows_at_scaled_lr_without_decay():
    model = tiny_model()
    optimizer = T.build_optimizer(
        model, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.99), row_lr_scale=10.0
    )
    lora, rows = optimizer.param_groups
    assert len(lora["params"]) == 2 * 7 * 2 and lora["weight_decay"] == 0.01
    assert rows["params"] == [model.embed_rows, model.head_rows] and rows["weight_decay"] == 0.0
    T.set_lr(optimizer, 2e-4)
    assert lora["lr"] == pytest.approx(2e-4) and rows["lr"] == pytest.approx(2e-3)
    assert optimizer.defaults["betas"] == (0.9, 0.99)


# ----------------------------------------------------------------------------- checkpoints


def fresh_run(tmp_path, seed=0):
    model = tiny_model(lora_seed=seed)
    return model, T.build_optimizer(model, 1e-2, 0.01, (0.9, 0.99), row_lr_scale=10.0)


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    torch.manual_seed(1)
    random.seed(1)
    model, optimizer = fresh_run(tmp_path)
    train_steps(model, optimizer, 3)
    CK.save_checkpoint(tmp_path, 3, model, optimizer, {"position": 7}, 4)
    train_steps(model, optimizer, 3, first=3)  # dropout draws from the RNG the checkpoint saved
    after = {k: v.clone() for k, v in model.state_dict().items()}
    expected_draw = random.random()

    # different init: everything must come from the checkpoint
    resumed, _ = fresh_run(tmp_path, seed=5)
    torch.manual_seed(99)
    random.seed(99)
    path = CK.latest_checkpoint(tmp_path)
    meta = CK.load_checkpoint(path, resumed, 4)
    optimizer2 = T.build_optimizer(resumed, 1e-2, 0.01, (0.9, 0.99), row_lr_scale=10.0)
    CK.restore_optimizer(path, optimizer2, meta)
    assert meta["step"] == 3 and meta["trainer"] == {"position": 7}
    train_steps(resumed, optimizer2, 3, first=3)
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, after[name]), name
    assert random.random() == expected_draw


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    model, optimizer = fresh_run(tmp_path)
    (tmp_path / ".ckpt-000009.tmp").mkdir()  # a save that died half-way is never picked
    for step in (1, 2, 3):
        CK.save_checkpoint(tmp_path, step, model, optimizer, {}, 4, keep=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-000002", "ckpt-000003"]
    assert CK.latest_checkpoint(tmp_path).name == "ckpt-000003"
    names = {p.name for p in CK.latest_checkpoint(tmp_path).iterdir()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "rng-rank0.safetensors",
        "state.json",
    } <= names
    assert not any(n.endswith((".pt", ".bin", ".pkl")) for n in names)


class Killed(BaseException):
    """SIGKILL's stand-in inside one process: raised where the kill lands, nothing after it runs
    (no handler in the save catches a BaseException)."""


def test_a_kill_while_a_step_is_saved_again_leaves_a_run_that_resumes(tmp_path, monkeypatch):
    """A run whose rollout server died saves the step it stopped at, which may have a checkpoint
    already: a kill while the old folder is being deleted (one file gone) must leave a whole
    `ckpt-*` to resume from (was: the old folder half deleted under its name, the rerun a
    FileNotFoundError traceback)."""
    model, optimizer = fresh_run(tmp_path)
    for step in (1, 2):
        CK.save_checkpoint(tmp_path, step, model, optimizer, {"at": step}, 4)
    rmtree = CK.shutil.rmtree

    def killed_mid_delete(path, *args, **kwargs):
        path = Path(path)
        if path.is_dir() and "ckpt-000002" in path.name and not path.name.endswith(".tmp"):
            next(p for p in sorted(path.iterdir()) if p.is_file()).unlink()
            raise Killed
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(CK.shutil, "rmtree", killed_mid_delete)
    with pytest.raises(Killed):
        CK.save_checkpoint(tmp_path, 2, model, optimizer, {"at": 2}, 4)
    monkeypatch.undo()
    resumed, _ = fresh_run(tmp_path, seed=5)
    optimizer2, meta, path = CK.resume(
        tmp_path, resumed, lambda: T.build_optimizer(resumed, 1e-2, 0.01, (0.9, 0.99)), 4
    )
    assert path.name == "ckpt-000002" and meta["trainer"] == {"at": 2}
    for name, value in model.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


@pytest.mark.parametrize(
    "cut", ["optimizer.safetensors", "adapter_model.safetensors", "state.json"]
)
def test_resume_skips_a_checkpoint_that_is_not_whole_with_a_line(tmp_path, capsys, cut):
    """A `ckpt-*` with a file missing or cut short (by hand, a copy stopped short, an older
    version's kill mid-delete) is skipped with a line naming the file; the one before it is used
    (was: picked, and the resume a traceback)."""
    model, optimizer = fresh_run(tmp_path)
    for step in (1, 2):
        CK.save_checkpoint(tmp_path, step, model, optimizer, {}, 4)
    capsys.readouterr()
    damaged = tmp_path / "ckpt-000002" / cut
    damaged.write_bytes(damaged.read_bytes()[:20])
    assert CK.latest_checkpoint(tmp_path).name == "ckpt-000001"
    why = f"{damaged}: invalid JSON" if cut == "state.json" else f"{damaged}: cut short"
    line = capsys.readouterr().out
    assert line.startswith(f"resume: {damaged.parent} is not a whole checkpoint ({why}"), line
    assert line.endswith("); skipped\n") and line.count("\n") == 1, line
    damaged.unlink()
    assert CK.latest_checkpoint(tmp_path).name == "ckpt-000001"
    assert "missing" in capsys.readouterr().out or cut == "state.json"


def written_by_two_ranks(tmp_path, global_batch=4):
    """A checkpoint whose state.json says 2 ranks wrote it (rank 0's RNG file, as any rank 0's)."""
    model, optimizer = fresh_run(tmp_path)
    path = CK.save_checkpoint(tmp_path, 1, model, optimizer, {}, global_batch)
    state = (path / "state.json").read_text().replace('"world_size": 1', '"world_size": 2')
    (path / "state.json").write_text(state)
    return model, path


@pytest.mark.parametrize("saved", [2, None])
def test_resume_at_another_world_size_refuses_another_global_batch(tmp_path, saved):
    """At another world size an update's examples are the same only at the same global batch; a
    checkpoint that does not record it (None: written before the field) cannot show it."""
    model, path = written_by_two_ranks(tmp_path, saved)
    with pytest.raises(ValueError) as refused:
        CK.load_checkpoint(path, model, 4)
    shown = saved or "an unrecorded number of"
    assert f"written by 2 rank(s) at {shown} examples per update, this run has 1 rank(s) at 4" in (
        str(refused.value)
    )


def test_resume_at_another_world_size_seeds_each_rank_from_rank_0_s_saved_state(tmp_path):
    """docs/resume-and-faults.md: at another world size rank r's torch and Python generators are
    seeded with s + r, s the first 63-bit draw from rank 0's saved torch state (computed here by
    hand from the saved file); at the same world size each rank gets its own state back."""
    model, path = written_by_two_ranks(tmp_path)
    with safe_open(path / "rng-rank0.safetensors", framework="pt") as f:
        saved = f.get_tensor("torch")
    s = int(torch.randint(2**63 - 1, (), generator=torch.Generator().set_state(saved)))
    draws = {}
    for rank in (0, 1):  # rank 1 of a run at 3 ranks, say: its rule needs no file of its own
        CK._load_rng(path, rank, same_world=False)
        draws[rank] = (torch.rand(3), random.random())
        torch.manual_seed(s + rank)
        random.seed(s + rank)
        assert torch.equal(draws[rank][0], torch.rand(3)) and draws[rank][1] == random.random()
    assert not torch.equal(draws[0][0], draws[1][0])
    CK.load_checkpoint(path, model, 4)  # 2 ranks -> this 1, the same global batch: allowed
    assert torch.equal(torch.rand(3), draws[0][0])
    CK._load_rng(path, 0, same_world=True)
    assert torch.equal(torch.get_rng_state(), saved)


# ----------------------------------------------------------------------------- two processes


def _sync_worker(rank, port, out):
    gloo_rank(rank, port)
    ranks = D.setup_distributed("cpu")
    # different LoRA inits: the broadcast must equalize them
    model = tiny_model(lora_seed=rank, dropout=0.0)
    optimizer = T.build_optimizer(model, 1e-2, 0.0, (0.9, 0.99))
    params = T.optimizer_parameters(optimizer)
    D.broadcast_parameters(params)
    logp = M.token_logprobs(model, batch(10 + rank))
    (-logp.sum()).backward()
    T.sync_gradients(params)
    out[rank] = [p.grad.clone() for p in params]
    stop = T.StopRequest()
    stop.flag = rank == 1
    out[f"stop{rank}"] = stop.requested(ranks.device)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_gradients_are_summed_over_two_gloo_ranks():
    out = mp.Manager().dict()
    mp.spawn(_sync_worker, args=(free_port(), out), nprocs=2)
    model = tiny_model(lora_seed=0, dropout=0.0)
    optimizer = T.build_optimizer(model, 1e-2, 0.0, (0.9, 0.99))
    for seed in (10, 11):
        (-M.token_logprobs(model, batch(seed)).sum()).backward()
    expected = [p.grad for p in T.optimizer_parameters(optimizer)]
    for rank in (0, 1):
        for got, want in zip(out[rank], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert out["stop0"] and out["stop1"]  # one rank's signal stops both


def test_sigterm_sets_the_stop_flag_instead_of_killing():
    with T.StopRequest() as stop:
        assert not stop.requested(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested(torch.device("cpu"))
    assert signal.getsignal(signal.SIGTERM) is not stop._handle


def test_the_eta_settles_after_the_first_step(monkeypatch, capsys):
    # 10 steps; the first takes 10 s (loading, warm-up), each later one 1 s: after step 3 the
    # 7 steps left take 7 s, not the 28 s that the mean over all three steps would say
    clock = iter([0.0, 10.0, 11.0, 12.0])
    monkeypatch.setattr(T.time, "perf_counter", lambda: next(clock))
    progress = T.Progress(10)
    for step in range(3):
        progress.log(step, tokens=100, loss=1.0)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].endswith("ETA 0m07s"), lines[-1]
    assert lines[0].endswith("ETA 1m30s"), lines[0]  # one step seen: 10 s each for the 9 left


# -------------------------------------------------------------- training speed options, same math


def lora_loss_and_grads(model, ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A token-weighted loss of `ids` under `model` and its gradients of the LoRA factors."""
    weights = torch.linspace(0.1, 1.0, ids.shape[1] - 1).expand(ids.shape[0], -1)
    loss = -(weights * M.token_logprobs(model, ids)).sum()
    factors = [p for m in M.lora_modules(model).values() for p in (m.lora_A, m.lora_B)]
    return loss.detach(), list(torch.autograd.grad(loss, factors))


def adapted(family: str, dtype: torch.dtype, compute: str = "float32") -> M.Qwen:
    """random_model(family) in `dtype`, its layers at a tenth of the spread (moderate logits), with
    a LoRA (seeded, B not zero) computed in `compute`."""
    model = random_model(family).train()
    with torch.no_grad():
        for p in model.model.layers.parameters():
            if p.dim() > 1:
                p.mul_(0.1)
    model.to(dtype)
    torch.manual_seed(1)
    M.add_lora(model, 4, 8, compute=compute)
    with torch.no_grad():
        for m in M.lora_modules(model).values():
            m.lora_B.normal_(0, 0.05)
    return model


def relative_error(found: torch.Tensor, expected: torch.Tensor) -> float:
    return ((found - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_lora_computed_in_the_model_dtype_gives_the_float32_side_path_s_loss_and_gradients(family):
    """lora.compute: model on a bfloat16 base: the factors cast to bfloat16 in the forward (one
    fused product), their float32 masters getting float32 gradients. Oracle: the same weights
    computed in float32 throughout. The loss and gradients stay about as close to it as the float32
    side path's on the bfloat16 base (measured, all gradients together: 0.94e-2 and 2.1e-2 relative
    for Qwen3 and Qwen3.5, against 0.86e-2 and 1.8e-2)."""
    ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    oracle_loss, oracle = lora_loss_and_grads(adapted(family, torch.bfloat16).float(), ids)
    side_loss, side = lora_loss_and_grads(adapted(family, torch.bfloat16), ids)
    model = adapted(family, torch.bfloat16, "model")
    loss, grads = lora_loss_and_grads(model, ids)
    assert loss != side_loss  # another computation of the same loss
    assert abs(loss - oracle_loss) < 2 * abs(side_loss - oracle_loss) + 1e-3 * oracle_loss.abs()
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    assert all(g.dtype == torch.float32 for g in grads)
    flat = [torch.cat([g.flatten() for g in gs]) for gs in (grads, side, oracle)]
    assert relative_error(flat[0], flat[2]) < 1.5 * relative_error(flat[1], flat[2])
    assert max(relative_error(g, o) for g, o in zip(grads, oracle)) < 5e-2


@pytest.mark.slow
def test_compiled_layers_give_the_eager_loss_and_gradients():
    """Qwen.compile_layers (about 25 s of Inductor compilation on this CPU), float32, with and
    without activation checkpointing: the eager path's loss and gradients within float32's
    reordering; a decode through the model stays eager (no cache in a compiled layer)."""
    ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    model = adapted("qwen3", torch.float32)
    expected_loss, expected = lora_loss_and_grads(model, ids)
    model.compile_layers()
    calls = []

    def counted(layer):
        return lambda *args: calls.append(1) or layer(*args)

    model.compiled_layers = [counted(layer) for layer in model.compiled_layers]
    for recompute in (False, True):
        model.gradient_checkpointing = recompute
        calls.clear()
        loss, grads = lora_loss_and_grads(model, ids)
        assert len(calls) >= len(model.model.layers)  # the compiled forwards ran
        assert loss == pytest.approx(expected_loss.item(), rel=1e-5)
        for g, e in zip(grads, expected):
            assert relative_error(g, e) < 1e-4
    calls.clear()
    M.generate(model.eval(), [[1, 2, 3]], 3, temperature=0)
    assert calls == []


def test_compile_is_refused_where_it_would_not_do_what_it_says():
    import grpo
    import sft
    from config import ConfigError

    with pytest.raises(ConfigError, match="model.compile: a LoRA-only setting"):
        grpo.GRPOConfig("out", [], grpo.ModelSettings("base", compile=True), finetune="full")
    with pytest.raises(ConfigError, match="compile: not with packed batches"):
        sft.SFTConfig("base", "data.jsonl", "out", compile=True, micro_batch_tokens=64)
