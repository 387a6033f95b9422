// smp::checkpoint on real files in a temporary directory: seal + read round trip,
// torch's own reader still reads a sealed file, and every kind of damage is named.
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/checkpoint.h"
#include "tests/cpp/checkpoint/temp_dir_test.h"

namespace fs = std::filesystem;
using namespace smp::checkpoint;

namespace {

class CheckpointTest : public test::TempDirTest {
 protected:

  // A zip as torch.save writes it: records "data.pkl" and "data/0" (1000 bytes).
  std::string write_zip(const std::string& name, char fill = 7) {
    std::string path = (dir_ / name).string();
    caffe2::serialize::PyTorchStreamWriter w(path);
    std::string pkl = "not really a pickle";
    std::string data(1000, fill);
    w.writeRecord("data.pkl", pkl.data(), pkl.size());
    w.writeRecord("data/0", data.data(), data.size());
    w.writeEndOfFile();
    return path;
  }

  std::string sealed(const std::string& name, uint64_t id, int part = 0, int parts = 1,
                     uint64_t t = 1) {
    std::string tmp = write_zip(name + ".tmp");
    Manifest m;
    m.save_id = id;
    m.save_time_ns = t;
    m.partial = parts > 1 || part > 0;
    m.part = part;
    m.parts = parts;
    seal(tmp, m);
    std::string final_path = (dir_ / name).string();
    publish(tmp, final_path, true);
    return final_path;
  }

  static void flip_byte(const std::string& path, long off) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(off);
    char c;
    f.get(c);
    f.seekp(off);
    f.put(static_cast<char>(c ^ 0x10));
  }


};

TEST_F(CheckpointTest, SealedFileVerifiesAndTorchStillReadsIt) {
  std::string path = sealed("a.pt", 42);
  EXPECT_TRUE(has_manifest(path));
  VerifiedFile vf = read_verified(path);
  EXPECT_EQ(vf.manifest.save_id, 42u);
  bool found = false;
  for (auto& r : vf.records) {
    if (r.name.size() >= 6 && r.name.compare(r.name.size() - 6, 6, "data/0") == 0) {
      found = true;
      EXPECT_EQ(r.bytes.numel(), 1000);
      EXPECT_EQ(r.bytes.data_ptr<uint8_t>()[999], 7);
    }
  }
  EXPECT_TRUE(found);
  caffe2::serialize::PyTorchStreamReader reader(path);  // torch's reader: comment tolerated
  EXPECT_TRUE(reader.hasRecord("data/0"));
}

TEST_F(CheckpointTest, FlippedByteAnywhereIsNamed) {
  std::string path = sealed("b.pt", 1);
  const auto size = static_cast<long>(fs::file_size(path));
  for (long off : {10L, 200L, 700L, size / 2, size - 40, size - 3}) {
    fs::copy_file(path, path + ".x", fs::copy_options::overwrite_existing);
    flip_byte(path + ".x", off);
    std::string err = error_of([&] { read_verified(path + ".x"); });
    EXPECT_NE(err.find(path + ".x"), std::string::npos) << "offset " << off << ": " << err;
  }
}

TEST_F(CheckpointTest, TruncationIsNamed) {
  std::string path = sealed("c.pt", 1);
  const auto size = fs::file_size(path);
  for (uintmax_t keep : {uintmax_t{0}, uintmax_t{10}, size / 2, size - 1}) {
    fs::copy_file(path, path + ".t", fs::copy_options::overwrite_existing);
    fs::resize_file(path + ".t", keep);
    std::string err = error_of([&] { read_verified(path + ".t"); });
    EXPECT_NE(err.find("truncated"), std::string::npos) << keep << ": " << err;
  }
}

TEST_F(CheckpointTest, NewestWholeGenerationIsChosen) {
  std::string base = (dir_ / "p").string();
  sealed("p_0", 1, 0, 2, 10);
  sealed("p_1", 1, 1, 2, 10);
  // A second save renamed part 0 only (killed before part 1): part 0 keeps .prev.
  sealed("p_0", 2, 0, 2, 20);
  auto [paths, m] = resolve_partial(base);
  ASSERT_EQ(paths.size(), 2u);
  EXPECT_EQ(paths[0], base + "_0.prev");
  EXPECT_EQ(m.save_id, 1u);
  // Both parts renamed: the new save wins.
  sealed("p_1", 2, 1, 2, 20);
  auto [paths2, m2] = resolve_partial(base);
  EXPECT_EQ(paths2[0], base + "_0");
  EXPECT_EQ(m2.save_id, 2u);
}

TEST_F(CheckpointTest, MixedAndMissingPartsAreNamed) {
  std::string base = (dir_ / "q").string();
  sealed("q_0", 1, 0, 2, 10);
  std::string err = error_of([&] { resolve_partial(base); });
  EXPECT_NE(err.find("q_1' missing"), std::string::npos) << err;
  sealed("q_1", 9, 1, 2, 10);  // another save's part
  drop_previous(base + "_1");
  err = error_of([&] { resolve_partial(base); });
  EXPECT_NE(err.find("different saves"), std::string::npos) << err;
}

TEST_F(CheckpointTest, AtomicSmallFile) {
  std::string path = (dir_ / "newest").string();
  write_file_atomic(path, "tag1");
  write_file_atomic(path, "tag22");
  std::ifstream f(path);
  std::string s;
  f >> s;
  EXPECT_EQ(s, "tag22");
  int n = 0;
  for (auto& e : fs::directory_iterator(dir_)) n += e.is_regular_file();
  EXPECT_EQ(n, 1);  // no temporaries left
}

}  // namespace
