// make_plan on hand-built trees with closed-form answers. Optimality against brute
// force lives in partition_random_test.cpp.
#include "partition/partition.h"

#include <gtest/gtest.h>

#include <map>

#include "tree_builder.h"

namespace smp::partition {
namespace {

using testing::index_of;
using testing::kMiB;
using testing::max_stage_cost;
using testing::part;
using testing::TreeBuilder;

Options opts(int partitions, double memory_weight = 0.2) {
  Options o;
  o.partitions = partitions;
  o.memory_weight = memory_weight;
  return o;
}

std::vector<int> leaf_parts(const Plan& plan, const std::vector<ModuleNode>& nodes) {
  std::vector<int> out;
  for (size_t i = 1; i < nodes.size(); ++i) out.push_back(plan.assignment[i]);
  return out;
}

std::string error_of(const std::vector<ModuleNode>& nodes, const Options& o) {
  try {
    make_plan(nodes, o);
  } catch (const PartitionError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Partition, EqualLeavesSplitEvenly) {
  const auto nodes = testing::sequential(std::vector<int64_t>(8, kMiB));
  const Plan p4 = make_plan(nodes, opts(4));
  EXPECT_EQ(leaf_parts(p4, nodes), (std::vector<int>{0, 0, 1, 1, 2, 2, 3, 3}));
  EXPECT_EQ(p4.assignment[0], 0);
  EXPECT_EQ(p4.cut_depth, (std::vector<int>{0, 0, 0}));
  for (double c : p4.stage_cost) EXPECT_NEAR(c, 0.25, 1e-12);
  EXPECT_EQ(p4.stage_param_bytes, (std::vector<int64_t>(4, 2 * kMiB)));

  // 8 into 3: bottleneck 3 leaves; leftover work goes to later stages.
  const Plan p3 = make_plan(nodes, opts(3));
  EXPECT_EQ(leaf_parts(p3, nodes), (std::vector<int>{0, 0, 1, 1, 1, 2, 2, 2}));

  const Plan p1 = make_plan(nodes, opts(1));
  EXPECT_EQ(p1.assignment, std::vector<int>(9, 0));
  EXPECT_TRUE(p1.cut_depth.empty());
}

TEST(Partition, MemoryFactorsWeighParametersAgainstActivations) {
  // An embedding-like layer (many parameters, small output) and three layers with few
  // parameters and large outputs, balanced by memory alone. Counting the weight and
  // its gradient only (the default factor 2: stages of 11.5 and 9 MiB), the embedding
  // shares a stage; with Adam's two states per parameter (factor 4: 13 and 15 MiB) it
  // is worth a stage of its own. Sharding the optimizer state over 4 dp ranks (factor
  // 2.5) brings the first split back; weighing activations less moves it again.
  TreeBuilder b;
  b.add(0, "emb", 3 * kMiB, 1 * kMiB);
  b.add(0, "l1", kMiB / 4, 4 * kMiB);
  b.add(0, "l2", kMiB / 4, 4 * kMiB);
  b.add(0, "l3", kMiB / 4, 4 * kMiB);
  for (int i = 1; i <= 4; ++i) b.run(i);
  const auto nodes = b.build();
  Options o = opts(2, 1.0);
  const Plan two = make_plan(nodes, o);
  EXPECT_EQ(leaf_parts(two, nodes), (std::vector<int>{0, 0, 1, 1}));
  o.param_memory_factor = 4.0;
  const Plan four = make_plan(nodes, o);
  EXPECT_EQ(leaf_parts(four, nodes), (std::vector<int>{0, 1, 1, 1}));
  // The per-stage estimate follows the factors.
  EXPECT_NEAR(four.stage_memory_bytes[0], 4.0 * 3 * kMiB + 1.0 * kMiB, 1.0);
  EXPECT_NEAR(four.stage_memory_bytes[1], 3 * (4.0 * kMiB / 4 + 4.0 * kMiB), 1.0);
  EXPECT_NEAR(two.stage_memory_bytes[0], 2.0 * (3 * kMiB + kMiB / 4) + 5.0 * kMiB, 1.0);
  o.param_memory_factor = 2.5;
  EXPECT_EQ(leaf_parts(make_plan(nodes, o), nodes), (std::vector<int>{0, 0, 1, 1}));
  o.activation_memory_factor = 0.25;  // activations matter less: the embedding alone
  EXPECT_EQ(leaf_parts(make_plan(nodes, o), nodes), (std::vector<int>{0, 1, 1, 1}));
  o.param_memory_factor = 0.0;
  EXPECT_NE(error_of(nodes, o).find("'param_memory_factor'=0 is not allowed"), std::string::npos)
      << error_of(nodes, o);
}

TEST(Partition, UnequalLeavesMinimizeBottleneck) {
  std::vector<int64_t> params;
  for (int k = 1; k <= 9; ++k) params.push_back(k * kMiB);
  const auto nodes = testing::sequential(params);
  const Plan p = make_plan(nodes, opts(3, 1.0));
  // 1..9 into 3: {1..5}=15, {6,7}=13, {8,9}=17 is the unique split with bottleneck 17.
  EXPECT_EQ(leaf_parts(p, nodes), (std::vector<int>{0, 0, 0, 0, 0, 1, 1, 2, 2}));
  EXPECT_NEAR(max_stage_cost(p), 17.0 / 45.0, 1e-12);
}

TEST(Partition, CostModelClosedForm) {
  TreeBuilder b;
  b.add(0, "a", kMiB, 0);
  b.add(0, "b", 0, 2 * kMiB);
  b.run(0);
  const auto nodes = b.build();
  const Plan p = make_plan(nodes, opts(1, 0.2));
  // memory = 2 * params + activations: a 2, b 2; compute = params * calls + activations: a 1, b 2.
  EXPECT_NEAR(p.node_cost[index_of(nodes, "a")], 0.2 * 0.5 + 0.8 / 3.0, 1e-12);
  EXPECT_NEAR(p.node_cost[index_of(nodes, "b")], 0.2 * 0.5 + 0.8 * 2.0 / 3.0, 1e-12);
  EXPECT_EQ(p.node_cost[0], 0.0);
}

TEST(Partition, TransformerCutsBetweenBlocksAndCollapsesContainers) {
  const auto nodes = testing::transformer(4, 6 * kMiB, 6 * kMiB);
  const Plan p = make_plan(nodes, opts(2, 1.0));
  EXPECT_EQ(p.cut_depth, (std::vector<int>{1}));  // between layers.1 and layers.2
  for (const char* name : {"embed", "layers.0", "layers.0.attn", "layers.1.ln"}) {
    EXPECT_EQ(part(p, nodes, name), 0) << name;
  }
  for (const char* name : {"layers.2", "layers.3.mlp", "head"}) {
    EXPECT_EQ(part(p, nodes, name), 1) << name;
  }
  EXPECT_EQ(part(p, nodes, "layers"), 0);  // spans both: stays with the root
  EXPECT_EQ(p.assignment[0], 0);
  EXPECT_NEAR(p.stage_cost[0], p.stage_cost[1], 1e-12);
  EXPECT_EQ(p.unit[index_of(nodes, "layers")], -1);
  EXPECT_EQ(p.unit_order.size(), 14u);
}

TEST(Partition, TiesPreferTopLevelCuts) {
  // The head alone is the bottleneck, so embed/blocks may be cut anywhere: the
  // shallowest cut (embed | layers, depth 0) wins over cuts between blocks.
  const auto nodes = testing::transformer(4, 6 * kMiB, 100 * kMiB);
  const Plan p = make_plan(nodes, opts(3, 1.0));
  EXPECT_EQ(p.cut_depth, (std::vector<int>{0, 0}));
  EXPECT_EQ(part(p, nodes, "embed"), 0);
  EXPECT_EQ(part(p, nodes, "layers"), 1);  // all its units on 1: one remote call
  EXPECT_EQ(part(p, nodes, "layers.3.ln"), 1);
  EXPECT_EQ(part(p, nodes, "head"), 2);
}

TEST(Partition, BalanceSlackMovesCutOutOfBlock) {
  const auto nodes = testing::transformer(4, 20 * kMiB, 2 * kMiB);
  const Plan exact = make_plan(nodes, opts(2, 1.0));
  EXPECT_EQ(exact.cut_depth, (std::vector<int>{2}));  // after layers.1.attn
  EXPECT_EQ(part(exact, nodes, "layers.1.attn"), 0);
  EXPECT_EQ(part(exact, nodes, "layers.1.mlp"), 1);
  EXPECT_EQ(part(exact, nodes, "layers.1"), 0);  // spans: with its parent

  Options o = opts(2, 1.0);
  o.balance_slack = 0.1;
  const Plan slack = make_plan(nodes, o);
  EXPECT_EQ(slack.cut_depth, (std::vector<int>{1}));  // after layers.0
  EXPECT_EQ(part(slack, nodes, "layers.0"), 0);
  EXPECT_EQ(part(slack, nodes, "layers.1"), 1);
  EXPECT_GT(max_stage_cost(slack), max_stage_cost(exact));
  EXPECT_LE(max_stage_cost(slack), 1.1 * max_stage_cost(exact) + 1e-12);
}

TEST(Partition, ContainerPlacement) {
  TreeBuilder b;
  const int x = b.add(0, "x", 2 * kMiB);
  const int a = b.add(0, "A");
  const int bb = b.add(a, "B");
  b.add(bb, "b1", kMiB);
  b.add(bb, "b2", kMiB);
  b.add(a, "a3", kMiB);
  b.run(0);
  (void)x;
  const auto nodes = b.build();
  // [x | b1 b2 a3]: A and B hold only partition-1 units, so they go to 1.
  const Plan p = make_plan(nodes, opts(2, 1.0));
  EXPECT_EQ(part(p, nodes, "x"), 0);
  EXPECT_EQ(part(p, nodes, "A"), 1);
  EXPECT_EQ(part(p, nodes, "A.B"), 1);
  // One stage per unit: B spans 1..2 and A spans 1..3, so both stay with the root.
  const Plan p4 = make_plan(nodes, opts(4, 1.0));
  EXPECT_EQ(leaf_parts(p4, nodes), (std::vector<int>{0, 0, 0, 1, 2, 3}));
  EXPECT_EQ(p4.cut_depth, (std::vector<int>{0, 2, 1}));
}

TEST(Partition, ModuleOwningParamsIsOneUnit) {
  TreeBuilder b;
  const int blk = b.add(0, "blk", kMiB);
  b.add(blk, "x", 4 * kMiB);
  b.add(blk, "y", 4 * kMiB);
  b.add(0, "z", 9 * kMiB);
  b.run(0);
  const auto nodes = b.build();
  const Plan p = make_plan(nodes, opts(2, 1.0));
  EXPECT_EQ(leaf_parts(p, nodes), (std::vector<int>{0, 0, 0, 1}));
  EXPECT_EQ(p.unit[index_of(nodes, "blk.x")], index_of(nodes, "blk"));
  EXPECT_NEAR(p.node_cost[index_of(nodes, "blk")], 0.5, 1e-12);
  EXPECT_EQ(p.node_cost[index_of(nodes, "blk.x")], 0.0);
  EXPECT_EQ(error_of(nodes, opts(3)),
            "smp: partition: 3 stages but only 2 partitionable modules (2 < 3)");
}

TEST(Partition, RootOwnParamsStayOnPartitionZero) {
  TreeBuilder b;
  b.node(0).param_bytes = 10 * kMiB;
  for (const char* n : {"a", "b", "c"}) b.add(0, n, 10 * kMiB);
  b.run(0);
  const auto nodes = b.build();
  const Plan p = make_plan(nodes, opts(2, 1.0));
  EXPECT_EQ(p.unit[0], -1);
  EXPECT_NEAR(p.node_cost[0], 0.25, 1e-12);
  EXPECT_EQ(leaf_parts(p, nodes), (std::vector<int>{0, 1, 1}));  // root + a | b + c
  EXPECT_NEAR(p.stage_cost[0], 0.5, 1e-12);
  EXPECT_EQ(p.stage_param_bytes[0], 20 * kMiB);
  // A model that is a single leaf has one unit.
  TreeBuilder leaf;
  leaf.node(0).param_bytes = kMiB;
  leaf.run(0);
  EXPECT_EQ(make_plan(leaf.build(), opts(1)).unit_order, (std::vector<int>{0}));
  EXPECT_EQ(error_of(leaf.build(), opts(2)),
            "smp: partition: 2 stages but only 1 partitionable modules (1 < 2)");
}

TEST(Partition, MemoryWeightPicksWhatToBalance) {
  TreeBuilder b;
  const std::vector<int64_t> params = {100 * kMiB, kMiB, kMiB, kMiB};
  const std::vector<double> ms = {1, 10, 10, 10};
  for (int k = 0; k < 4; ++k)
    b.node(b.add(0, std::string(1, char('a' + k)), params[k])).time_ms = ms[k];
  b.node(0).time_ms = 0;
  b.run(0);
  const auto nodes = b.build();
  EXPECT_EQ(leaf_parts(make_plan(nodes, opts(2, 1.0)), nodes), (std::vector<int>{0, 1, 1, 1}));
  EXPECT_EQ(leaf_parts(make_plan(nodes, opts(2, 0.0)), nodes), (std::vector<int>{0, 0, 1, 1}));
  // Measured times replace the size estimate: a costs 1/31 of compute, not 100/103.
  EXPECT_NEAR(make_plan(nodes, opts(1, 0.0)).node_cost[1], 1.0 / 31.0, 1e-12);
}

TEST(Partition, MeasuredMemoryReplacesActivationEstimate) {
  TreeBuilder b;
  b.node(b.add(0, "a", 0, 50 * kMiB)).mem_bytes = 3 * kMiB;
  b.node(b.add(0, "b", 0, 50 * kMiB)).mem_bytes = kMiB;
  b.node(0).mem_bytes = 0;
  b.run(0);
  const Plan p = make_plan(b.build(), opts(1, 1.0));
  EXPECT_NEAR(p.node_cost[1], 0.75, 1e-12);
  EXPECT_NEAR(p.node_cost[2], 0.25, 1e-12);
}

TEST(Partition, ReusedModuleCountsEveryCall) {
  TreeBuilder b;
  std::vector<int> ids;
  for (const char* n : {"a", "b", "c", "d"}) ids.push_back(b.add(0, n, kMiB));
  b.run(0);
  TreeBuilder once = b;
  const Plan p1 = make_plan(once.build(), opts(2, 0.0));
  EXPECT_EQ(leaf_parts(p1, once.build()), (std::vector<int>{0, 0, 1, 1}));
  b.call(ids[3]).call(ids[3]);  // d runs three times
  const auto nodes = b.build();
  EXPECT_EQ(nodes[index_of(nodes, "d")].calls, 3);
  const Plan p3 = make_plan(nodes, opts(2, 0.0));
  EXPECT_EQ(leaf_parts(p3, nodes), (std::vector<int>{0, 0, 0, 1}));
}

TEST(Partition, ExecutionOrderNotRegistrationOrder) {
  TreeBuilder b;
  const int head = b.add(0, "head", kMiB);
  const int embed = b.add(0, "embed", kMiB);
  const int body = b.add(0, "body", kMiB);
  b.call(0).call(embed).call(body).call(head);
  const auto nodes = b.build();
  const Plan p = make_plan(nodes, opts(3));
  EXPECT_EQ(part(p, nodes, "embed"), 0);
  EXPECT_EQ(part(p, nodes, "body"), 1);
  EXPECT_EQ(part(p, nodes, "head"), 2);
  EXPECT_EQ(p.unit_order, (std::vector<int>{index_of(nodes, "embed"), index_of(nodes, "body"),
                                            index_of(nodes, "head")}));
}

TEST(Partition, NeverCalledModulesRideWithPredecessor) {
  TreeBuilder b;
  std::vector<int> ids;
  for (const char* n : {"a", "b", "c", "d"}) ids.push_back(b.add(0, n, kMiB));
  b.call(0).call(ids[0]).call(ids[2]).call(ids[3]);  // b never runs
  const auto nodes = b.build();
  const Plan p = make_plan(nodes, opts(2, 1.0));
  EXPECT_EQ(leaf_parts(p, nodes), (std::vector<int>{0, 0, 1, 1}));  // a+b | c d
  EXPECT_EQ(p.unit_order.size(), 3u);
  EXPECT_NEAR(p.stage_cost[0], 0.5, 1e-12);
  EXPECT_EQ(error_of(nodes, opts(4)),
            "smp: partition: 4 stages but only 3 partitionable modules (3 < 4)");

  // A never-called first module rides with the first unit that runs.
  TreeBuilder f;
  std::vector<int> fid;
  for (const char* n : {"unused", "x", "y"}) fid.push_back(f.add(0, n, kMiB));
  f.call(0).call(fid[2]).call(fid[1]);
  const auto fn = f.build();
  const Plan fp = make_plan(fn, opts(2, 1.0));
  EXPECT_EQ(part(fp, fn, "unused"), part(fp, fn, "y"));
  EXPECT_EQ(part(fp, fn, "y"), 0);

  // Only the root ran: nothing to split, but one partition still works.
  TreeBuilder r;
  r.add(0, "idle", kMiB);
  r.call(0);
  EXPECT_EQ(make_plan(r.build(), opts(1)).assignment, (std::vector<int>{0, 0}));
  EXPECT_EQ(error_of(r.build(), opts(2)),
            "smp: partition: 2 stages but only 0 partitionable modules (0 < 2)");
}

TEST(Partition, UntracedTreeUsesRegistrationOrder) {
  TreeBuilder b;
  for (const char* n : {"a", "b", "c", "d"}) b.add(0, n, kMiB);
  const auto nodes = b.build();  // nothing called: skip_tracing
  const Plan p = make_plan(nodes, opts(2));
  EXPECT_EQ(leaf_parts(p, nodes), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(p.unit_order, (std::vector<int>{1, 2, 3, 4}));
}

std::vector<ModuleNode> manual_tree() {
  TreeBuilder b;
  b.node(b.add(0, "a", kMiB)).manual_partition = 1;
  b.add(0, "b", kMiB);
  b.node(b.add(0, "c", kMiB)).manual_partition = 0;
  const int d = b.add(0, "d");
  b.node(b.add(d, "x", kMiB)).manual_partition = 1;
  b.add(d, "y", kMiB);
  b.run(0);
  return b.build();
}

TEST(Partition, ManualPlacementHonouredWithoutAutoPartition) {
  const auto nodes = manual_tree();
  Options o = opts(3);
  o.auto_partition = false;
  o.default_partition = 2;
  const Plan p = make_plan(nodes, o);
  std::map<std::string, int> got;
  for (size_t i = 0; i < nodes.size(); ++i) got[nodes[i].name] = p.assignment[i];
  const std::map<std::string, int> want = {{"", 0},  {"a", 1},   {"b", 2},  {"c", 0},
                                           {"d", 2}, {"d.x", 1}, {"d.y", 2}};
  EXPECT_EQ(got, want);
  EXPECT_TRUE(p.cut_depth.empty());
  EXPECT_EQ(p.stage_param_bytes, (std::vector<int64_t>{kMiB, 2 * kMiB, 2 * kMiB}));

  o.default_partition = 0;
  EXPECT_EQ(part(make_plan(nodes, o), nodes, "b"), 0);
}

TEST(Partition, ManualPlacementIgnoredWithAutoPartition) {
  auto nodes = manual_tree();
  const Plan with = make_plan(nodes, opts(3));
  for (auto& n : nodes) n.manual_partition = -1;
  const Plan without = make_plan(nodes, opts(3));
  EXPECT_EQ(with.assignment, without.assignment);
  EXPECT_EQ(with.hash, without.hash);
  auto bad = manual_tree();
  bad[index_of(bad, "c")].manual_partition = 7;
  EXPECT_NO_THROW(make_plan(bad, opts(3)));  // contexts are ignored altogether
}

TEST(Partition, ManualPlacementErrors) {
  auto nodes = manual_tree();
  Options o = opts(3);
  o.auto_partition = false;
  nodes[index_of(nodes, "d.x")].manual_partition = 3;
  EXPECT_EQ(error_of(nodes, o),
            "smp: partition: module 'd.x' is placed in smp.partition(3) but partitions=3 "
            "(allowed 0..2)");
  o.default_partition = 3;
  EXPECT_EQ(error_of(manual_tree(), o),
            "smp: partition: 'default_partition'=3 is not a partition (allowed 0..2 with "
            "partitions=3)");
}

TEST(Partition, ErrorMessages) {
  const auto nine = testing::sequential(std::vector<int64_t>(9, kMiB));
  EXPECT_EQ(error_of(nine, opts(12)),
            "smp: partition: 12 stages but only 9 partitionable modules (9 < 12)");
  EXPECT_EQ(error_of({}, opts(1)), "smp: partition: empty module tree (no nodes)");
  EXPECT_EQ(error_of(nine, opts(0)),
            "smp: partition: 'partitions'=0 is not allowed (must be >= 1)");
  EXPECT_EQ(error_of(nine, opts(2, 1.5)), "smp: partition: 'memory_weight'=1.5 is not in [0, 1]");
  auto neg = nine;
  neg[3].param_bytes = -1;
  EXPECT_EQ(error_of(neg, opts(1)), "smp: partition: module '2' has param_bytes=-1 (must be >= 0)");
  neg = nine;
  neg[3].activation_bytes = -5;
  EXPECT_EQ(error_of(neg, opts(1)),
            "smp: partition: module '2' has activation_bytes=-5 (must be >= 0)");
  auto dup = nine;
  dup[2].name = "0";
  EXPECT_EQ(error_of(dup, opts(1)),
            "smp: partition: module name '0' appears twice (nodes 1 and 2); names must be "
            "unique dotted paths");
  auto order = nine;
  order[2].parent = 5;
  EXPECT_EQ(error_of(order, opts(1)),
            "smp: partition: module '1' (node 2) has parent 5; nodes must come in pre-order "
            "(0 <= parent < 2)");
  auto calls = nine;
  calls[1].calls = 0;
  EXPECT_EQ(error_of(calls, opts(1)),
            "smp: partition: module '0' has first_call=1 but calls=0 (a called module has "
            "first_call >= 0 and calls >= 1; a never-called one -1 and 0)");
  try {
    make_plan(nine, opts(12));
    FAIL() << "no error";
  } catch (const std::invalid_argument&) {
    SUCCEED();  // PartitionError is an std::invalid_argument (a ValueError in Python)
  }
}

TEST(Partition, TableAndUnitDescriptions) {
  const auto nodes = testing::transformer(2, 6 * kMiB, 6 * kMiB);
  const Plan p = make_plan(nodes, opts(2));
  const std::string t = p.table(nodes);
  EXPECT_NE(t.find("module"), std::string::npos);
  EXPECT_NE(t.find("(root)"), std::string::npos);
  EXPECT_NE(t.find("      layers.0.attn"), std::string::npos) << t;
  EXPECT_NE(t.find("container"), std::string::npos);
  EXPECT_NE(t.find("6.0 MiB"), std::string::npos);
  EXPECT_NE(t.find("modules  units"), std::string::npos) << t;
  const auto units = describe_units(testing::sequential({kMiB, 3 * kMiB / 2}));
  ASSERT_EQ(units.size(), 2u);
  EXPECT_EQ(units[0], "unit 0: 0 (1 module, first call 1, 1 call, params 1.0 MiB)");
  EXPECT_EQ(units[1], "unit 1: 1 (1 module, first call 2, 1 call, params 1.5 MiB)");
}

// Note [Blocks stay whole]: a part whose parent uses its tensors directly follows the
// parent, wherever the balance would have cut; its own parts follow it in turn.
TEST(Partition, FollowParentKeepsABlockWhole) {
  TreeBuilder b;
  const int block = b.add(0, "block");
  const int dense = b.add(block, "dense", kMiB);
  b.add(dense, "inner", kMiB);
  b.add(block, "norm", kMiB);
  b.add(0, "tail", kMiB);
  auto nodes = b.build();
  const Plan free_plan = make_plan(nodes, opts(2));
  EXPECT_NE(part(free_plan, nodes, "block.dense"), part(free_plan, nodes, "block.norm"));
  for (const char* n : {"block.dense", "block.dense.inner", "block.norm"})
    nodes[index_of(nodes, n)].follow_parent = true;
  const Plan p = make_plan(nodes, opts(2));
  const int where = part(p, nodes, "block");
  for (const char* n : {"block.dense", "block.dense.inner", "block.norm"})
    EXPECT_EQ(part(p, nodes, n), where) << n;
  EXPECT_NE(p.hash, free_plan.hash);
}

}  // namespace
}  // namespace smp::partition
