"""How close the plans smp executes come to the best order, under measured action times.

smp compiles a step's plan in unit costs (smp_core/plan.h: a forward 1, an input and a
weight gradient 1 each, the loss hop 0). This tool replays the lists the runtime
executes (`_C.Plan.executed`, Note [Executed plan]) with the times measured for each
action on each rank and a message delay, then searches other orders within the same
rules (dependencies, the driver's window, gradients in microbatch order) for a shorter
step. It answers "is the gap to the ceiling the order, or the time of the actions?":
if no order is much shorter than the executed one, only cheaper actions move the step.

Defaults: the path 0, 1, 0 of bench/pipeline.py (pp=2, 8 microbatches, the loss on the
driver) and the action times measured there on the 2-core machine, ranks bound (stop 36,
medians from a trace of each rank's compute token): the driver's forward 1.75 ms and
backward 3.45 ms; its loss hop 0.09 ms forward (the step body from the answer through
cross_entropy) and 0.17 ms backward (model.backward up to sending the gradient: Note
[Last hop's gradients]); the serving rank's forward 1.85 ms and backward 3.45 ms; 0.08
ms from a send to the receiving rank's next action.

    PYTHONPATH=build/python .venv/bin/python tools/plan_costs.py [--kinds interleaved,1f1b]
        [--forward 1.75,1.85,0.09] [--backward 3.45,3.45,0.17] [--delay 0.08] [--iters 30000]

Prints one JSON line: per kind, the executed plan's step (ms, without the step's
boundaries and the optimizer), the shortest order found, and a lower bound that no order
reaches (the busiest rank's work plus the chain of other ranks' work it must wait for
before its first action and after its last).
"""
import argparse
import json
import random

from smp import _C


def parse_action(text):
    """'F3.h2' -> ('F', 3, 2)."""
    head, hop = text.split(".h")
    return head[0], int(head[1:]), int(hop)


class Model:
    """A plan's lists replayed over real times: the dependencies of Plan::simulate
    (smp_core/plan.cpp ready_at), each crossing between ranks delayed by `delay`;
    `forward[h]`, `backward[h]` per hop (B; I and W split it by `weight_share`).
    `valid()` holds a reordered list to the rules the runtime keeps within a rank."""

    def __init__(self, path, microbatches, window, forward, backward, delay, simple=False,
                 last_hop_accumulates=False, weight_share=0.5):
        self.path, self.m, self.window = list(path), microbatches, window
        self.hops = len(self.path)
        self.forward, self.backward, self.delay, self.simple = forward, backward, delay, simple
        self.last_hop_accumulates = last_hop_accumulates
        self.weight_share = weight_share
        self.pairs = set()

    def lists(self, plan):
        """The plan's per-rank lists as (op, mb, hop); remembers which of the last hop's
        forwards its backward follows at once (fused_last), for valid()."""
        lists = [[parse_action(a) for a in lst] for lst in plan.compute()]
        last = self.hops - 1
        if not self.simple:
            for lst in lists:
                for a, b in zip(lst, lst[1:]):
                    if a[0] == "F" and a[2] == last and b[0] in "BI" and b[1:] == a[1:]:
                        self.pairs.add(a)
        return lists

    def cost(self, a):
        op, _, h = a
        if op == "F":
            return self.forward[h]
        if op == "B":
            return self.backward[h]
        share = self.weight_share if op == "W" else 1 - self.weight_share
        return self.backward[h] * share

    def lag(self, h_from, h_to):
        return 0.0 if self.path[h_from] == self.path[h_to] else self.delay

    def deps(self, a, backward_of):
        """(action, delay) pairs that `a` waits for (ready_at)."""
        op, mb, h = a
        if op == "F":
            return [(("F", mb, h - 1), self.lag(h - 1, h))] if h > 0 else []
        if op == "W":
            return [(("I", mb, h), 0.0)]
        if h < self.hops - 1:
            return [(backward_of(mb, h + 1), self.lag(h + 1, h))]
        if self.simple:  # the last hop's backward waits for every microbatch's forward
            return [(("F", k, h), 0.0) for k in range(self.m)]
        return [(("F", mb, h), 0.0)]

    def simulate(self, lists):
        """The step's length when each rank runs its list in order (inf: deadlock)."""
        names = {a for lst in lists for a in lst}
        def backward_of(mb, h):
            return ("I", mb, h) if ("I", mb, h) in names else ("B", mb, h)
        finish, t, cursor = {}, [0.0] * len(lists), [0] * len(lists)
        left = sum(map(len, lists))
        while left:
            moved = False
            for r, lst in enumerate(lists):
                while cursor[r] < len(lst):
                    a = lst[cursor[r]]
                    deps = self.deps(a, backward_of)
                    if any(d not in finish for d, _ in deps):
                        break
                    start = max([t[r]] + [finish[d] + lag for d, lag in deps])
                    t[r] = finish[a] = start + self.cost(a)
                    cursor[r] += 1
                    left -= 1
                    moved = True
            if not moved:
                return float("inf")
        return max(t)

    def accumulates(self, a):
        return a[0] in "BW" and (a[2] != self.hops - 1 or self.last_hop_accumulates)

    def valid(self, lst):
        """The runtime's rules within one rank's list (Note [Executed plan]): the driver
        starts microbatches in order and at most `window` at once; gradients accumulate
        in microbatch order (Note [Gradient order]); the loss's backward follows its
        forward where the executed plan fuses them."""
        seen_back0, started, acc_mb = set(), -1, -1
        for i, a in enumerate(lst):
            op, mb, h = a
            if op == "F" and h == 0:
                too_many = mb >= self.window and (mb - self.window) not in seen_back0
                if mb != started + 1 or too_many:
                    return False
                started = mb
            if op in "BI" and h == 0:
                seen_back0.add(mb)
            if self.accumulates(a):
                if mb < acc_mb:
                    return False
                acc_mb = mb
            if a in self.pairs and (i + 1 >= len(lst) or lst[i + 1][1:] != a[1:] or
                                    lst[i + 1][0] not in "BI"):
                return False
        return True

    def bound(self):
        """The busiest rank's work, plus the forward chain before its first action and
        the backward chain after its last one (other ranks' work on one microbatch)."""
        best = 0.0
        for r in set(self.path):
            hops = [h for h in range(self.hops) if self.path[h] == r]
            work = self.m * sum(self.forward[h] + self.backward[h] for h in hops)
            first = hops[0]
            head = sum(self.forward[h] + self.lag(h, h + 1) for h in range(first))
            tail = sum(self.backward[h] + self.lag(h + 1, h) for h in range(first))
            best = max(best, head + work + tail)
        return best


def search(model, lists, iters, seed=0):
    """Local search over per-rank orders: move one action a few places, keep the move
    if the step is no longer (and, rarely, if it is, to leave a local optimum)."""
    rng = random.Random(seed)
    best, best_ms = [list(l) for l in lists], model.simulate(lists)
    cur, cur_ms = [list(l) for l in best], best_ms
    for _ in range(iters):
        r = rng.randrange(len(cur))
        if len(cur[r]) < 2:
            continue
        lst = list(cur[r])
        i = rng.randrange(len(lst))
        j = max(0, min(len(lst) - 1, i + rng.choice([-3, -2, -1, 1, 2, 3])))
        lst.insert(j, lst.pop(i))
        if not model.valid(lst):
            continue
        cand = cur[:r] + [lst] + cur[r + 1:]
        ms = model.simulate(cand)
        if ms <= cur_ms or (ms < float("inf") and rng.random() < 0.01):
            cur, cur_ms = cand, ms
            if ms < best_ms:
                best, best_ms = [list(l) for l in cand], ms
    return best, best_ms


def floats(text):
    return [float(v) for v in text.split(",")]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kinds", default="simple,interleaved,1f1b")
    p.add_argument("--path", default="0,1,0")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--window", type=int, default=4, help="config active_microbatches")
    p.add_argument("--forward", default="1.75,1.85,0.09", help="ms per hop")
    p.add_argument("--backward", default="3.45,3.45,0.17", help="ms per hop")
    p.add_argument("--delay", type=float, default=0.08, help="ms from a send to the peer's action")
    p.add_argument("--iters", type=int, default=30000)
    p.add_argument("--last-hop-accumulates", action="store_true")
    p.add_argument("--show", action="store_true", help="print the best lists found")
    args = p.parse_args()
    path = [int(v) for v in args.path.split(",")]
    out = {"tool": "plan_costs", "path": path, "microbatches": args.microbatches,
           "forward_ms": floats(args.forward), "backward_ms": floats(args.backward),
           "delay_ms": args.delay, "executed_ms": {}, "best_found_ms": {}}
    for kind in args.kinds.split(","):
        plan = _C.Plan.executed(kind, args.microbatches, max(path) + 1, args.window, path,
                                args.last_hop_accumulates)
        model = Model(path, args.microbatches, plan.window(), floats(args.forward),
                      floats(args.backward), args.delay, simple=kind == "simple",
                      last_hop_accumulates=args.last_hop_accumulates)
        lists = model.lists(plan)
        best, best_ms = search(model, lists, args.iters)
        if args.show:
            for r, lst in enumerate(best):
                print(kind, "pp", r, " ".join(f"{op}{mb}.h{h}" for op, mb, h in lst))
        out["executed_ms"][kind] = round(model.simulate(lists), 2)
        out["best_found_ms"][kind] = round(best_ms, 2)
    out["bound_ms"] = round(model.bound(), 2)  # the same for every kind: work and chains
    print(json.dumps(out))


if __name__ == "__main__":
    main()
