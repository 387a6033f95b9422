// Line assembly and prefixing (launcher/line_buffer.h).
#include "launcher/line_buffer.h"

#include <gtest/gtest.h>

namespace smp::launcher {
namespace {

struct Collect {
  std::vector<std::string> lines;
  LineSplitter::LineFn fn() {
    return [this](std::string_view l) { lines.emplace_back(l); };
  }
};

using Lines = std::vector<std::string>;

TEST(LineSplitter, JoinsChunksIntoWholeLines) {
  LineSplitter s;
  Collect c;
  s.append("hel", c.fn());
  EXPECT_TRUE(c.lines.empty());
  s.append("lo\nwor", c.fn());
  EXPECT_EQ(c.lines, Lines({"hello"}));
  EXPECT_EQ(s.pending(), "wor");
  s.append("ld\n\nlast", c.fn());
  EXPECT_EQ(c.lines, Lines({"hello", "world", ""}));
  s.flush(c.fn());
  EXPECT_EQ(c.lines, Lines({"hello", "world", "", "last"}));
  s.flush(c.fn());  // nothing pending: no empty line
  EXPECT_EQ(c.lines.size(), 4u);
}

TEST(LineSplitter, ByteByByteEqualsWhole) {
  std::string text = "a\nbb\nccc\n" + std::string(5000, 'x') + "\nend";
  LineSplitter whole, bytes;
  Collect a, b;
  whole.append(text, a.fn());
  for (char ch : text) bytes.append(std::string_view(&ch, 1), b.fn());
  whole.flush(a.fn());
  bytes.flush(b.fn());
  EXPECT_EQ(a.lines, b.lines);
  EXPECT_EQ(a.lines.size(), 5u);
}

TEST(LineSplitter, OverlongLineIsCutAtTheLimit) {
  LineSplitter s(/*max_line=*/4);
  Collect c;
  s.append("abcdefghij\nxy\n", c.fn());
  EXPECT_EQ(c.lines, Lines({"abcd", "efgh", "ij", "xy"}));
}

TEST(PrefixedLine, Format) {
  EXPECT_EQ(prefixed_line(3, "hello"), "[3] hello\n");
  EXPECT_EQ(prefixed_line(12, ""), "[12] \n");
}

TEST(OutputTail, KeepsTheLastLines) {
  OutputTail t(3);
  for (int i = 0; i < 10; ++i) t.push("line " + std::to_string(i));
  EXPECT_EQ(t.snapshot(), Lines({"line 7", "line 8", "line 9"}));
  EXPECT_EQ(t.snapshot({"partial", ""}), Lines({"line 8", "line 9", "partial"}));
  t.clear();
  EXPECT_TRUE(t.snapshot().empty());
}

TEST(OutputTail, ClipsLongLines) {
  OutputTail t;
  t.push(std::string(kMaxTailLineBytes + 10, 'z'));
  std::string l = t.snapshot().at(0);
  EXPECT_EQ(l.substr(0, kMaxTailLineBytes), std::string(kMaxTailLineBytes, 'z'));
  EXPECT_NE(l.find("[... 10 more bytes]"), std::string::npos);
}

}  // namespace
}  // namespace smp::launcher
