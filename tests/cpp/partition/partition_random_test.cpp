// make_plan on random trees against an independent re-derivation of the documented
// rules (units, cost model, never-called modules, containers) and against brute force
// over every contiguous split.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <random>

#include "partition/partition.h"
#include "tree_builder.h"

namespace smp::partition {
namespace {

using testing::TreeBuilder;

struct Case {
  std::vector<ModuleNode> nodes;
  Options opts;
};

// Splits `leaves` leaves under builder node `id`, up to depth 3; returns nothing.
void grow(std::mt19937& rng, TreeBuilder& b, int id, int depth, int leaves, int* count) {
  std::uniform_int_distribution<int> pct(0, 99);
  if (leaves == 1 || depth == 3) {
    b.node(id).param_bytes = pct(rng) < 10 ? 0 : 1000 * (1 + pct(rng));
    return;
  }
  if (depth > 0 && pct(rng) < 20) b.node(id).param_bytes = 1000 * (1 + pct(rng) % 30);
  const int k = std::uniform_int_distribution<int>(1, std::min(3, leaves))(rng);
  std::vector<int> share(k, 1);
  for (int r = leaves - k; r > 0; --r) ++share[std::uniform_int_distribution<int>(0, k - 1)(rng)];
  for (int c = 0; c < k; ++c) {
    const int child = b.add(id, "m" + std::to_string(c), 0, 1000 * (pct(rng) % 50));
    ++*count;
    grow(rng, b, child, depth + 1, share[c], count);
  }
}

// A forward: sometimes shuffled siblings, skipped subtrees (never called), reuse.
void run(std::mt19937& rng, TreeBuilder& b, const std::vector<std::vector<int>>& kids, int id) {
  std::uniform_int_distribution<int> pct(0, 99);
  b.call(id);
  std::vector<int> order = kids[id];
  if (pct(rng) < 30) std::shuffle(order.begin(), order.end(), rng);
  for (int c : order) {
    if (pct(rng) < 10) continue;
    run(rng, b, kids, c);
    if (pct(rng) < 10) b.call(c);
  }
}

Case random_case(std::mt19937& rng) {
  std::uniform_int_distribution<int> pct(0, 99);
  TreeBuilder b;
  int count = 1;
  if (pct(rng) < 30) b.node(0).param_bytes = 1000 * (pct(rng) % 20);
  grow(rng, b, 0, 0, std::uniform_int_distribution<int>(2, 10)(rng), &count);
  // Children per builder id, recovered from the names (builder ids are add order).
  std::vector<std::vector<int>> kids(count);
  std::map<std::string, int> id_of;
  for (int i = 0; i < count; ++i) {
    const std::string& name = b.node(i).name;
    id_of[name] = i;
    if (i == 0) continue;
    const size_t dot = name.rfind('.');
    kids[dot == std::string::npos ? 0 : id_of[name.substr(0, dot)]].push_back(i);
  }
  if (pct(rng) < 90) run(rng, b, kids, 0);  // else untraced
  const bool timed = pct(rng) < 50, mem = pct(rng) < 30;
  for (int i = 0; i < count; ++i) {
    ModuleNode& n = b.node(i);
    if (n.calls == 0) continue;
    if (timed) n.time_ms = 0.01 * (pct(rng) + 1);
    if (mem) n.mem_bytes = 1000 * pct(rng);
  }
  Case c;
  c.nodes = b.build();
  c.opts.partitions = std::uniform_int_distribution<int>(1, 4)(rng);
  const double weights[] = {0.0, 0.2, 0.5, 0.8, 1.0};
  c.opts.memory_weight = weights[pct(rng) % 5];
  return c;
}

// Independent re-derivation of the documented rules (docs/partitioning.md).
struct Reference {
  std::vector<int> unit, order, host, depth;
  std::vector<double> cost;  // per node, as Plan::node_cost
};

Reference derive(const std::vector<ModuleNode>& nodes, double w) {
  const int n = static_cast<int>(nodes.size());
  Reference r;
  std::vector<int> nkids(n, 0);
  r.depth.assign(n, 0);
  for (int i = 1; i < n; ++i) {
    ++nkids[nodes[i].parent];
    r.depth[i] = r.depth[nodes[i].parent] + 1;
  }
  r.unit.assign(n, -1);
  std::vector<int> units;
  for (int i = 0; i < n; ++i) {
    if (i > 0 && r.unit[nodes[i].parent] >= 0) {
      r.unit[i] = r.unit[nodes[i].parent];
    } else if (nkids[i] == 0 || (i > 0 && nodes[i].param_bytes > 0)) {
      r.unit[i] = i;
      units.push_back(i);
    }
  }
  bool traced = false;
  for (const auto& m : nodes) traced = traced || m.first_call >= 0;
  std::map<int, int> first;  // unit -> first call in its subtree
  for (int i = 0; i < n; ++i) {
    if (r.unit[i] < 0) continue;
    const int f = traced ? nodes[i].first_call : (r.unit[i] == i ? i : -1);
    if (f >= 0 && (!first.count(r.unit[i]) || f < first[r.unit[i]])) first[r.unit[i]] = f;
  }
  for (int u : units) {
    if (first.count(u)) r.order.push_back(u);
  }
  std::sort(r.order.begin(), r.order.end(), [&](int a, int b) {
    return std::make_pair(first[a], a) < std::make_pair(first[b], b);
  });
  r.host.assign(n, -1);
  int last = -1;
  for (int u : units) {
    if (first.count(u)) last = u;
    r.host[u] = last >= 0 ? last : (r.order.empty() ? -1 : r.order[0]);
  }
  // Cost targets: unit, root, or a container's first called unit (else first unit).
  auto in_subtree = [&](int x, int c) {
    for (; x >= 0; x = nodes[x].parent) {
      if (x == c) return true;
    }
    return false;
  };
  std::vector<int> target(n, 0);
  for (int i = 1; i < n; ++i) {
    if (r.unit[i] >= 0) {
      target[i] = r.unit[i];
      continue;
    }
    target[i] = -1;
    for (int u : r.order) {
      if (in_subtree(u, i)) {
        target[i] = u;
        break;
      }
    }
    for (int u : units) {
      if (target[i] < 0 && in_subtree(u, i)) target[i] = u;
    }
  }
  bool timed = traced, measured = traced;
  for (const auto& m : nodes) {
    if (m.calls > 0 && m.time_ms < 0) timed = false;
    if (m.calls > 0 && m.mem_bytes < 0) measured = false;
  }
  std::vector<double> mem(n, 0), comp(n, 0);
  double mt = 0, ct = 0;
  for (int i = 0; i < n; ++i) {
    const auto& m = nodes[i];
    const double acts = r.unit[i] >= 0 ? double(m.activation_bytes) : 0.0;
    const double mi =
        2.0 * double(m.param_bytes) + (measured ? double(std::max<int64_t>(m.mem_bytes, 0)) : acts);
    const double ci =
        timed ? std::max(m.time_ms, 0.0) : double(m.param_bytes) * (traced ? m.calls : 1) + acts;
    mem[target[i]] += mi;
    comp[target[i]] += ci;
    mt += mi;
    ct += ci;
  }
  r.cost.assign(n, 0);
  for (int i = 0; i < n; ++i) {
    const bool called = r.unit[i] == i && first.count(i);
    const double uni = r.order.empty() ? 0 : 1.0 / r.order.size();
    r.cost[i] = w * (mt > 0 ? mem[i] / mt : (called ? uni : 0)) +
                (1 - w) * (ct > 0 ? comp[i] / ct : (called ? uni : 0));
  }
  return r;
}

int lca_depth(const std::vector<ModuleNode>& nodes, const std::vector<int>& depth, int a, int b) {
  while (a != b) {
    if (depth[a] >= depth[b])
      a = nodes[a].parent;
    else
      b = nodes[b].parent;
  }
  return depth[a];
}

// Every split of `weight` into s non-empty runs: (bottleneck, cut-penalty sum).
void enumerate(const std::vector<double>& weight, const std::vector<int>& pen, int s,
               const std::function<void(double, int)>& visit) {
  const int m = static_cast<int>(weight.size());
  std::vector<int> cuts;
  std::function<void(int)> rec = [&](int from) {
    if (static_cast<int>(cuts.size()) == s - 1) {
      double worst = 0;
      int p = 0;
      int start = 0;
      for (int k = 0; k <= s - 1; ++k) {
        const int end = k < s - 1 ? cuts[k] : m;
        double sum = 0;
        for (int t = start; t < end; ++t) sum += weight[t];
        worst = std::max(worst, sum);
        if (k > 0) p += pen[start];
        start = end;
      }
      visit(worst, p);
      return;
    }
    for (int c = from; c <= m - (s - 1 - static_cast<int>(cuts.size())); ++c) {
      cuts.push_back(c);
      rec(c + 1);
      cuts.pop_back();
    }
  };
  rec(1);
}

TEST(PartitionRandom, OptimalAndFollowsTheRulesOn600RandomTrees) {
  std::mt19937 rng(20240601);
  int planned = 0, refused = 0, multi = 0, glued = 0, deep_cut = 0;
  for (int trial = 0; trial < 600; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const Case c = random_case(rng);
    const auto& nodes = c.nodes;
    const int s = c.opts.partitions;
    const Reference ref = derive(nodes, c.opts.memory_weight);
    const int m = static_cast<int>(ref.order.size());
    if (m == 0 && s == 1) {  // nothing but the root ran: everything on partition 0
      EXPECT_EQ(make_plan(nodes, c.opts).assignment, std::vector<int>(nodes.size(), 0));
      continue;
    }
    if (m < s) {
      ++refused;
      EXPECT_THROW(make_plan(nodes, c.opts), PartitionError);
      continue;
    }
    ++planned;
    const Plan plan = make_plan(nodes, c.opts);
    multi += s > 1;
    for (size_t u = 0; u < nodes.size(); ++u) {
      glued += ref.unit[u] == static_cast<int>(u) && ref.host[u] != static_cast<int>(u);
    }
    for (int d : plan.cut_depth) deep_cut += d > 1;
    ASSERT_EQ(plan.unit, ref.unit);
    ASSERT_EQ(plan.unit_order, ref.order);
    for (size_t i = 0; i < nodes.size(); ++i)
      ASSERT_NEAR(plan.node_cost[i], ref.cost[i], 1e-12) << i;

    // Contiguous, in order, every stage non-empty.
    std::vector<double> weight(m, 0);
    std::vector<int> pen(m, 0);
    for (int k = 0; k < m; ++k) {
      const int st = plan.assignment[ref.order[k]];
      const int prev = k == 0 ? 0 : plan.assignment[ref.order[k - 1]];
      ASSERT_TRUE(st == prev || st == prev + 1)
          << "unit " << k << " on " << st << " after " << prev;
      if (k > 0) pen[k] = lca_depth(nodes, ref.depth, ref.order[k - 1], ref.order[k]);
    }
    ASSERT_EQ(plan.assignment[ref.order[m - 1]], s - 1);
    for (size_t u = 0; u < nodes.size(); ++u) {
      if (ref.unit[u] != static_cast<int>(u)) continue;
      const auto at = std::find(ref.order.begin(), ref.order.end(), ref.host[u]);
      weight[at - ref.order.begin()] += ref.cost[u];
    }
    if (ref.unit[0] < 0) weight[0] += ref.cost[0];

    // Optimal bottleneck; among optimal splits, the smallest cut-depth sum.
    double best = 1e300;
    enumerate(weight, pen, s, [&](double worst, int) { best = std::min(best, worst); });
    int best_pen = 1 << 30;
    enumerate(weight, pen, s, [&](double worst, int p) {
      if (worst <= best + 1e-9) best_pen = std::min(best_pen, p);
    });
    EXPECT_NEAR(testing::max_stage_cost(plan), best, 1e-9);
    int plan_pen = 0;
    for (int d : plan.cut_depth) plan_pen += d;
    EXPECT_EQ(plan_pen, best_pen);

    // Units' members, never-called units, containers, root.
    const int n = static_cast<int>(nodes.size());
    for (int i = 0; i < n; ++i) {
      if (ref.unit[i] >= 0) {
        EXPECT_EQ(plan.assignment[i], plan.assignment[ref.host[ref.unit[i]]]) << nodes[i].name;
      }
    }
    std::vector<int> lo(n, 1 << 30), hi(n, -1);
    for (int i = n - 1; i >= 0; --i) {
      if (ref.unit[i] >= 0) lo[i] = hi[i] = plan.assignment[i];
      if (i > 0) {
        lo[nodes[i].parent] = std::min(lo[nodes[i].parent], lo[i]);
        hi[nodes[i].parent] = std::max(hi[nodes[i].parent], hi[i]);
      }
    }
    EXPECT_EQ(plan.assignment[0], 0);
    for (int i = 1; i < n; ++i) {
      if (ref.unit[i] >= 0) continue;
      EXPECT_EQ(plan.assignment[i], lo[i] == hi[i] ? lo[i] : plan.assignment[nodes[i].parent])
          << nodes[i].name;
    }
    double total = 0;
    for (double x : plan.stage_cost) total += x;
    EXPECT_NEAR(total, 1.0, 1e-9);

    // Bit-for-bit deterministic.
    const Plan again = make_plan(nodes, c.opts);
    EXPECT_EQ(again.assignment, plan.assignment);
    EXPECT_EQ(again.node_cost, plan.node_cost);
    EXPECT_EQ(again.stage_cost, plan.stage_cost);
    EXPECT_EQ(again.hash, plan.hash);
  }
  // The generator covers what it should: multi-stage plans, never-called units, cuts
  // inside nested modules, and trees too small for their partitions.
  EXPECT_GT(planned, 300);
  EXPECT_GT(multi, 200);
  EXPECT_GT(glued, 20);
  EXPECT_GT(deep_cut, 20);
  EXPECT_GT(refused, 5);
  std::printf("planned %d (multi-stage %d), refused %d, never-called units %d, deep cuts %d\n",
              planned, multi, refused, glued, deep_cut);
}

TEST(PartitionRandom, HashIgnoresRegistrationOrderOfSiblings) {
  // The same model with siblings registered in a different order (a different
  // pre-order, same execution order) gets the same name -> partition map and hash.
  auto build = [](bool reversed) {
    TreeBuilder b;
    std::vector<int> ids(6);
    for (int k = 0; k < 6; ++k) {
      const int j = reversed ? 5 - k : k;
      ids[j] = b.add(0, "l" + std::to_string(j), (j + 1) * testing::kMiB);
    }
    b.call(0);
    for (int id : ids) b.call(id);
    return b.build();
  };
  const auto fwd = build(false), rev = build(true);
  Options o;
  o.partitions = 3;
  const Plan a = make_plan(fwd, o), b = make_plan(rev, o);
  for (const auto& n : fwd) EXPECT_EQ(testing::part(a, fwd, n.name), testing::part(b, rev, n.name));
  EXPECT_EQ(a.hash, b.hash);
  EXPECT_NE(a.assignment, b.assignment);  // the vectors are indexed differently
  o.partitions = 2;
  EXPECT_NE(make_plan(fwd, o).hash, a.hash);
}

TEST(PartitionRandom, LargeModelPlansQuickly) {
  // 96 blocks x 10 leaves plus a dominant head: wide tie windows for the tie-break DP.
  TreeBuilder b;
  b.add(0, "embed", 50 * testing::kMiB);
  const int layers = b.add(0, "layers");
  for (int k = 0; k < 96; ++k) {
    const int blk = b.add(layers, std::to_string(k));
    for (int j = 0; j < 10; ++j)
      b.add(blk, "m" + std::to_string(j), (1 + (k * 7 + j) % 5) * testing::kMiB);
  }
  b.add(0, "head", 4000 * testing::kMiB);
  b.run(0);
  const auto nodes = b.build();
  for (int s : {2, 8, 16}) {
    Options o;
    o.partitions = s;
    o.memory_weight = 1.0;
    const Plan p = make_plan(nodes, o);
    EXPECT_EQ(p.assignment[testing::index_of(nodes, "head")], s - 1);
    for (int d : p.cut_depth) EXPECT_LE(d, 1) << "s=" << s;  // never inside a block
  }
}

}  // namespace
}  // namespace smp::partition
