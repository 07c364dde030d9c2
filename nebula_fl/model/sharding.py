"""How a cluster's ranks share the model: `ddp` (each rank holds all of it) or `fsdp` (each holds a shard).

DDP keeps a whole copy of the model, its gradients and its AdamW moments on every worker, so a model that does
not fit one worker does not train. FSDP2 (``torch.distributed.fsdp.fully_shard``) splits every parameter, its
gradient and its optimizer state across the ranks, and all-gathers one transformer layer at a time for the
forward and backward passes: a rank holds about 1/world of the model, plus one layer unsharded. Gradients are
reduce-scattered and averaged, so a step is the same step DDP takes (up to float rounding).

The layers are found generically: the repeated blocks (the elements of the outermost ``ModuleList`` whose
elements share one class, e.g. BERT's ``encoder.layer``) and the embedding tables whose weight nothing else
shares (a vocabulary table is a large part of a small model; one tied to an output layer stays with the root,
which uses it last), each its own FSDP group, then the root. A frozen base
with trainable LoRA factors of another dtype (an fp32 adapter on a bf16 base) is split further: FSDP2 needs
one dtype among the trainable parameters of a group, so the modules holding them are wrapped apart.

Parameters become DTensors. What crosses the WAN is always the full tensor: ``whole`` gathers one (a
collective, so every rank calls it, in the same order) and ``shard_like`` cuts a full tensor back into this
rank's shard (no communication: every rank holds the same full arrays). Optimizer state is snapshotted as the
local shards (``local_optimizer_state``) and rebuilt on load (``load_optimizer_state``); the world size must be
the one it was saved with, which the trainer checks.

Per-example DP (Opacus) is refused under fsdp: its FSDP2 path (``ghost_fsdp``) is not wired in here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nebula_fl.errors import NebulaError


def wrap(model: nn.Module, *, parallel: str, device: torch.device, world: int) -> nn.Module:
    """The model the ranks train: sharded in place (FSDP2: `model` itself becomes the sharded module), DDP, or
    itself for one ddp worker. One fsdp worker still shards, over a mesh of one: nothing is saved, but the code
    path is the one a bigger cluster runs (a one-GPU check of a model before it goes to a multi-GPU cluster)."""
    if parallel == "fsdp":
        if getattr(model, "is_quantized", False):  # (a PeftModel answers for the model it wraps)
            raise NebulaError("a quantised base (task.base-dtype nf4 or int8) cannot be sharded by FSDP here; run "
                              "--parallel ddp, or shard an fp32 or bf16 base")
        return shard(model, device=device)
    if world <= 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of every outermost ModuleList whose elements share one class and hold parameters."""
    blocks: list[nn.Module] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in taken):
            continue
        if (isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1
                and any(True for _ in module.parameters())):
            blocks.extend(module)
            taken.append(name)
    return blocks


def untied_embeddings(model: nn.Module) -> list[nn.Module]:
    """The nn.Embedding modules outside the repeated blocks whose weight no other module holds (not tied)."""
    inside = {id(m) for block in repeated_blocks(model) for m in block.modules()}
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [m for m in model.modules() if isinstance(m, nn.Embedding) and id(m) not in inside
            and all(owners[id(p)] == 1 for p in m.parameters())]


def shard(model: nn.Module, *, device: torch.device) -> nn.Module:
    """FSDP2 over every rank of the default process group: each repeated block, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in [*repeated_blocks(model), *untied_embeddings(model), model]:
        _uniform_trainable_dtype(block, mesh)
        fully_shard(block, mesh=mesh)
    return model


def _uniform_trainable_dtype(group: nn.Module, mesh) -> None:
    """If the trainable parameters this group would own differ in dtype, wrap the modules holding those of the
    other dtypes apart (FSDP2 all-gathers and reduces one group's trainable parameters in one dtype)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    owned = _owned(group)
    dtypes = [p.dtype for p in owned if p.requires_grad]
    if len(set(dtypes)) <= 1:
        return
    common = max(set(dtypes), key=dtypes.count)
    for module in list(group.modules()):
        if module is group or isinstance(module, FSDPModule):
            continue
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own and any(p.dtype != common for p in own):
            fully_shard(module, mesh=mesh)


def _owned(group: nn.Module) -> list[nn.Parameter]:
    """The parameters of `group` not already managed by an FSDP module inside it."""
    from torch.distributed.fsdp import FSDPModule

    inner = {id(p) for m in group.modules() if m is not group and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in group.parameters() if id(p) not in inner]


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# -- full tensors to and from the shards --------------------------------------------------------------------------
def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a (sharded) DTensor; a plain tensor as it is. A collective for a DTensor: every rank
    calls it for the same tensors in the same order."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(reference: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `reference` is: this rank's shard of it when `reference` is a DTensor (cut locally, no
    communication: every rank holds the same `full`), else `full` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(reference, DTensor):
        return full
    full = full.to(device=reference.device, dtype=reference.dtype)
    return distribute_tensor(full, reference.device_mesh, reference.placements, src_data_rank=None)


# -- optimizer state in snapshots ----------------------------------------------------------------------------------
def local_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict with each DTensor replaced by a copy of this rank's local shard (a snapshot is
    loaded with ``weights_only``, which takes plain tensors); unchanged without DTensors."""
    from torch.distributed.tensor import DTensor

    def local(value: Any) -> Any:
        return value.to_local().clone() if isinstance(value, DTensor) else value

    return {**state, "state": {k: {n: local(v) for n, v in s.items()} for k, s in state["state"].items()}}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a state saved by ``local_optimizer_state``: each local shard becomes a DTensor laid out as the
    parameter it belongs to (same mesh, placements and global shape), then the optimizer loads it."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    rebuilt: dict[Any, dict[str, Any]] = {}
    for key, entry in state["state"].items():
        param = params[int(key)]
        rebuilt[key] = {
            name: DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                     shape=param.shape, stride=param.stride())
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0 else value
            for name, value in entry.items()
        }
    optimizer.load_state_dict({**state, "state": rebuilt})
