"""Run README example scripts one after the other in the processes of one torchrun launch
(``python -m torch.distributed.run --nproc-per-node N tests/_readme_world.py a.py b.py``), each
as ``python a.py`` would: its own ``__main__`` globals, the script's directory on ``sys.path``.

torchrun's rendezvous store outlives a process group, so a second ``init_process_group`` on it
would read the first world's keys (peer addresses, barrier counters). Each script therefore gets
a fresh store: rank 0 picks a free port and publishes it on torchrun's store, every rank points
``MASTER_PORT`` at it and rank 0 hosts the new store (as outside torchelastic). A script that
leaves its process group up fails the launch: the README's examples end with
``destroy_process_group()``.
"""
import os
import runpy
import socket
import sys
import time

import torch.distributed as dist


def _fresh_port(store, rank: int, i: int) -> str:
    key = f"readme_world/port{i}"
    if rank == 0:
        with socket.socket() as s:
            s.bind((os.environ["MASTER_ADDR"], 0))
            port = str(s.getsockname()[1])
        store.set(key, port)
    return store.get(key).decode()


def main(paths: list[str]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts torchrun's store
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not hosted and rank == 0)
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        os.environ.pop(name, None)
    for i, path in enumerate(paths):
        os.environ["MASTER_PORT"] = _fresh_port(agent, rank, i)
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        runpy.run_path(path, run_name="__main__")
        sys.path.pop(0)
        if dist.is_initialized():
            raise RuntimeError(f"{path} left its process group up: end it with destroy_process_group()")
        print(f"README example {path} done on rank {rank}", flush=True)
        agent.add(f"readme_world/done{i}", 1)  # every rank has left script i before the next one starts
        while agent.add(f"readme_world/done{i}", 0) < world:
            time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1:])
