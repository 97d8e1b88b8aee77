"""Full-parameter training on FSDP2 (fsdp.py, `finetune: full`) with gloo ranks on the CPU: one SFT
update on 2 ranks (and with another micro-batch split), and two on a 2 x 2 mesh (hybrid sharding,
resumed from its checkpoint too) and a GRPO update there, give the weights of 1 process; so do SFT
and a GRPO update on two "nodes" (two torchrun agents of one rank each on localhost), and a whole
GRPO run there equals one agent of two ranks; the exported checkpoint gives the in-memory model's
logits in transformers and in model.py (tied and untied heads); a full-mode run SIGKILLed during
training or during a checkpoint write resumes to the uninterrupted result, and one resumed at
another world size (2 -> 1 -> 2 ranks; LoRA too) to the same global batch's; rollouts under
`gathered` run no collective; bad input stops with one line and exit status 2."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import instruments as INSTR
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from helpers import (
    config,
    config_file,
    gloo_rank,
    metrics,
    prompt_sampler,
    sad_row,
    sft_adapter,
    tensors,
    write_rows,
)
from helpers import (
    rank_run as _rank_run,
)
from helpers import (
    sft_checkpoint as write_checkpoint,
)
from instruments import end_rank, free_port
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import checkpoint as CK
import distributed as D
import fsdp as FS
import model as M
import sft
import train as T
from tokenizer import QwenTokenizer, load_tokenizer

pytestmark = pytest.mark.slow  # gloo ranks and torchrun
REPO = Path(__file__).resolve().parents[1]
FULL = dict(finetune="full", lora=None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"))


def weights(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for shard in folder.glob("*.safetensors"):
        found |= tensors(shard)
    return found


def single_process(cfg) -> Path:
    try:
        return sft.train(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------- the same update on 1 and 2 ranks


def test_full_sft_on_two_ranks_and_another_split_equals_one_process(checkpoint, tmp_path):
    """Five rows, 4 completions an update: the second update has one, so rank 1 runs an idle
    micro-batch there. Stated tolerance: rtol 1e-5, atol 1e-6 on every weight after two AdamW steps
    (float32 on the CPU)."""
    data = str(write_rows(tmp_path / "rows5.jsonl", [sad_row(i) for i in range(5)]))
    runs = {}
    # four rows per update: one rank in four micro-batches, two ranks in two or one
    for name, ranks, batch in (("one", 1, 1), ("two", 2, 1), ("split", 2, 2)):
        cfg = config(
            checkpoint,
            tmp_path / name,
            data=data,
            batch_size=batch,
            rows_per_update=4,
            lr=1e-3,
            output_dir=str(tmp_path / name / "run"),
            gradient_checkpointing=name == "split",
            **FULL,
        )
        if ranks == 1:
            single_process(cfg)
        else:
            mp.spawn(_rank_run, args=(free_port(), cfg), nprocs=2)
        runs[name] = tmp_path / name / "run"
    losses = {n: [m["loss"] for m in metrics(r)] for n, r in runs.items()}
    assert len(losses["one"]) == 2 and losses["two"] == pytest.approx(losses["one"], rel=1e-6)
    assert losses["split"] == pytest.approx(losses["one"], rel=1e-6)
    base, final = weights(checkpoint), {n: weights(r / "best") for n, r in runs.items()}
    for name in ("two", "split"):
        assert final[name].keys() == final["one"].keys()
        for key, value in final["one"].items():
            torch.testing.assert_close(final[name][key], value, rtol=1e-5, atol=1e-6, msg=key)
    tags = [load_tokenizer(runs["one"] / "best").token_id(t) for t in ("<evidence>", "</evidence>")]
    for key, value in final["two"].items():
        # frozen but for the <evidence> rows
        if key in ("model.embed_tokens.weight", "lm_head.weight"):
            others = [i for i in range(len(value)) if i not in tags]
            assert torch.equal(value[others], base[key][others]) and not torch.equal(
                value[tags], base[key][tags]
            )
        else:
            assert not torch.equal(value, base[key]), key  # every other weight trained
    state = json.loads((runs["two"] / "ckpt-000002" / "state.json").read_text())
    assert state["finetune"] == "full" and [g["lr_scale"] for g in state["param_groups"]] == [
        1.0,
        10.0,
    ]


# ---------------------------------------------------------- the 2-D mesh: 2 replicas x 2 shards


def six_rows_config(checkpoint, tmp_path, name, rows_per_update, mode=FULL, **extra):
    """Six rows, `rows_per_update` per update in micro-batches of 1 (two: three updates; four: the
    second update has two, so on 4 ranks a second replica runs idle micro-batches there), a
    checkpoint after each update, all kept; `mode` FULL, or {} for LoRA (no dropout)."""
    data = tmp_path / "rows6.jsonl"
    if not data.is_file():
        write_rows(data, [sad_row(i) for i in range(6)])
    return config(
        checkpoint,
        tmp_path / name,
        data=str(data),
        rows_per_update=rows_per_update,
        lr=1e-3,
        save_every=1,
        keep_checkpoints=None,
        output_dir=str(tmp_path / name / "run"),
        **extra,
        **mode,
    )


def _hsdp_worker(rank, port, cfg, out):
    """sft.train on rank `rank` of 4, recording the mesh fsdp.shard_model builds."""
    gloo_rank(rank, port, world_size=4)
    build, meshes = FS.device_mesh, []
    FS.device_mesh = lambda *args: meshes.append(build(*args)) or meshes[-1]
    sft.train(cfg)
    found = [[list(m.mesh_dim_names), m.mesh.tolist()] for m in meshes]
    out.joinpath(f"mesh{rank}.json").write_text(json.dumps(found))
    end_rank()


def test_full_sft_on_a_two_by_two_mesh_equals_one_process_and_resumes(checkpoint, tmp_path):
    """distributed.replicas 2 on 4 gloo ranks: every weight replicated over 2 rows of 2 ranks and
    sharded within a row; two AdamW steps give the weights and losses of 1 process (rtol 1e-5,
    atol 1e-6, float32 on the CPU). Its ckpt-1 (DCP of the 2-D shards), resumed on the same mesh,
    gives the uninterrupted run's ckpt-2 and best/ exactly; resumed on the 1-D mesh of the same 4
    ranks, within that tolerance."""
    single_process(six_rows_config(checkpoint, tmp_path, "one", 4))
    hybrid = {"distributed.replicas": 2}
    cfg = six_rows_config(checkpoint, tmp_path, "hsdp", 4, **hybrid)
    mp.spawn(_hsdp_worker, args=(free_port(), cfg, tmp_path), nprocs=4)
    one, hsdp = tmp_path / "one" / "run", tmp_path / "hsdp" / "run"
    for rank in range(4):  # rows of consecutive ranks: {0, 1} and {2, 3} each hold every shard
        mesh = [["replicate", "shard"], [[0, 1], [2, 3]]]
        assert json.loads((tmp_path / f"mesh{rank}.json").read_text()) == [mesh]
    assert [m["loss"] for m in metrics(hsdp)] == pytest.approx(
        [m["loss"] for m in metrics(one)], rel=1e-6
    )
    expected, found = weights(one / "best"), weights(hsdp / "best")
    assert found.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(found[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert world_size(hsdp, 2) == 4
    for name, replicas in (("resumed", 2), ("reshaped", 1)):  # the same mesh, the 1-D mesh
        resumed = stopped_copy(hsdp, tmp_path / name / "run", after=1)
        written = (resumed / ckpt(1) / "state.json").stat().st_mtime_ns
        cfg = six_rows_config(checkpoint, tmp_path, name, 4, **{"distributed.replicas": replicas})
        mp.spawn(_rank_run, args=(free_port(), cfg, 4), nprocs=4)
        # resumed from ckpt-1 (a restart would have rewritten it)
        assert (resumed / ckpt(1) / "state.json").stat().st_mtime_ns == written
        for a, b in (
            (read_dcp(hsdp / ckpt(2)), read_dcp(resumed / ckpt(2))),
            (weights(hsdp / "best"), weights(resumed / "best")),
        ):
            assert a.keys() == b.keys()
            for key, value in a.items():
                if replicas == 2:
                    assert torch.equal(b[key], value), key
                else:  # the gradient sums run in another order
                    torch.testing.assert_close(b[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_replicas_that_do_not_divide_the_world_size_stop_with_one_line(
    checkpoint, tmp_path, capsys, monkeypatch
):
    """Before any process group forms or the model loads: no output folder is written."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    path = config_file(checkpoint, tmp_path, **{"distributed.replicas": 4}, **FULL)
    code, err = refused_resume(path, capsys)
    assert code == 2 and err.splitlines() == [
        "error: distributed.replicas: 4 does not divide the world size 6 (replicas x ranks per "
        "replica must equal the number of ranks)"
    ]
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- export


TIED = dict(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rope_theta=1e4,
)


def _export_worker(rank, port, out, tied):
    gloo_rank(rank, port)
    ranks = D.setup_distributed("cpu")
    torch.manual_seed(0)
    raw = dict(TIED, tie_word_embeddings=tied)
    model = M.Qwen(M.QwenConfig.from_dict(raw))
    M.train_token_rows(model, [5, 9])
    FS.shard_model(model, ranks.device)
    optimizer = T.build_optimizer(
        model, lr=1e-2, weight_decay=0.01, betas=(0.9, 0.99), row_lr_scale=10.0
    )
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model.train()
    (-M.token_logprobs(model, ids).mean()).backward()
    T.sync_gradients(T.optimizer_parameters(optimizer))
    optimizer.step()
    model.eval()
    with torch.no_grad():
        logits = model(ids)
    # save_merged writes the tokenizer: a stand-in that writes none
    tok = QwenTokenizer.__new__(QwenTokenizer)
    tok.save = lambda folder: None
    FS.export_full(model, tok, out)
    if ranks.main:
        torch.save({"ids": ids, "logits": logits}, out / "expected.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("tied", [False, True])
def test_the_exported_checkpoint_gives_the_in_memory_logits(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "export"
    mp.spawn(_export_worker, args=(free_port(), out, tied), nprocs=2)
    expected = torch.load(out / "expected.pt")
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    ours = M.Qwen.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(expected["ids"]), expected["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            hf(expected["ids"]).logits, expected["logits"], rtol=1e-4, atol=1e-4
        )
    assert ours.lm_head is None if tied else ours.lm_head is not None


def _trained_export_worker(rank, port, out):
    gloo_rank(rank, port)
    ranks = D.setup_distributed("cpu")
    tok = QwenTokenizer.__new__(QwenTokenizer)
    tok.save = lambda folder: None  # save_merged writes the tokenizer: a stand-in that writes none
    for rows in (False, True):
        torch.manual_seed(0)
        model = M.Qwen(M.QwenConfig.from_dict(TIED | {"tie_word_embeddings": False}))
        model.to(torch.bfloat16)
        if rows:
            M.train_token_rows(model, [5, 9])
        FS.shard_model(model, ranks.device)
        optimizer = T.build_optimizer(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.99))
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        (-M.token_logprobs(model.train(), ids).mean()).backward()
        T.sync_gradients(T.optimizer_parameters(optimizer))
        optimizer.step()
        FS.export_full(model, tok, out / f"full-{rows}")
        FS.export_trained(model, tok, out / f"trained-{rows}")
    end_rank()


def test_a_trained_only_export_holds_every_trained_weight_as_the_whole_export_does(tmp_path):
    """A bf16 model, sharded on 2 ranks, one step: export_trained writes every trained weight,
    equal (same dtype, same bits) to export_full's tensor of that name, and neither the frozen
    embedding nor lm_head; with trainable token rows (which fold into those) it writes the whole
    export."""
    mp.spawn(_trained_export_worker, args=(free_port(), tmp_path), nprocs=2)

    def weights(folder):
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in tensors(f).items()}

    whole, sent = weights(tmp_path / "full-False"), weights(tmp_path / "trained-False")
    assert sorted(sent) == sorted(
        n for n in whole if "embed_tokens" not in n and "lm_head" not in n
    )
    assert len(sent) == len(whole) - 2 and all(t.dtype == torch.bfloat16 for t in sent.values())
    assert all(torch.equal(sent[n], whole[n]) for n in sent)
    whole, sent = weights(tmp_path / "full-True"), weights(tmp_path / "trained-True")
    assert sorted(sent) == sorted(whole) and all(torch.equal(sent[n], whole[n]) for n in sent)


def _loading_worker(rank, port, checkpoint, out):
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    ranks = D.setup_distributed("cpu")
    loaded = {}
    for how in ("whole", "sharded"):
        model = M.Qwen.from_pretrained(
            checkpoint, on_meta=FS.sharded_weight if how == "sharded" else None
        )
        FS.shard_model(model, ranks.device, checkpoint=checkpoint if how == "sharded" else None)
        loaded[how] = {
            n: (p.to_local().clone(), p.full_tensor())
            for n, p in model.named_parameters()
            if isinstance(p, DTensor)
        }
    torch.save(loaded, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_sharded_loading_reads_each_rank_s_slices_of_the_checkpoint(checkpoint, tmp_path):
    """On 2 ranks, a model built with its layers on the meta device and filled by load_shards holds
    exactly the shards of the whole-loaded model (so training from it is the same), and they tile
    the checkpoint's tensors: rank r holds rows [r * ceil(n / 2), ...) of each."""
    mp.spawn(_loading_worker, args=(free_port(), checkpoint, tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    base = weights(checkpoint)
    assert ranks[0]["whole"].keys() == ranks[0]["sharded"].keys()
    assert len(ranks[0]["sharded"]) == len([k for k in base if FS.sharded_weight(k)])
    for name in ranks[0]["sharded"]:
        whole = base[name].float()
        half = -(-whole.shape[0] // 2)
        for r, loaded in enumerate(ranks):
            local, full = loaded["sharded"][name]
            assert torch.equal(local, loaded["whole"][name][0]), name
            assert torch.equal(local, whole[r * half : (r + 1) * half]), name
            assert torch.equal(full, whole), name


# ------------------------------------------------------------------ no collective per decoded token


def _rollout_worker(rank, port, out):
    gloo_rank(rank, port)
    ranks = D.setup_distributed("cpu")
    torch.manual_seed(0)
    model = M.Qwen(M.QwenConfig.from_dict(dict(TIED, tie_word_embeddings=False)))
    reference = M.Qwen(M.QwenConfig.from_dict(dict(TIED, tie_word_embeddings=False)))
    reference.load_state_dict(model.state_dict())
    FS.shard_model(model, ranks.device)
    calls = INSTR.CollectiveCounter()
    with calls:
        with FS.gathered(model):
            before = calls.count
            tokens = M.generate(
                model, [[1, 2, 3]] * (rank + 1), max_new_tokens=6 + 3 * rank, temperature=0
            )
            during = calls.count - before
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))  # resharded: a forward all-gathers again
    expected = M.generate(
        reference, [[1, 2, 3]] * (rank + 1), max_new_tokens=6 + 3 * rank, temperature=0
    )
    torch.save(
        {"during": during, "after": calls.count - before - during, "same": tokens == expected},
        out / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


def test_a_rollout_under_gathered_runs_no_collective_and_decodes_like_the_unsharded_model(tmp_path):
    """The ranks decode different numbers of tokens: with a collective per token they would hang."""
    mp.spawn(_rollout_worker, args=(free_port(), tmp_path), nprocs=2)
    for rank in range(2):
        found = torch.load(tmp_path / f"rank{rank}.pt")
        assert found["during"] == 0 and found["after"] > 0 and found["same"], found


def _static_rollout_worker(rank, port, out):
    gloo_rank(rank, port)
    ranks = D.setup_distributed("cpu")
    torch.manual_seed(0)
    cfg = M.QwenConfig.from_dict(dict(TIED, tie_word_embeddings=False))
    policy, reference = M.Qwen(cfg), M.Qwen(cfg)
    reference.load_state_dict(policy.state_dict())
    M.train_token_rows(policy, [3, 5])  # SFT's <evidence> rows: trainable, whole on every rank
    FS.shard_model(policy, ranks.device)
    trainable = {name: p.requires_grad for name, p in policy.named_parameters()}
    sampler = FS.GatheredSampler(prompt_sampler(policy, 2, 5 + 3 * rank, 0.0, "static"), policy)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8][: 2 + rank]]
    fired = []  # FSDP's hooks run in the forward of an FSDP unit: count those forwards

    def count(module, args):
        if isinstance(module, FSDPModule):
            fired.append(type(module).__name__)

    hook = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        with sampler.rollouts(0):
            tokens, logps = sampler.complete(prompts, seed=0)
    finally:
        hook.remove()
    expected, expected_logps = M.generate(
        reference,
        [p for p in prompts for _ in range(2)],
        5 + 3 * rank,
        temperature=0,
        return_logprobs=True,
    )
    torch.save(
        {
            "fired": fired,
            "same": tokens == expected,
            "logp_gap": max(
                abs(a - b) for x, y in zip(logps, expected_logps) for a, b in zip(x, y)
            ),
            "restored": sampler.sampler.policy is policy
            and trainable == {name: p.requires_grad for name, p in policy.named_parameters()},
        },
        out / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


def test_a_static_rollout_of_a_sharded_policy_runs_no_fsdp_hook_and_decodes_like_eager(tmp_path):
    """`finetune: full` with `rollout.decode: static`: a unit's FSDP hooks inside the decode step
    would run inside the CUDA-graph capture, which they break; the rollout decodes through the
    gathered weights' hook-free view instead. Greedy, float32: the eager decode of an unsharded copy
    is the oracle."""
    mp.spawn(_static_rollout_worker, args=(free_port(), tmp_path), nprocs=2)
    for rank in range(2):
        found = torch.load(tmp_path / f"rank{rank}.pt")
        assert found["fired"] == [] and found["same"] and found["restored"], found
        assert found["logp_gap"] < 1e-5, found


# ----------------------------------------------------------------------------- prefetch


@pytest.mark.parametrize("recompute", [False, True])
def test_each_unit_prefetches_the_next_in_forward_and_the_one_before_in_backward(recompute):
    """The second training forward and backward of a sharded 3-layer model in this process, its
    FSDP events from torch's profiler (FSDP2 names each prefetch `FSDP::<pass>_prefetch for
    <unit>`): each unit's all-gather of the next starts right after its own pre-forward, before the
    next pre-forward (FSDP2 alone starts none in forward); in backward each unit's pre-backward is
    followed by the prefetch of the unit before it, once, with or without the layers recomputed
    (each layer's forward then runs twice). (The first backward after shard_model's no-grad forward
    also prefetches the norm at its end: FSDP2's backward order is the forwards it saw.)"""
    torch.manual_seed(0)
    model = M.Qwen(M.QwenConfig.from_dict(dict(TIED, num_hidden_layers=3)))
    try:
        FS.shard_model(model, torch.device("cpu"))
        model.gradient_checkpointing = recompute
        model.train()
        ids = torch.tensor([[1, 2, 3, 4]])
        M.token_logprobs(model, ids).sum().backward()
        runs = []
        for layer in model.model.layers:
            layer.input_layernorm.register_forward_hook(lambda *_: runs.append(1))
        with torch.profiler.profile() as profiler:
            M.token_logprobs(model, ids).sum().backward()
    finally:
        dist.destroy_process_group()
    shown = ("FSDP::pre_forward", "FSDP::pre_backward", "FSDP::forward_prefetch", "FSDP::backward")
    events = [e.name for e in profiler.events() if e.name.startswith(shown)]
    units = ["model.layers.0", "model.layers.1", "model.layers.2", "model.norm"]
    forward = [f"FSDP::pre_forward ({units[0]})"]
    for unit in units[1:]:
        forward += [f"FSDP::forward_prefetch for {unit}", f"FSDP::pre_forward ({unit})"]
    backward = [f"FSDP::pre_backward ({units[-1]})"]
    for unit in units[-2::-1]:
        backward += [f"FSDP::backward_prefetch for {unit}", f"FSDP::pre_backward ({unit})"]
    assert events == forward + backward
    assert len(runs) == 3 * (1 + recompute)


# ----------------------------------------------------------------------------- resume after SIGKILL


SLOW_SAVE = """import sys, time
sys.path.insert(0, {repo!r})
import checkpoint, sft
save = checkpoint.save_sharded
def slow(folder, *args):
    groups = save(folder, *args)
    if folder.name == ".ckpt-000003.tmp":
        (folder.parent / "writing").touch()
        time.sleep(60)  # the test kills the run here, between the shards and the rename
    return groups
checkpoint.save_sharded = slow
sft.main(sys.argv[1:])
"""


def launch(launcher: list[str], script: Path, argv, cwd: Path) -> subprocess.Popen:
    """One torchrun agent (`launcher`: its options) running `script` with `argv`."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launcher, str(script), *map(str, argv)],
        cwd=cwd,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def torchrun(script: Path, *argv, cwd: Path) -> subprocess.Popen:
    return launch(["--nproc_per_node", "2", "--master_port", str(free_port())], script, argv, cwd)


def two_nodes(script: Path, *argv, cwd: Path) -> None:
    """`script` on two "nodes" of one rank each: two torchrun agents on this machine, node ranks 0
    and 1, meeting at a free localhost port (torchrun's static rendezvous), one output folder;
    both must succeed."""
    port = str(free_port())
    agents = [
        launch(
            ["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1"]
            + ["--master_addr", "127.0.0.1", "--master_port", port],
            script,
            argv,
            cwd,
        )
        for node in (0, 1)
    ]
    for node, agent in enumerate(agents):
        assert agent.wait(timeout=600) == 0, (node, agent.stderr.read().decode()[-3000:])


@pytest.mark.parametrize("moment", ["training", "checkpoint write"])
def test_a_full_run_killed_resumes_equal_to_an_uninterrupted_one(checkpoint, tmp_path, moment):
    rows = write_rows(tmp_path / "rows6.jsonl", [sad_row(i) for i in range(6)])
    script = tmp_path / "slow_save.py"
    script.write_text(SLOW_SAVE.format(repo=str(REPO)))

    def run(name, kill=False):
        path = config_file(
            checkpoint,
            tmp_path / name,
            data=str(rows),
            epochs=4,
            rows_per_update=2,
            save_every=1,
            keep_checkpoints=None,
            **FULL,
        )
        folder = tmp_path / name / "run"
        process = torchrun(
            script if moment == "checkpoint write" else REPO / "sft.py", path, cwd=tmp_path
        )
        marker = folder / ("writing" if moment == "checkpoint write" else "ckpt-000003")
        while kill and not marker.exists():
            assert process.poll() is None, process.stderr.read()
            time.sleep(0.005)
        if kill:
            os.killpg(process.pid, signal.SIGKILL)
        code = process.wait(timeout=600)
        return code, folder

    whole = tmp_path / "whole" / "run"
    reference = torchrun(
        REPO / "sft.py",
        config_file(
            checkpoint,
            tmp_path / "whole",
            data=str(rows),
            epochs=4,
            rows_per_update=2,
            save_every=1,
            keep_checkpoints=None,
            **FULL,
        ),
        cwd=tmp_path,
    )
    assert reference.wait(timeout=600) == 0, reference.stderr.read()
    code, killed = run("killed", kill=True)
    assert code != 0
    if moment == "checkpoint write":
        assert (killed / ".ckpt-000003.tmp").is_dir() and CK.latest_checkpoint(
            killed
        ).name == "ckpt-000002"
        (killed / "writing").unlink()
    resumed = torchrun(REPO / "sft.py", killed.parent / "config.yaml", cwd=tmp_path)
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    a, b = weights(whole / "best"), weights(killed / "best")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    shards = sorted((whole / "ckpt-000012" / "dcp").glob("*.safetensors"))
    assert len(shards) == 2  # one file per rank: weights and AdamW moments equal too
    for shard in shards:
        a, b = tensors(shard), tensors(killed / "ckpt-000012" / "dcp" / shard.name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), shard.name
    drop = ("tokens_per_s", "elapsed_s")
    assert [{k: v for k, v in m.items() if k not in drop} for m in metrics(whole)] == [
        {k: v for k, v in m.items() if k not in drop} for m in metrics(killed)
    ]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", ["lora section", "save_merged"])
def test_full_mode_with_a_lora_only_key_stops_with_one_line(checkpoint, tmp_path, capsys, case):
    extra = {"lora": {"rank": 4}} if case == "lora section" else {"lora": None, "save_merged": True}
    path = config_file(checkpoint, tmp_path, finetune="full", **extra)
    with pytest.raises(SystemExit) as stop:
        sft.main([str(path)])
    err = capsys.readouterr().err
    key = "lora" if case == "lora section" else "save_merged"
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"config error: {path}:") and f"'{key}': a LoRA-only setting" in err, err


def refused_resume(path, capsys) -> tuple[int, str]:
    """sft.main on `path`, which must stop: its exit status and what it printed on stderr (the
    process group it may have set up is torn down)."""
    with pytest.raises(SystemExit) as stop:
        try:
            sft.main([str(path)])
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize("first,then", [("lora", "full"), ("full", "lora")])
def test_resuming_a_checkpoint_of_the_other_mode_stops_with_one_line(
    checkpoint, tmp_path, capsys, first, then
):
    modes = {"lora": {}, "full": FULL}
    single_process(config(checkpoint, tmp_path, save_every=1, **modes[first]))
    capsys.readouterr()
    path = config_file(checkpoint, tmp_path, save_every=1, epochs=2, **modes[then])
    code, err = refused_resume(path, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"field 'finetune': the checkpoint is of a {first} run, this run is {then}" in err


# ----------------------------------------------------------------- resume at another world size


def read_dcp(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's dcp/, whole, read back by DCP in this one process."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(folder / "dcp"))
    found = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
    }
    dcp.load(found, storage_reader=reader)
    return found


def stopped_copy(run: Path, into: Path, after: int) -> Path:
    """`run` as a run stopped after update `after` would have left it: its later checkpoints and
    the exported model gone (metrics.jsonl is trimmed by the resume)."""
    shutil.copytree(run, into)
    for folder in [*into.glob("ckpt-*"), into / "best"]:
        if folder.name == "best" or int(folder.name.split("-")[1]) > after:
            shutil.rmtree(folder)
    return into


def ckpt(step: int) -> str:
    return f"ckpt-{step:06d}"


def world_size(run: Path, step: int) -> int:
    return json.loads((run / ckpt(step) / "state.json").read_text())["world_size"]


@pytest.fixture(scope="module")
def two_rank_run(checkpoint, tmp_path_factory):
    """The uninterrupted run on 2 ranks (one row each): its ckpt-1, -2, -3 are the oracle."""
    tmp = tmp_path_factory.mktemp("reshard")
    mp.spawn(_rank_run, args=(free_port(), six_rows_config(checkpoint, tmp, "a", 2)), nprocs=2)
    return tmp / "a" / "run"


def test_a_full_run_resumes_at_another_world_size_to_the_same_global_batch_s_result(
    checkpoint, two_rank_run, tmp_path
):
    """2 ranks -> 1 -> 2. The oracle: the uninterrupted 2-rank run's checkpoints. Its ckpt-1,
    resumed on 1 rank (the same 2 rows per update, the same rows: the update count is the data
    position), gives after update 2 the weights and AdamW moments (exp_avg, exp_avg_sq, step) of
    its ckpt-2; that 1-rank ckpt-2, resumed on 2 ranks,
    gives its ckpt-3; the losses logged equal its. Stated tolerance: rtol 1e-5, atol 1e-6 (float32
    on the CPU; the sums run in another order at another world size)."""
    one = stopped_copy(two_rank_run, tmp_path / "one" / "run", after=1)
    single_process(six_rows_config(checkpoint, tmp_path, "one", 2))
    two = stopped_copy(one, tmp_path / "two" / "run", after=2)
    mp.spawn(
        _rank_run, args=(free_port(), six_rows_config(checkpoint, tmp_path, "two", 2)), nprocs=2
    )
    for run, step, world in ((one, 2, 1), (two, 3, 2)):
        # the checkpoint it resumed from is still the other world size's (a restart would have
        # rewritten it), the one it wrote is its own
        assert [world_size(run, step - 1), world_size(run, step)] == [3 - world, world]
        expected, resumed = read_dcp(two_rank_run / ckpt(step)), read_dcp(run / ckpt(step))
        assert resumed.keys() == expected.keys()
        assert {k.rsplit(".", 1)[1] for k in resumed if k.startswith("optim.")} == {
            "exp_avg",
            "exp_avg_sq",
            "step",
        }
        for key, value in expected.items():
            torch.testing.assert_close(resumed[key], value, rtol=1e-5, atol=1e-6, msg=key)
    reference = [m["loss"] for m in metrics(two_rank_run)]
    for run in (one, two):
        assert [m["loss"] for m in metrics(run)] == pytest.approx(reference, rel=1e-6)


def test_a_lora_run_resumes_at_another_world_size_to_the_same_global_batch_s_result(
    checkpoint, tmp_path
):
    """LoRA, 2 ranks -> 1 -> 2, as the full-parameter test: the oracle is the uninterrupted 2-rank
    run's ckpt-2 and ckpt-3 (adapter and token rows, AdamW's state), rtol 1e-5, atol 1e-6."""
    lora = {}
    base = tmp_path / "a" / "run"
    cfg = six_rows_config(checkpoint, tmp_path, "a", 2, lora)
    mp.spawn(_rank_run, args=(free_port(), cfg), nprocs=2)
    one = stopped_copy(base, tmp_path / "one" / "run", after=1)
    single_process(six_rows_config(checkpoint, tmp_path, "one", 2, lora))
    two = stopped_copy(one, tmp_path / "two" / "run", after=2)
    cfg = six_rows_config(checkpoint, tmp_path, "two", 2, lora)
    mp.spawn(_rank_run, args=(free_port(), cfg), nprocs=2)
    for run, step, world in ((one, 2, 1), (two, 3, 2)):
        assert [world_size(run, step - 1), world_size(run, step)] == [3 - world, world]
        for file in ("adapter_model.safetensors", "optimizer.safetensors"):
            expected, resumed = (tensors(r / ckpt(step) / file) for r in (base, run))
            assert resumed.keys() == expected.keys() and expected
            for key, value in expected.items():
                torch.testing.assert_close(resumed[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_resuming_at_another_world_size_and_global_batch_stops_with_one_line(
    checkpoint, two_rank_run, tmp_path, capsys
):
    """At 1 rank with rows_per_update 1 an update would take 1 row, not the checkpoint's 2: the
    rows of an update would not be the run's, so the run stops, naming both world sizes."""
    stopped_copy(two_rank_run, tmp_path / "run", after=1)
    cfg = dict(data=str(two_rank_run.parent.parent / "rows6.jsonl"), save_every=1, **FULL)
    path = config_file(checkpoint, tmp_path, lr=1e-3, **cfg)
    code, err = refused_resume(path, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "written by 2 rank(s) at 2 examples per update, this run has 1 rank(s) at 1" in err, err


# ----------------------------------------------------------------------------- GRPO in full mode

from helpers import fixed_groups, full_policy, read_jsonl, run_config, updated_weights  # noqa: E402

from judge_server import JudgeServer, rules_backend  # noqa: E402


def _grpo_worker(rank, port, base, out):
    gloo_rank(rank, port)
    mine = [g for i, g in enumerate(fixed_groups(n_groups=3)) if i % 2 == rank]  # 6 and 3 sequences
    found = updated_weights(base, mine, micro_batch_size=2)  # rank 1 runs an idle micro-batch
    if rank == 0:
        torch.save(found, out / "two.pt")
    end_rank()


def test_full_grpo_update_on_two_ranks_and_another_split_equals_one_process(assets, tmp_path):
    """With the sharded reference (beta 0.04) and loss.passes 2. Stated tolerance: rtol 1e-5, atol
    1e-6."""
    base, _ = assets
    try:
        one = updated_weights(base, fixed_groups(n_groups=3), micro_batch_size=100)
        split = updated_weights(base, fixed_groups(n_groups=3), micro_batch_size=1)
    finally:
        dist.destroy_process_group()
    mp.spawn(_grpo_worker, args=(free_port(), base, tmp_path), nprocs=2)
    two = torch.load(tmp_path / "two.pt")
    start = weights(base)
    for name, value in one.items():
        torch.testing.assert_close(split[name], value, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(two[name], value, rtol=1e-5, atol=1e-6, msg=name)
        frozen = name in ("model.embed_tokens.weight", "lm_head.weight")
        assert torch.equal(value, start[name]) == frozen, name


def _adapter_worker(rank, port, base, adapter, out):
    gloo_rank(rank, port)
    whole_reads = []
    load = M.Qwen.from_pretrained.__func__

    def recorded(cls, path, dtype=None, device=None, on_meta=None):
        whole_reads.append(on_meta is None)
        return load(cls, path, dtype, device, on_meta)

    M.Qwen.from_pretrained = classmethod(recorded)
    _, _, policy, reference = full_policy(base, **{"model.sft_adapter": str(adapter)})
    found = {
        how: {
            n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for n, p in model.named_parameters()
        }
        for how, model in (("policy", policy), ("reference", reference))
    }
    found["trainable"] = sorted(n for n, p in policy.named_parameters() if p.requires_grad)
    found["whole_reads"] = whole_reads
    if rank == 0:
        torch.save(found, out / "merged.pt")
    end_rank()


def _hsdp_grpo_worker(rank, port, base, out):
    gloo_rank(rank, port, world_size=4)
    build, meshes = FS.device_mesh, []
    FS.device_mesh = lambda *args: meshes.append(build(*args)) or meshes[-1]
    mine = [g for i, g in enumerate(fixed_groups(n_groups=5)) if i % 4 == rank]
    found = updated_weights(base, mine, micro_batch_size=2, **{"distributed.replicas": 2})
    if rank == 0:
        torch.save(found, out / "hsdp.pt")
    out.joinpath(f"mesh{rank}.json").write_text(
        json.dumps([[list(m.mesh_dim_names), m.mesh.tolist()] for m in meshes])
    )
    end_rank()


def test_full_grpo_from_an_sft_adapter_loads_shards_and_equals_peft_s_merge(assets, tmp_path):
    """On 2 ranks, a full-parameter GRPO start from model.sft_adapter reads only each rank's shards
    (no whole-model load, policy or reference) and merges the adapter into them: the policy's and
    the reference's weights equal PEFT's merge_and_unload of the same adapter on transformers (LoRA
    deltas and <evidence> rows; float32, atol 1e-6), and the policy trains every weight but
    embedding and lm_head."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base, _ = assets
    adapter = sft_adapter(base, tmp_path / "adapter")
    mp.spawn(_adapter_worker, args=(free_port(), base, adapter, tmp_path), nprocs=2)
    found = torch.load(tmp_path / "merged.pt")
    merged = (
        peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter
        )
        .merge_and_unload()
        .state_dict()
    )
    start = weights(base)
    frozen = {"model.embed_tokens.weight", "lm_head.weight"}
    assert found["whole_reads"] == [False, False]
    for how in ("policy", "reference"):
        assert found[how].keys() == start.keys()
        for name, value in found[how].items():
            torch.testing.assert_close(value, merged[name], rtol=0, atol=1e-6, msg=name)
            # the projections (LoRA) and the <evidence> rows moved, the norms not
            moved = name.endswith("proj.weight") or name in frozen
            assert torch.equal(value, start[name]) != moved, name
    assert found["trainable"] == sorted(start.keys() - frozen)


def test_a_full_grpo_update_on_a_two_by_two_mesh_equals_one_process(assets, tmp_path):
    """distributed.replicas 2 on 4 gloo ranks (five groups: rank 0 takes two), the policy and the
    sharded reference both on the (replicate, shard) mesh. Stated tolerance: rtol 1e-5, atol
    1e-6."""
    base, _ = assets
    try:
        one = updated_weights(base, fixed_groups(n_groups=5), micro_batch_size=100)
    finally:
        dist.destroy_process_group()
    mp.spawn(_hsdp_grpo_worker, args=(free_port(), base, tmp_path), nprocs=4)
    mesh = [["replicate", "shard"], [[0, 1], [2, 3]]]
    for rank in range(4):  # the policy's and the reference's
        assert json.loads((tmp_path / f"mesh{rank}.json").read_text()) == [mesh, mesh]
    found = torch.load(tmp_path / "hsdp.pt")
    assert found.keys() == one.keys()
    for name, value in one.items():
        torch.testing.assert_close(found[name], value, rtol=1e-5, atol=1e-6, msg=name)


def grpo_torchrun(config: Path) -> subprocess.Popen:
    return torchrun(REPO / "grpo.py", config, cwd=REPO)


def test_a_full_grpo_run_on_two_ranks_resumes_after_sigkill_to_the_same_result(tmp_path, assets):
    """Filtering on, micro-batches of 3, the sharded reference; the killed run resumes to the same
    exported checkpoint, metrics (timings aside) and completions; the export loads in transformers
    and model.py alike."""
    transformers = pytest.importorskip("transformers")
    with JudgeServer(rules_backend).start() as server:

        def config(name):
            return run_config(
                tmp_path / name,
                assets,
                server.url,
                finetune="full",
                lora=None,
                **{"loss.beta": 0.04},
            )

        straight = grpo_torchrun(config("a"))
        assert straight.wait(timeout=600) == 0, straight.stderr.read().decode()[-3000:]
        run = tmp_path / "b" / "run"
        killed = grpo_torchrun(config("b"))
        while not (run / "ckpt-000002").is_dir():
            assert killed.poll() is None, killed.stderr.read().decode()[-3000:]
            time.sleep(0.005)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        assert not (run / "model").exists()
        resumed = grpo_torchrun(config("b"))
        assert resumed.wait(timeout=600) == 0, resumed.stderr.read().decode()[-3000:]
    a, b = weights(tmp_path / "a" / "run" / "model"), weights(run / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    timing = ("time/", "tokens_per_s")
    ma, mb = (
        [
            {k: v for k, v in m.items() if not k.startswith(timing)}
            for m in read_jsonl(r / "metrics.jsonl")
        ]
        for r in (tmp_path / "a" / "run", run)
    )
    assert ma == mb and len(ma) == 3
    assert read_jsonl(tmp_path / "a" / "run" / "completions.jsonl") == read_jsonl(
        run / "completions.jsonl"
    )
    ids = torch.tensor([[1, 5, 7, 9, 2]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        run / "model", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            hf(ids).logits, M.Qwen.from_pretrained(run / "model")(ids), rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize("reward", ["emollm", "care"])
def test_a_full_dialogue_run_on_two_ranks_trains_and_exports(tmp_path, reward):
    """dialogue/rl.py's runs (trajectory groups for emollm, turn groups for care) in full mode on 2
    ranks: both updates run, the weights move, and the exported model loads."""
    from helpers import DEMO
    from helpers import DIALOGUE_WORDS as WORDS
    from helpers import grpo_checkpoint as write_grpo_checkpoint

    base = write_grpo_checkpoint(tmp_path / "base", words=WORDS, hidden=16)
    with JudgeServer(rules_backend).start() as server:
        run = torchrun(
            "-m",  # torchrun -m dialogue.rl
            "dialogue.rl",
            DEMO,
            f"model.path={base}",
            f"output_dir={tmp_path / 'run'}",
            f"judge.base_url={server.url}",
            f"reward.name={reward}",
            "updates=2",
            "rollout.max_new_tokens=8",
            "finetune=full",
            "lora=null",
            cwd=REPO,
        )
        assert run.wait(timeout=600) == 0, run.stderr.read().decode()[-3000:]
    found = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in found] == [1, 2] and all(
        m["skipped_nonfinite"] == 0 for m in found
    ), found
    exported = M.Qwen.from_pretrained(tmp_path / "run" / "model")
    assert not all(
        torch.equal(a, b)
        for a, b in zip(
            exported.state_dict().values(), M.Qwen.from_pretrained(base).state_dict().values()
        )
    )


# ----------------------------------------------------------------------------- two nodes


def test_full_sft_on_two_nodes_equals_one_process(checkpoint, tmp_path):
    """`torchrun --nnodes 2 --nproc_per_node 1` twice on localhost: four rows, two updates of two
    (one row a rank; both in the one process). Stated tolerance: rtol 1e-5, atol 1e-6."""
    data = str(write_rows(tmp_path / "rows4.jsonl", [sad_row(i) for i in range(4)]))
    single_process(
        config(checkpoint, tmp_path / "one", data=data, rows_per_update=2, lr=1e-3, **FULL)
    )
    path = config_file(
        checkpoint, tmp_path / "nodes", data=data, rows_per_update=2, lr=1e-3, **FULL
    )
    two_nodes(REPO / "sft.py", path, cwd=tmp_path)
    one, nodes = tmp_path / "one" / "run", tmp_path / "nodes" / "run"
    assert world_size(nodes, 2) == 2 and len(metrics(one)) == 2
    assert [m["loss"] for m in metrics(nodes)] == pytest.approx(
        [m["loss"] for m in metrics(one)], rel=1e-6
    )
    expected, found = weights(one / "best"), weights(nodes / "best")
    assert found.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(found[key], value, rtol=1e-5, atol=1e-6, msg=key)


TWO_NODE_UPDATE = """import os, sys
sys.path[:0] = [{repo!r}, {repo!r} + "/tests", {repo!r} + "/bench"]
import torch, torch.distributed as dist
from helpers import fixed_groups
from helpers import updated_weights
rank = int(os.environ["RANK"])
mine = [g for i, g in enumerate(fixed_groups(n_groups=3)) if i % 2 == rank]
found = updated_weights(sys.argv[1], mine, micro_batch_size=2)
if rank == 0:
    torch.save(found, sys.argv[2])
dist.barrier()
dist.destroy_process_group()
"""


def test_a_full_grpo_update_on_two_nodes_equals_one_process(assets, tmp_path):
    """The update of test_full_grpo_update_on_two_ranks_and_another_split_equals_one_process (the
    sharded reference, two passes), its ranks the single ranks of two torchrun agents. Stated
    tolerance: rtol 1e-5, atol 1e-6."""
    base, _ = assets
    try:
        one = updated_weights(base, fixed_groups(n_groups=3), micro_batch_size=100)
    finally:
        dist.destroy_process_group()
    script = tmp_path / "update.py"
    script.write_text(TWO_NODE_UPDATE.format(repo=str(REPO)))
    two_nodes(script, base, tmp_path / "nodes.pt", cwd=tmp_path)
    found = torch.load(tmp_path / "nodes.pt")
    assert found.keys() == one.keys()
    for name, value in one.items():
        torch.testing.assert_close(found[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_full_grpo_run_on_two_nodes_equals_one_node(assets, tmp_path):
    """grpo.py end to end (two updates, filtering on, the sharded reference, checkpoints, the
    export) on two torchrun agents of one rank each gives exactly what one agent of two ranks gives.
    The oracle is not one process: rollouts are seeded per rank (grpo.derived_seed), so one rank
    samples other completions; the update itself is compared with one process above."""
    with JudgeServer(rules_backend).start() as server:

        def config(name):
            settings = {"loss.beta": 0.04, "updates": 2}
            return run_config(
                tmp_path / name, assets, server.url, finetune="full", lora=None, **settings
            )

        node = grpo_torchrun(config("node"))
        assert node.wait(timeout=600) == 0, node.stderr.read().decode()[-3000:]
        two_nodes(REPO / "grpo.py", config("nodes"), cwd=REPO)
    runs = [tmp_path / name / "run" for name in ("node", "nodes")]
    timing = ("time/", "tokens_per_s")
    logged = [
        [
            {k: v for k, v in m.items() if not k.startswith(timing)}
            for m in read_jsonl(r / "metrics.jsonl")
        ]
        for r in runs
    ]
    assert len(logged[0]) == 2 and logged[1] == logged[0]
    assert [world_size(r, 2) for r in runs] == [2, 2]
    a, b = weights(runs[0] / "model"), weights(runs[1] / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- export


def test_an_exported_checkpoint_is_the_model_the_run_exported_at_that_update(tmp_path, assets):
    """tools/export_checkpoint.py reads a full run's ckpt-<step> (DCP shards) back onto its base:
    the last checkpoint's export equals, tensor for tensor, the model/ the run wrote itself
    (fsdp.export_full, another path); the one before it differs; a LoRA checkpoint is refused."""
    import grpo
    from tools.export_checkpoint import export_checkpoint

    with JudgeServer(rules_backend).start() as server:
        config = run_config(
            tmp_path, assets, server.url, finetune="full", lora=None, **{"rollout.group_size": 8}
        )
        try:
            grpo.main([str(config)])
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-000002", "ckpt-000003"]
    last = weights(export_checkpoint(run / "ckpt-000003", tmp_path / "last"))
    before = weights(export_checkpoint(run / "ckpt-000002", tmp_path / "before"))
    written = weights(run / "model")
    assert last.keys() == written.keys() == before.keys()
    assert all(torch.equal(last[k], written[k]) for k in written)
    assert not all(torch.equal(before[k], written[k]) for k in written)
    assert (tmp_path / "last" / "tokenizer.json").is_file()
    M.Qwen.from_pretrained(tmp_path / "last")  # loads as a model folder
    lora = tmp_path / "lora" / "ckpt-000001"
    lora.mkdir(parents=True)
    (lora / "state.json").write_text(json.dumps({"step": 1, "finetune": "lora"}))
    with pytest.raises(CK.CheckpointError, match="a LoRA run's checkpoint is an adapter folder"):
        export_checkpoint(lora, tmp_path / "x")
