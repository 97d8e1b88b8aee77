"""Full-parameter runs (`finetune: full`) on PyTorch's FSDP2, the one place sharding lives: how the
model is sharded, how its gradients are clipped, how a rollout decodes from it, how its state goes
to and comes back from a sharded checkpoint, and how the result leaves as one Hugging Face
checkpoint.

The sharded model (`shard_model`, over the units `Qwen.shard_units` names), on a 1-D device mesh of
every rank (any number of nodes), or with `distributed.replicas` > 1 on a 2-D mesh (FSDP2's hybrid
sharding: each weight sharded over a row of consecutive ranks, one node, and replicated across the
rows; gradients reduce-scattered within a row, then summed across rows):
- each decoder layer, and the final norm, is one `fully_shard` unit; the root (the whole Qwen) is
  one more, owning no parameter: it ties the units into one FSDP state (one lazy initialization, one
  end-of-backward callback);
- master weights are float32, sharded along dim 0, and so are their gradients and AdamW's moments; a
  unit all-gathers its weights in the checkpoint dtype for forward and backward
  (`MixedPrecisionPolicy(param_dtype=<checkpoint dtype>, reduce_dtype=float32)`), and its gradients
  are reduce-scattered in float32 as a sum (divide factor 1): the trainers normalize every loss by
  counts over the whole update on all ranks, as in LoRA mode;
- the input embedding and the lm_head are frozen (CLUE A.2) and stay whole on every rank in the
  checkpoint dtype (`ignored_params` of the root): token_logprobs, HeadLogprobs and generate read
  the head outside any module forward, and tied embeddings are one tensor. Trainable token rows
  (SFT's `<evidence>` rows) are replicated too, their gradients summed by sync_gradients;
- model.py calls the layers and the norm as modules (their FSDP hooks run) but enters through
  `hidden_states`, not the root's forward, so `shard_model` runs one tiny forward through the root
  to make it the FSDP root;
- prefetch: in forward each unit, once its own weights are gathered, starts the all-gather of the
  unit after it (`set_modules_to_forward_prefetch`), so that all-gather is queued before this
  unit's compute rather than when the next forward begins (FSDP2's default); in backward FSDP2's
  default already starts the all-gather of the unit before (the forward order reversed, as a
  one-unit `set_modules_to_backward_prefetch` would), and a checkpointed layer's recomputation
  prefetches nothing.
Qwen3.5's A_log and dt_bias, kept in float32 by model.py, are computed in the checkpoint dtype here
(one param_dtype per unit); their master copies stay float32.

Loading (`shard_model(..., checkpoint=folder)`): the model comes from `Qwen.from_pretrained(folder,
on_meta=sharded_weight)`, its layers and norm on the meta device; after `fully_shard` each rank
reads only its own slices of them from the Hugging Face safetensors (`load_shards`). A LoRA adapter
to start from (GRPO's `model.sft_adapter`) is then merged shard by shard (`merge_adapter`).

Every rank must run the same sequence of forwards and backwards (each unit's all-gather is a
collective): the trainers give every rank the same number of micro-batches, padding with ones that
weigh 0 (`pad_batches`).

A full run's checkpoint (checkpoint.save_sharded / load_sharded, inside the atomic ckpt-<step>):
`dcp/`, written by torch.distributed.checkpoint through its safetensors storage (every rank its own
file of shards, each tensor's offsets in the file's JSON header: no pickle is written or read),
holding `model.<name>` for every trainable parameter and `optim.<name>.<moment>` for AdamW's state;
the optimizer's hyperparameters go to state.json.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from model import (
    Qwen,
    add_special_tokens,
    atomic_write,
    checkpoint_name,
    load_adapter,
    lora_modules,
    merge_lora,
    save_merged,
    train_token_rows,
)

ROWS = ("row_ids", "embed_rows", "head_rows")
SHARDED = ("model.layers.", "model.norm.")  # the names of the sharded units' parameters


def sharded_weight(name: str) -> bool:
    """Whether parameter `name` is sharded by `shard_model` (Qwen.from_pretrained's `on_meta`)."""
    return name.startswith(SHARDED)


def device_mesh(
    device: torch.device, replicas: int = 1, timeout_s: float | None = None
) -> DeviceMesh:
    """The 1-D mesh of all ranks, or with `replicas` > 1 (dividing the world size) the 2-D mesh
    ("replicate", "shard") of `replicas` rows of consecutive ranks: rank r in row r // (world /
    replicas). A plain (non-torchrun) run joins a process group of its own first, so one process
    trains through the same sharded code as many. The mesh's own process groups (a 2-D mesh's rows
    and columns, which torch creates with its default timeout) get `timeout_s`
    (distributed.timeout_s), as the world's has."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if replicas == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    names = ("replicate", "shard")
    mesh = init_device_mesh(device.type, (replicas, world // replicas), mesh_dim_names=names)
    if timeout_s is not None:
        for name in names:  # torch's own setter of a group's timeout
            dist.distributed_c10d._set_pg_timeout(
                timedelta(seconds=timeout_s), mesh.get_group(name)
            )
    return mesh


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def units(model: Qwen) -> list[FSDPModule]:
    """The FSDP units of a sharded model: the layers, the final norm, then the root."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)][::-1]


def frozen_whole(model: Qwen) -> set[torch.nn.Parameter]:
    """Parameters every rank keeps whole: the frozen embedding and lm_head, and the trainable token
    rows."""
    found = [
        model.model.embed_tokens.weight,
        model.head_weight(),
        model.embed_rows,
        model.head_rows,
    ]
    return {p for p in found if p is not None}


def shard_model(
    model: Qwen,
    device: torch.device,
    like: Qwen | None = None,
    checkpoint=None,
    replicas: int = 1,
    timeout_s: float | None = None,
) -> Qwen:
    """Shard `model` (loaded in its checkpoint dtype, token rows already added) as the module
    docstring says, in place; returns it. With `like` (GRPO's reference of the sharded policy
    `like`, equal to it at the start): every weight frozen in the checkpoint dtype, the embedding
    and lm_head those of `like` (one copy on a rank, not two). With `checkpoint` (the Hugging Face
    folder `model` came from, its sharded weights left on the meta device: `from_pretrained(...,
    on_meta=sharded_weight)`), every rank reads only its own shards of them (`load_shards`): no
    rank ever holds a whole layer. `replicas` > 1: hybrid sharding on `device_mesh`'s 2-D mesh,
    whose groups wait `timeout_s`."""
    compute, trainable = model.dtype, like is None
    if like is not None:
        model.model.embed_tokens.weight = like.model.embed_tokens.weight
        if model.lm_head is not None:
            model.lm_head.weight = like.lm_head.weight
    whole = frozen_whole(model)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.head_weight().requires_grad_(False)
    model.source_dtypes = {n: p.dtype for n, p in model.named_parameters() if p not in whole}
    mesh = device_mesh(device, replicas, timeout_s)
    policy = MixedPrecisionPolicy(
        param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    for module in [*model.model.layers, model.model.norm]:
        if trainable:
            module.float()
        module.requires_grad_(trainable)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=whole)
    chain = [*model.model.layers, model.model.norm]  # the units in forward order
    for unit, following in zip(chain, chain[1:]):
        unit.set_modules_to_forward_prefetch([following])
    for unit in units(model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    if checkpoint is not None:
        load_shards(model, checkpoint, device)
    with torch.no_grad():
        # the root's forward makes it the FSDP root
        model(torch.zeros((1, 1), dtype=torch.long, device=device))
    return model


def sharded_model(
    path,
    dtype: str,
    device: torch.device,
    tok,
    tokens: list[str] = (),
    adapter=None,
    train_rows: bool = False,
    like: Qwen | None = None,
    seed: int = 0,
    replicas: int = 1,
    timeout_s: float | None = None,
) -> Qwen:
    """The model of a full-parameter run, either trainer's: every rank reads only its shards of the
    checkpoint `path` in `dtype` (a reference, `like`'s frozen copy, not even the embedding and
    lm_head: it shares `like`'s), the special `tokens` added (`train_rows`: their embedding and
    lm_head rows trained, SFT's <evidence> rows), sharded after torch.manual_seed(`seed`)
    (`shard_model`, with `replicas` and `timeout_s`), then the LoRA adapter folder `adapter` (GRPO's
    SFT adapter) merged into the shards (`merge_adapter`)."""
    model = Qwen.from_pretrained(
        path,
        dtype=dtype,
        device=device,
        on_meta=(lambda name: True) if like is not None else sharded_weight,
    )
    ids = add_special_tokens(model, tok, list(tokens)) if tokens else []
    torch.manual_seed(seed)
    if train_rows and ids:
        train_token_rows(model, ids)
    shard_model(model, device, like, path, replicas=replicas, timeout_s=timeout_s)
    if adapter:
        merge_adapter(model, adapter)
    return model


def load_shards(model: Qwen, checkpoint, device: torch.device) -> None:
    """Fill a sharded model's meta-device shards from the Hugging Face checkpoint folder
    `checkpoint` (a collective): DCP's HuggingFaceStorageReader reads each rank's slice of each
    tensor by offset and casts it to the shard's dtype."""
    for module in [*model.model.layers, model.model.norm]:
        module.to_empty(device=device)
    shards = {
        checkpoint_name(model.config, name): p
        for name, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    dcp.load(shards, storage_reader=HuggingFaceStorageReader(os.fspath(checkpoint)))


def merge_adapter(model: Qwen, adapter) -> None:
    """Fold the LoRA adapter folder `adapter` and its token rows into a sharded model, as
    model.merge_lora folds them into a whole one: each rank adds to its own rows of each weight
    those rows of the delta, (alpha / r) B[rows] A, and rounds the sum to the checkpoint dtype as
    merge_lora does (the float32 master copy keeps that value); the token rows go into the whole
    embedding and lm_head. The factors are small, so every rank reads all of them; no rank forms a
    whole weight or delta."""
    trainable = {p: p.requires_grad for p in model.parameters()}
    load_adapter(model, adapter)  # the factors beside the sharded weights (and every weight frozen)
    with torch.no_grad():
        for name, m in lora_modules(model).items():
            w = m.weight
            rows = distribute_tensor(m.lora_B, w.device_mesh, w.placements, src_data_rank=None)
            local = w.to_local()
            delta = (rows.to_local().float() @ m.lora_A.float()) * m.lora_scale
            local.copy_((local.float() + delta).to(model.source_dtypes[f"{name}.weight"]))
            m.lora_A = m.lora_B = None
    merge_lora(model)  # what is left: the token rows
    for p, flag in trainable.items():
        p.requires_grad_(flag)


def pad_batches(batches: list, idle, device: torch.device) -> list:
    """`batches` plus as many `idle` micro-batches (tensors that weigh nothing in the loss) as the
    busiest rank has more: every rank of a sharded model must run the same forwards and
    backwards."""
    count = torch.tensor([len(batches)], device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return batches + [idle] * (int(count.item()) - len(batches))


@contextlib.contextmanager
def gathered(model: Qwen):
    """Every unit's weights all-gathered once (in the compute dtype) and kept through the block, so
    decoding runs no collective per token; yields `plain_view(model)`, the model to decode with.
    Resharded on exit, before training (the view's tensors are then freed)."""
    for unit in units(model):
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield plain_view(model)
    finally:
        for unit in units(model):
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)


def plain_view(model: Qwen) -> Qwen:
    """A Qwen over the gathered weights of a sharded `model` (`gathered`), the same tensors without
    FSDP's module hooks: each unit's pre-forward hook makes FSDP's streams wait on the current one,
    which a CUDA-graph capture (`rollout.decode: static`) does not survive; a decode step through
    the view runs the same operators on the same weights, and nothing else."""
    with torch.device("meta"):
        view = Qwen(model.config)
    rows = ("embed_rows", "head_rows")  # not in a fresh Qwen's state: set below
    view.load_state_dict(
        {name: p.detach() for name, p in model.named_parameters() if name not in rows},
        strict=False,
        assign=True,
    )
    if model.row_ids is not None:  # detached, so the view's requires_grad_ leaves them trainable
        view.row_ids, view.embed_rows = model.row_ids, model.embed_rows.detach()
        tied = model.head_rows is model.embed_rows
        view.head_rows = view.embed_rows if tied else model.head_rows.detach()
    view.rows_enabled = model.rows_enabled
    if missing := [name for name, p in view.named_parameters() if p.is_meta]:
        raise RuntimeError(f"plain_view: {missing[0]} is not gathered")
    return view.requires_grad_(False).eval()


class GatheredSampler:
    """A sampler (rollout.py's interface) for a sharded policy: an update's rollouts run with the
    policy's weights gathered whole (`gathered`), once per update on every rank, however many
    sampling rounds each rank runs, and decode through their hook-free `plain_view`."""

    def __init__(self, sampler, policy: Qwen):
        self.sampler, self.policy = sampler, policy

    @contextlib.contextmanager
    def rollouts(self, update: int):
        with gathered(self.policy) as view, self.sampler.rollouts(update) as token_weights:
            self.sampler.policy = view
            try:
                yield token_weights
            finally:
                self.sampler.policy = self.policy

    def __getattr__(self, name):  # sample, judge, play: the wrapped sampler's
        return getattr(self.sampler, name)


def clip_sharded(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Scale the gradients of `params` so their global L2 norm is at most `max_norm` (as
    clip_grad_norm_, whose coefficient this is); returns the norm before clipping. Sharded gradients
    (DTensors) count every shard once, replicated ones once."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    local = [g for g in grads if not isinstance(g, DTensor)]
    total = torch.zeros((), dtype=torch.float32, device=(sharded or local)[0].device)
    if sharded:
        total += torch.nn.utils.get_total_norm(sharded).full_tensor().float() ** 2
    if local:
        total += torch.nn.utils.get_total_norm(local).float() ** 2
    norm = total.sqrt().item()
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def export_trained(model: Qwen, tok, out_dir) -> None:
    """Write what training changes in a sharded model, for a server that holds the rest
    (vllm_engine's weight sync after its first): every parameter that requires grad, each shard
    cast to the dtype it was loaded in before the gather (the gather moves that dtype, not the
    float32 master), written by rank 0 under its Hugging Face name as model.safetensors. The frozen
    embedding and lm_head stay out; a model whose token rows train folds them into those, so it is
    written whole (export_full). A collective."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if any(name in ROWS for name, _ in trained):
        return export_full(model, tok, out_dir)
    main, tensors = dist.get_rank() == 0, {}
    for name, p in trained:
        shard = p.detach().to(model.source_dtypes.get(name, p.dtype))
        full = shard.full_tensor() if isinstance(shard, DTensor) else shard
        if main:
            tensors[checkpoint_name(model.config, name)] = full.cpu()
        del shard, full
    if main:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        atomic_write(Path(out_dir) / "model.safetensors", tensors)
    dist.barrier()


def export_full(model: Qwen, tok, out_dir) -> None:
    """Write a sharded model as one Hugging Face checkpoint (model.save_merged's format: safetensors
    shards + index, config, tokenizer; trainable token rows folded in) in the dtypes it was loaded
    with. A collective: the tensors are gathered one at a time; rank 0 keeps each on the CPU (one
    full copy at most), the other ranks keep none."""
    main = dist.get_rank() == 0
    state, rows = {}, {}
    for name, t in model.state_dict().items():
        if t is None:
            continue
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if main:
            (rows if name in ROWS else state)[name] = full.detach().to(
                "cpu", model.source_dtypes.get(name, full.dtype)
            )
        del full
    if main:
        with torch.device("meta"):
            plain = Qwen(model.config)
        plain.load_state_dict(state, assign=True)
        plain.source = getattr(model, "source", None)
        if rows:
            train_token_rows(plain, rows["row_ids"].tolist())
            with torch.no_grad():
                plain.embed_rows.copy_(rows["embed_rows"])
                if plain.head_rows is not plain.embed_rows:
                    plain.head_rows.copy_(rows["head_rows"])
        save_merged(plain, tok, out_dir)
    dist.barrier()
