"""Run README example scripts one after the other in the processes of one torchrun launch
(``python -m torch.distributed.run --nproc-per-node N tests/_readme_world.py a.py b.py``), each
as ``python a.py`` would: its own ``__main__`` globals, the script's directory on ``sys.path``.

torchrun's rendezvous store outlives a process group, so a second ``init_process_group`` on it
would read the first world's keys (peer addresses, barrier counters). Each script therefore gets
a fresh store: rank 0 starts it on a port the OS picks as it binds (a port found free first and
bound later could be taken in between: the gloo worlds beside open connections all the time) and
publishes the port on torchrun's store; every rank points ``MASTER_PORT`` at it and joins it as a
client, as under torchrun's agent store. A script that leaves its process group up fails the
launch: the README's examples end with ``destroy_process_group()``.
"""
import os
import runpy
import sys
import time

import torch.distributed as dist


def _fresh_store(agent, rank: int, world: int, i: int):
    """Point ``MASTER_PORT`` at a new store for script ``i``; rank 0 hosts it (the returned store,
    to keep until every rank has left the script), the others get None."""
    key = f"readme_world/port{i}"
    store = None
    if rank == 0:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, world, is_master=True, wait_for_workers=False)
        agent.set(key, str(store.port))
    os.environ["MASTER_PORT"] = agent.get(key).decode()
    return store


def main(paths: list[str]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts torchrun's store
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not hosted and rank == 0)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the scripts' rendezvous: clients of _fresh_store's
    for i, path in enumerate(paths):
        store = _fresh_store(agent, rank, world, i)
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        runpy.run_path(path, run_name="__main__")
        sys.path.pop(0)
        if dist.is_initialized():
            raise RuntimeError(f"{path} left its process group up: end it with destroy_process_group()")
        print(f"README example {path} done on rank {rank}", flush=True)
        agent.add(f"readme_world/done{i}", 1)  # every rank has left script i before the next one starts
        while agent.add(f"readme_world/done{i}", 0) < world:
            time.sleep(0.05)
        del store


if __name__ == "__main__":
    main(sys.argv[1:])
