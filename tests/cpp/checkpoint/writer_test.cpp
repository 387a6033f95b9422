// smp::checkpoint's writer and reads by entry, on real files: the file write_sealed
// produces is what torch's reader and read_verified read, its entry table places and
// hashes every record, a flipped byte is named with its record by the entry reader
// only when that record is verified, and the background Writer reports a failure by
// job with the file's name.
#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/checkpoint.h"
#include "tests/cpp/checkpoint/temp_dir_test.h"
#include "checkpoint/entries.h"
#include "checkpoint/mapped.h"
#include "checkpoint/writer.h"

namespace fs = std::filesystem;
using namespace smp::checkpoint;

namespace {

class WriterTest : public test::TempDirTest {
 protected:

  static Blob blob(const std::string& name, int64_t n, int seed) {
    at::Tensor t = at::arange(n, at::kLong).mul(seed).remainder(251).to(at::kByte);
    return {name, t.contiguous()};
  }

  // Three records, one of them over two hash chunks.
  std::vector<Blob> records() const {
    return {blob("data.pkl", 100, 3), blob("data/0", 1000, 5),
            blob("data/1", static_cast<int64_t>(kEntryChunk) + 4096, 7)};
  }



};

TEST_F(WriterTest, WrittenFileReadsWholeByTorchAndByEntry) {
  auto recs = records();
  Manifest m;
  m.save_id = 42;
  write_sealed(path("f"), recs, m);
  EXPECT_EQ(m.format_version, kFormatVersion);
  EXPECT_EQ(m.entry_chunk, kEntryChunk);

  // torch's own reader.
  caffe2::serialize::PyTorchStreamReader torch_reader(path("f"));
  for (const auto& r : recs) {
    auto [ptr, n] = torch_reader.getRecord(r.name);
    ASSERT_EQ(n, static_cast<size_t>(r.bytes.numel())) << r.name;
    EXPECT_EQ(std::memcmp(ptr.get(), r.bytes.data_ptr(), n), 0) << r.name;
  }
  // The whole-file check of version 1 still holds.
  VerifiedFile vf = read_verified(path("f"));
  EXPECT_EQ(vf.manifest.save_id, 42u);

  // By entry: every record placed and hashed, chunks included.
  MappedFile f(path("f"));
  ASSERT_EQ(f.entries().size(), recs.size());
  EXPECT_EQ(f.entries()[2].chunk_hashes.size(), 2u);
  const uint64_t before = MappedFile::bytes_read();
  for (const auto& r : recs) {
    at::Tensor t = f.verified(r.name);
    EXPECT_TRUE(at::equal(t, r.bytes)) << r.name;
  }
  uint64_t total = 0;
  for (const auto& r : recs) total += static_cast<uint64_t>(r.bytes.numel());
  EXPECT_EQ(MappedFile::bytes_read() - before, total);
  f.verify("data/1");  // verified once: nothing read again
  EXPECT_EQ(MappedFile::bytes_read() - before, total);
}

TEST_F(WriterTest, FlippedByteIsNamedWithItsRecordOnlyWhenThatRecordIsRead) {
  auto recs = records();
  Manifest m;
  write_sealed(path("f"), recs, m);
  uint64_t off = 0;
  {
    MappedFile f(path("f"));
    for (const auto& e : f.entries()) {
      if (e.name == "data/1") off = e.offset + kEntryChunk + 10;  // the second chunk
    }
  }
  {
    std::fstream io(path("f"), std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(static_cast<std::streamoff>(off));
    char c;
    io.get(c);
    io.seekp(static_cast<std::streamoff>(off));
    io.put(static_cast<char>(c ^ 0x10));
  }
  MappedFile f(path("f"));
  f.verify("data/0");  // an untouched record still verifies
  f.verify("data.pkl");
  const std::string e = error_of([&] { f.verify("data/1"); });
  EXPECT_NE(e.find("checksum mismatch in record 'data/1'"), std::string::npos) << e;
  EXPECT_NE(e.find(path("f")), std::string::npos) << e;
  // The whole-file check sees it too.
  EXPECT_NE(error_of([&] { read_verified(path("f")); }).find("checksum mismatch"), std::string::npos);
}

TEST_F(WriterTest, VersionOneFileHasNoEntryTableButStillReadsWhole) {
  // seal() of a zip torch wrote: the version 1 layout.
  {
    caffe2::serialize::PyTorchStreamWriter w(path("v1.tmp"));
    std::string data(1000, 7);
    w.writeRecord("data/0", data.data(), data.size());
    w.writeEndOfFile();
  }
  Manifest m;
  seal(path("v1.tmp"), m);
  EXPECT_EQ(m.format_version, 1u);
  EXPECT_EQ(read_verified(path("v1.tmp")).manifest.format_version, 1u);
  EXPECT_NE(error_of([&] { MappedFile f(path("v1.tmp")); }).find("has no entry table"),
            std::string::npos);
}

TEST_F(WriterTest, DamagedEntryTableIsNamed) {
  Manifest m;
  write_sealed(path("f"), records(), m);
  {
    std::fstream io(path("f"), std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(static_cast<std::streamoff>(m.entries_offset + 3));
    io.put('\x7f');
  }
  EXPECT_NE(error_of([&] { MappedFile f(path("f")); }).find("checksum mismatch in its entry table"),
            std::string::npos);
  // decode_entries refuses nonsense on its own (what the fuzzer feeds it).
  EXPECT_NE(error_of([&] { decode_entries(std::string("\xff\xff\xff\xff", 4), kEntryChunk, 100, "x"); })
                .find("entry table damaged"),
            std::string::npos);
}

TEST_F(WriterTest, BackgroundWriterCommitsInOrderAndReportsFailuresByJob) {
  Writer w;
  Manifest m;
  SaveJob ok{records(), path(".a.tmp"), path("a"), m, true, false};
  SaveJob bad{records(), path("missing/.b.tmp"), path("missing/b"), m, true, false};
  const uint64_t j1 = w.submit(std::move(ok));
  const uint64_t j2 = w.submit(std::move(bad));
  std::string e1 = "unset", e2;
  ASSERT_TRUE(w.wait(j2, std::chrono::seconds(30), &e2));
  ASSERT_TRUE(w.wait(j1, std::chrono::milliseconds(0), &e1));
  EXPECT_EQ(e1, "");
  EXPECT_TRUE(fs::exists(path("a")));
  EXPECT_FALSE(fs::exists(path(".a.tmp")));
  EXPECT_NE(e2.find("missing/.b.tmp"), std::string::npos) << e2;
  EXPECT_NE(e2.find("cannot create"), std::string::npos) << e2;
  EXPECT_EQ(read_manifest(path("a")).format_version, kFormatVersion);
  // A job that is not submitted yet is not finished.
  EXPECT_FALSE(w.wait(j2 + 1, std::chrono::milliseconds(10), nullptr));
}

}  // namespace
