"""Process-group set-up shared by the jobs: the same code runs under torchrun/deepspeed on CPU (gloo) and GPU (NCCL)."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A port nothing listens on now: the OS picks it when binding port 0 (on every interface, as torch's TCPStore
    server listens)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def launcher_env() -> None:
    """The rendezvous environment torch's env:// init reads. Under torchrun / the deepspeed launcher it is theirs
    and left as is; a process started without a launcher is a world of one, rendezvousing with itself on a port the
    OS reports free (a port derived from the PID could be taken by another job on the machine)."""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())


def init_world(device: str | None = None) -> World:
    """Read torchrun's environment (a plain process is a world of one) and start the process group if needed."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo",
                                device_id=dev if dev.type == "cuda" else None)
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def sequence_parallel_group(world: World, size: int):
    """This rank's group of `size` consecutive ranks that split each batch's positions (None for size 1). Every
    rank creates every group (torch.distributed.new_group is collective) and keeps its own: a communicator apart from
    the world's, so its collectives never interleave with DeepSpeed's gradient reduction."""
    if size == 1:
        return None
    groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(world.world_size // size)]
    return groups[world.rank // size]


def main_log(is_main: bool):
    """print to stderr (flushed) on the main rank, nothing on the others: every job's progress lines."""
    if not is_main:
        return lambda *a: None
    return lambda *a: print(*a, file=sys.stderr, flush=True)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """rank src's obj on every rank (identity in a world of one)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def fail_together(msg: str | None, exc=ValueError, src: int = 0) -> None:
    """Every rank raises the same error that rank `src` decided on, so no rank hangs in a later collective."""
    msg = broadcast_object(msg, src=src)
    if msg:
        raise exc(msg)


def run_on_main(fn, world: World):
    """Run fn() on rank 0 only; any error it raises is raised on every rank (as ValueError with its message)."""
    err, result = None, None
    if world.is_main:
        try:
            result = fn()
        except Exception as e:  # re-raised below on every rank, rank 0 with its own traceback
            err = e
    msg = broadcast_object(f"{type(err).__name__}: {err}" if err else None)
    if err is not None:
        raise err
    if msg:
        raise ValueError(f"rank 0 failed: {msg}")
    return result
