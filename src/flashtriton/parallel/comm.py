"""The group, what its backend can move, one cross-rank agreement check, and the ring's point-to-point exchange.

Every collective here waits at most the process group's timeout (`torch.distributed.init_process_group(...,
timeout=)`; torch's defaults: 10 minutes for NCCL, 30 for the others): a rank that never joins a call makes the
others fail then (gloo raises; NCCL's watchdog ends the process), not hang forever. Bad input is caught before any
tensor moves: each rank checks its own arguments, then one all_gather of a small int64 tensor (`agree`) compares every rank's shapes, dtypes and
options and carries whether some rank refused its inputs, so that every rank raises, each with the reason.
"""

from __future__ import annotations

import struct
import zlib

import torch
import torch.distributed as dist


# What the point-to-point and all-to-all paths of the two common backends move; others (mpi, ucc, a custom
# backend) are not judged here.
MOVES = {"nccl": ("cuda",), "gloo": ("cpu",)}
SIGNATURE_SLOTS = 64  # int64 slots of the agreement tensor: one flag, then the encoded fields
_LIST_SLOTS = 8  # a shape: its length, then up to 7 sizes


def group_info(group):
    """(group, rank in it, its size); group None is the default (world) group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("flashtriton.parallel needs torch.distributed initialized: call "
                           "torch.distributed.init_process_group first (or pass an initialized group=)")
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group it was given")
    return group, rank, dist.get_world_size(group)


def _backends(group) -> dict[str, str]:
    """{device type or '*': backend name} of the group ('cpu:gloo,cuda:nccl' or one backend for all)."""
    name = str(dist.get_backend(group)).lower()
    if ":" in name:
        return dict(part.split(":", 1) for part in name.split(","))
    return {"*": name}


def check_backend(group, device: torch.device) -> None:
    """ValueError naming `group` when its backend cannot move tensors on `device`."""
    backends = _backends(group)
    backend = backends.get(device.type, backends.get("*"))
    if backend is None:
        raise ValueError(f"group: its backends ({dist.get_backend(group)}) serve no {device.type} tensors; "
                         f"the inputs are on {device}")
    if backend in MOVES and device.type not in MOVES[backend]:
        raise ValueError(f"group: its backend {backend!r} cannot move {device.type} tensors (it moves "
                         f"{' and '.join(MOVES[backend])} ones); the inputs are on {device}. Use NCCL for CUDA "
                         "tensors and gloo for CPU tensors (init_process_group(backend='cpu:gloo,cuda:nccl') "
                         "serves both)")


def _collective_device(group, device) -> torch.device:
    """Where the agreement tensor lives: chosen from the backend alone (every rank must pick the same kind)."""
    backends = _backends(group)
    if "*" not in backends:
        return torch.device("cpu") if "cpu" in backends else torch.device("cuda", torch.cuda.current_device())
    backend = backends["*"]
    if backend in MOVES:
        kind = MOVES[backend][0]
        return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    return device if device is not None else torch.device("cpu")


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)


def _encode(value) -> list[int]:
    if isinstance(value, bool) or isinstance(value, int):
        return [int(value)]
    if isinstance(value, float):
        return [struct.unpack("<q", struct.pack("<d", value))[0]]
    if isinstance(value, torch.dtype):
        return [_DTYPES.index(value) if value in _DTYPES else 100 + zlib.crc32(str(value).encode())]
    if isinstance(value, (tuple, list)):
        sizes = [int(v) for v in value][:_LIST_SLOTS - 1]
        return [len(value), *sizes, *[0] * (_LIST_SLOTS - 1 - len(sizes))]
    return [zlib.crc32(str(value).encode())]


def _decode(value, slots: list[int]):
    """A field's value as another rank encoded it, for messages (`value`: this rank's, of the same kind)."""
    if isinstance(value, bool):
        return bool(slots[0])
    if isinstance(value, int):
        return slots[0]
    if isinstance(value, float):
        return struct.unpack("<d", struct.pack("<q", slots[0]))[0]
    if isinstance(value, torch.dtype):
        return _DTYPES[slots[0]] if slots[0] < len(_DTYPES) else "another dtype"
    if isinstance(value, (tuple, list)):
        return tuple(slots[1:1 + min(slots[0], _LIST_SLOTS - 1)])
    return "another value"


def agree(group, device, what: str, fields: dict, error: Exception | None) -> None:
    """Collective: raise on every rank when some rank's `error` is set or the ranks' `fields` differ.

    fields: {name: value} (ints, bools, floats, dtypes, shapes, strings), the same names on every rank that has
    no error. One all_gather of SIGNATURE_SLOTS int64 (on the CPU where the backend moves CPU tensors, else on
    the current GPU: then it waits for the GPU once). The rank with the error raises it; the others raise a
    ValueError naming the ranks that refused."""
    _, rank, world = group_info(group)
    slots = [0 if error is None else 1]
    widths = []
    if error is None:
        for value in fields.values():
            encoded = _encode(value)
            widths.append(len(encoded))
            slots += encoded
    if len(slots) > SIGNATURE_SLOTS:  # pragma: no cover (a programming error: the callers' fields are fixed)
        raise AssertionError(f"{what}: {len(slots)} signature slots, more than {SIGNATURE_SLOTS}")
    mine = torch.tensor(slots + [0] * (SIGNATURE_SLOTS - len(slots)), dtype=torch.int64,
                        device=_collective_device(group, device))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).tolist()
    refused = [r for r in range(world) if table[r][0]]
    if error is not None:
        raise error
    if refused:
        raise ValueError(f"{what}: rank{'s' if len(refused) > 1 else ''} {', '.join(map(str, refused))} of the "
                         f"group refused {'their' if len(refused) > 1 else 'its'} inputs (the error there says "
                         "why); nothing ran")
    start = 1
    for (name, value), width in zip(fields.items(), widths):
        column = [row[start:start + width] for row in table]
        if any(c != column[rank] for c in column):
            shown = ", ".join(f"rank {r}: {value if r == rank else _decode(value, c)}" for r, c in enumerate(column))
            raise ValueError(f"{what}: {name} must be the same on every rank of the group, got {shown}")
        start += width


class RingExchange:
    """Send a tensor to the next rank of the group while receiving one from the previous (isend / irecv through
    batch_isend_irecv). `tag` keeps two exchanges in flight at once apart (gloo matches messages by tag; NCCL
    orders them)."""

    def __init__(self, group, rank: int, world: int):
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % world)
        self.prev = dist.get_global_rank(group, (rank - 1) % world)

    def start(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> list:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group, tag),
                                       dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)])


def wait(requests) -> None:
    """Wait for an exchange (at most the process group's timeout)."""
    for request in requests or ():
        request.wait()
