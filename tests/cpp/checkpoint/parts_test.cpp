// smp::checkpoint::order_parts / read_parts (the merge tool's checks) on real sealed
// files: any order in, part order out; a missing part, a part given twice, parts of
// different saves or checkpoints, a full file and a damaged part are named.
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "checkpoint/parts.h"
#include "tests/cpp/checkpoint/temp_dir_test.h"

namespace fs = std::filesystem;
using namespace smp::checkpoint;

namespace {

class PartsTest : public test::TempDirTest {
 protected:

  // A sealed torch-format zip holding 1000 bytes of `fill`, as smp.save leaves it.
  std::string sealed(const std::string& name, uint64_t id, int part, int parts, char fill = 7) {
    const std::string tmp = (dir_ / (name + ".tmp")).string();
    {
      caffe2::serialize::PyTorchStreamWriter w(tmp);
      std::string pkl = "not really a pickle", data(1000, fill);
      w.writeRecord("data.pkl", pkl.data(), pkl.size());
      w.writeRecord("data/0", data.data(), data.size());
      w.writeEndOfFile();
    }
    Manifest m;
    m.save_id = id;
    m.save_time_ns = id;
    m.partial = parts > 0;
    m.part = part;
    m.parts = parts > 0 ? parts : 1;
    seal(tmp, m);
    const std::string path = (dir_ / name).string();
    publish(tmp, path, false);
    return path;
  }


};

TEST_F(PartsTest, AnyOrderInPartOrderOut) {
  const auto a0 = sealed("ck_0", 5, 0, 3), a1 = sealed("ck_1", 5, 1, 3), a2 = sealed("ck_2", 5, 2, 3);
  EXPECT_EQ(order_parts({a2, a0, a1}), (std::vector<std::string>{a0, a1, a2}));
  auto files = read_parts({a1, a2, a0});
  ASSERT_EQ(files.size(), 3u);
  for (int p = 0; p < 3; ++p) EXPECT_EQ(files[p].manifest.part, p);
}

TEST_F(PartsTest, CheckpointNameOfAPart) {
  EXPECT_EQ(checkpoint_name("/d/ck.pt_12"), "/d/ck.pt");
  EXPECT_EQ(checkpoint_name("/d/ck.pt_1.prev"), "/d/ck.pt");
  EXPECT_EQ(checkpoint_name("/d/ck.pt"), "/d/ck.pt");
  EXPECT_EQ(checkpoint_name("/d/ck_"), "/d/ck_");
  EXPECT_EQ(checkpoint_name("_3"), "_3");
}

TEST_F(PartsTest, FaultsAreNamed) {
  const auto a0 = sealed("ck_0", 5, 0, 3), a2 = sealed("ck_2", 5, 2, 3);
  std::string err = error_of([&] { order_parts({a0, a2}); });
  EXPECT_NE(err.find("missing part 1 ('" + (dir_ / "ck").string() + "_1')"), std::string::npos)
      << err;
  err = error_of([&] { order_parts({a0, a0}); });
  EXPECT_NE(err.find("given twice"), std::string::npos) << err;
  EXPECT_EQ(error_of([&] { order_parts({}); }), "smp: merge: no part files given");

  const auto b1 = sealed("other_1", 6, 1, 3);
  err = error_of([&] { order_parts({a0, b1}); });
  EXPECT_NE(err.find("parts of different checkpoints"), std::string::npos) << err;
  EXPECT_NE(err.find(b1), std::string::npos) << err;

  fs::create_directories(dir_ / "again");
  const auto c0 = sealed("again/ck_0", 7, 0, 2), c1 = sealed("again/ck_1", 8, 1, 2);
  err = error_of([&] { order_parts({c0, c1}); });
  EXPECT_NE(err.find("parts of different saves of '" + (dir_ / "again/ck").string() + "'"),
            std::string::npos) << err;

  const auto full = sealed("full.pt", 9, 0, 0);
  err = error_of([&] { order_parts({full}); });
  EXPECT_NE(err.find("'" + full + "' is a full checkpoint"), std::string::npos) << err;

  err = error_of([&] { order_parts({(dir_ / "absent_0").string()}); });
  EXPECT_NE(err.find("absent_0"), std::string::npos) << err;
}

TEST_F(PartsTest, DamagedPartFailsBeforeAnyIsReturned) {
  const auto a0 = sealed("ck_0", 5, 0, 2), a1 = sealed("ck_1", 5, 1, 2);
  {
    std::fstream f(a1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(300);
    char c;
    f.get(c);
    f.seekp(300);
    f.put(static_cast<char>(c ^ 0x10));
  }
  const std::string err = error_of([&] { read_parts({a0, a1}); });
  EXPECT_NE(err.find("'" + a1 + "'"), std::string::npos) << err;
  EXPECT_NE(err.find("checksum mismatch"), std::string::npos) << err;
}

}  // namespace
