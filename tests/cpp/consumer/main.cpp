// The smallest smp C++ program: init (a world of 1, or the ranks smprun starts),
// print where this rank sits and the resolved config, talk to the other ranks, and
// show what a bad config does. Run by tests/python/test_install.py against an
// installed smp; lines are "key: value" so the test can read them.
//
//   smp_consumer [CONFIG_JSON]           # one process
//   smprun --nproc_per_node 2 --config '{"partitions":2}' smp_consumer
#include <smp/smp.h>

#include <iostream>
#include <string>

int main(int argc, char** argv) {
  try {
    smp::Config::from_json(R"({"pipeline": "gpipe"})");
    std::cout << "bad config accepted\n";
    return 1;
  } catch (const smp::ConfigError& e) {
    std::cout << "config_error: " << e.what() << "\n";
  }

  // Empty: SMP_CONFIG (set by smprun --config), else SM_HP_MP_PARAMETERS, else {}.
  smp::Runtime& rt = smp::init(argc > 1 ? argv[1] : "");
  const smp::Topology& topo = rt.topology();
  const int r = rt.rank();
  std::cout << "rank: " << r << " world=" << topo.world_size() << " pp_rank=" << rt.pp_rank()
            << " pp_size=" << topo.pp_size() << " dp_rank=" << rt.dp_rank()
            << " dp_size=" << topo.dp_size() << "\n";
  std::cout << "config: " << rt.config().to_json() << "\n";
  if (r == 0) std::cout << "topology: " << topo.describe() << "\n";

  // A collective on the world group and a ring of buffered store messages.
  const double t = rt.config().timeout_s;
  std::string ranks;
  for (const auto& s : smp::allgather_bytes(rt.groups().world, std::to_string(r), t, "allgather"))
    ranks += (ranks.empty() ? "" : ",") + s;
  std::cout << "allgather: " << ranks << "\n";
  const int n = topo.world_size();
  rt.mailbox().send((r + 1) % n, "hello from " + std::to_string(r));
  std::cout << "ring: " << rt.mailbox().recv((r + n - 1) % n) << "\n";

  // The partitioner links too: three equal layers over the configured stages.
  std::vector<smp::partition::ModuleNode> nodes(4);
  nodes[0].first_call = 0;
  nodes[0].calls = 1;
  for (int i = 1; i < 4; ++i) {
    nodes[i].name = "layer" + std::to_string(i);
    nodes[i].parent = 0;
    nodes[i].param_bytes = 1024;
    nodes[i].first_call = i;
    nodes[i].calls = 1;
  }
  smp::partition::Options opts;
  opts.partitions = topo.pp_size();
  smp::partition::Plan plan = smp::partition::make_plan(nodes, opts);
  std::cout << "plan:";
  for (int p : plan.assignment) std::cout << " " << p;
  std::cout << "\n";

  // The comm hooks' header came with smp.h, and their library links.
  std::cout << "builtin_hooks: " << smp::hooks::builtin_hook_names().size() << "\n";

  smp::barrier(rt.groups().world, t, "final barrier");
  smp::shutdown();
  return 0;
}
