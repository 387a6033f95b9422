"""Start-up benchmark: smp.init and the pipeline mesh on 4 ranks, against torch's own
init_process_group in the same run.

Each round is one 4-rank job under smprun (Gloo on loopback). Every rank times
  - torch: dist.init_process_group(gloo) on a store of its own that every rank has
    reached (the cost a torchrun user pays before training);
  - smp:   smp.init({"partitions": 2}), which sets the job key (Note [Job secret]),
    agrees on the config over the store with sealed values, and creates the world, pp
    and dp groups;
  - mesh:  a 4-rank pipeline mesh (P2PEngine over the same store): every pair connects
    and proves the job key by challenge-response (6 handshakes in all).
A round's figure is the slowest rank's. Prints one JSON line with the medians; ratio =
smp.init / torch init_process_group. The issue's bound: smp.init under 0.2 s.

Authentication has no switch to turn it off (a switch would be one more way in), so the
line also gives what it adds by construction: the mesh's handshakes are inside mesh_s,
and every request after them runs on connections that carry no per-message MAC.

    PYTHONPATH=build/python .venv/bin/python bench/init.py [--rounds 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BUILD = os.environ.get("SMP_BUILD_DIR", os.path.join(REPO, "build"))


def worker():
    import datetime
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torch's peer on a store of its own (port + 2), so that both start from nothing.
    port = int(os.environ["MASTER_PORT"]) + 2
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    # Aligned first (processes start seconds apart), as smp.init is after this part's
    # closing barrier: each side times only its own work.
    store.add("arrived", 1)
    while store.add("arrived", 0) < world:
        time.sleep(0.001)
    t = time.perf_counter()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch_s = time.perf_counter() - t
    dist.barrier()
    dist.destroy_process_group()

    import smp
    from smp import _C
    from smp.process_state import state
    t = time.perf_counter()
    smp.init({"partitions": 2})
    smp_s = time.perf_counter() - t
    smp.barrier()
    t = time.perf_counter()
    engine = _C.P2PEngine(state.store, "bench/mesh", rank, world, 60.0)
    mesh_s = time.perf_counter() - t
    smp.barrier()
    del engine
    print("INIT " + json.dumps({"rank": rank, "torch_s": torch_s, "smp_s": smp_s,
                                "mesh_s": mesh_s}), flush=True)
    smp.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker()
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"), SMP_PYTHON=sys.executable)
    rounds = []
    for _ in range(args.rounds):
        cmd = [os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", "4", __file__, "--worker"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            sys.stderr.write(out.stderr[-3000:])
            return 1
        ranks = [json.loads(line.split("INIT ", 1)[1]) for line in out.stdout.splitlines()
                 if "INIT " in line]
        assert len(ranks) == 4, out.stdout
        rounds.append({k: max(r[k] for r in ranks) for k in ("torch_s", "smp_s", "mesh_s")})
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(json.dumps({
        "bench": "init",
        "ranks": 4,
        "rounds": args.rounds,
        "torch_init_process_group_s": round(med["torch_s"], 4),
        "smp_init_s": round(med["smp_s"], 4),
        "pipeline_mesh_s": round(med["mesh_s"], 4),
        "ratio": round(med["smp_s"] / med["torch_s"], 3),
        "smp_init_under_0_2_s": med["smp_s"] < 0.2,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
