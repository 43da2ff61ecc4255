// Byte-level text data: loading, the fortunes corpus, batches, errors.
#include "zinf/gpt/data.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace zinf::gpt {
namespace {

namespace fs = std::filesystem;

// A fresh directory under the system temporary directory, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("zinf_gpt_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  std::string write(const std::string& name, const std::string& text) const {
    const fs::path p = path_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }

 private:
  fs::path path_;
};

TEST(GptData, FileErrorsAreClear) {
  TempDir dir;
  auto missing = TextDataset::from_file((dir.path() / "nope.txt").string());
  EXPECT_EQ(missing.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(missing.status().detail().find("nope.txt"), std::string::npos);
  EXPECT_NE(missing.status().detail().find("No such file"), std::string::npos);

  auto empty = TextDataset::from_file(dir.write("empty.txt", ""));
  EXPECT_EQ(empty.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(empty.status().message().find("empty"), std::string::npos);

  EXPECT_EQ(TextDataset::from_file(dir.path().string()).status().code(),
            ErrorCode::kInvalidArgument);

  auto short_text = TextDataset::from_file(dir.write("short.txt", "hello"));
  ASSERT_TRUE(short_text.is_ok());
  EXPECT_EQ(short_text->size(), 5);
  EXPECT_TRUE(short_text->check_window(4).is_ok());
  Status s = short_text->check_window(5);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("has 5 bytes, fewer than sequence length + 1 = 6"), std::string::npos)
      << s.message();
  std::vector<int32_t> tokens(8), targets(8);
  EXPECT_EQ(short_text->sample_batch(0, 0, 0, 1, 8, tokens.data(), targets.data()).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(short_text->sample_batch(0, 0, 0, 0, 2, tokens.data(), targets.data()).code(),
            ErrorCode::kInvalidArgument);
}

// Not regular files: refused at once, before opening (a FIFO would wait for a writer forever,
// /dev/zero would be read until memory runs out).
TEST(GptData, DevicesAndFifosAreRefused) {
  TempDir dir;
  auto zero = TextDataset::from_file("/dev/zero");
  EXPECT_EQ(zero.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("not a regular file"), std::string::npos)
      << zero.status().message();
  const std::string fifo = (dir.path() / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto f = TextDataset::from_file(fifo);
  EXPECT_EQ(f.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("fifo"), std::string::npos) << f.status().message();
}

TEST(GptData, BatchesAreNextByteWindowsAndDeterministic) {
  std::string text;
  for (int i = 0; i < 1000; ++i) text.push_back(static_cast<char>(i % 251));
  auto data = TextDataset::from_text(text, "counting");
  ASSERT_TRUE(data.is_ok());
  const int batch = 4, seq = 16;
  std::vector<int32_t> t1(batch * seq), y1(batch * seq), t2(batch * seq), y2(batch * seq);
  ASSERT_TRUE(data->sample_batch(1, 5, 0, batch, seq, t1.data(), y1.data()));
  ASSERT_TRUE(data->sample_batch(1, 5, 0, batch, seq, t2.data(), y2.data()));
  EXPECT_EQ(t1, t2);
  EXPECT_EQ(y1, y2);
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < seq; ++t) {
      EXPECT_EQ(y1[b * seq + t], (t1[b * seq + t] + 1) % 251);  // the next byte
      if (t > 0) {
        EXPECT_EQ(t1[b * seq + t], y1[b * seq + t - 1]);
      }
    }
  }
  // Another step or another rank draws other windows.
  ASSERT_TRUE(data->sample_batch(1, 6, 0, batch, seq, t2.data(), y2.data()));
  EXPECT_NE(t1, t2);
  ASSERT_TRUE(data->sample_batch(1, 5, 1, batch, seq, t2.data(), y2.data()));
  EXPECT_NE(t1, t2);

  // A text of exactly seq + 1 bytes has one window.
  auto exact = TextDataset::from_text(text.substr(0, seq + 1), "exact");
  ASSERT_TRUE(exact->sample_batch(3, 3, 0, batch, seq, t1.data(), y1.data()));
  EXPECT_EQ(t1[batch * seq - 1], seq - 1);
  EXPECT_EQ(y1[batch * seq - 1], seq);
}

TEST(GptData, SplitHoldsOutTheTail) {
  auto data = TextDataset::from_text(std::string(90, 'a') + std::string(10, 'b'), "ab");
  auto parts = data->split(0.1);
  ASSERT_TRUE(parts.is_ok());
  EXPECT_EQ(parts->first.text(), std::string(90, 'a'));
  EXPECT_EQ(parts->second.text(), std::string(10, 'b'));
  EXPECT_EQ(data->split(0.0).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(data->split(0.001).status().code(), ErrorCode::kInvalidArgument);
}

TEST(GptData, FortunesSkipIndexesCopiesAndSubdirectories) {
  TempDir dir;
  dir.write("bbb", "second\n%\nfortune\n");
  dir.write("aaa", "first fortune\n%\n100% sure\n%\n");
  dir.write("aaa.dat", "index bytes");
  dir.write("aaa.u8", "utf-8 copy");
  dir.write("off/rude", "not this one");
  auto data = TextDataset::from_fortunes(dir.path().string());
  ASSERT_TRUE(data.is_ok()) << data.status().to_string();
  EXPECT_EQ(data->text(), "first fortune\n\n100% sure\n\nsecond\n\nfortune\n");
  EXPECT_NE(data->source().find("2 fortune files"), std::string::npos);

  TempDir none;
  none.write("x.dat", "only an index");
  EXPECT_EQ(TextDataset::from_fortunes(none.path().string()).status().code(), ErrorCode::kNotFound);
  auto no_dir = TextDataset::from_fortunes((none.path() / "missing").string());
  EXPECT_EQ(no_dir.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(no_dir.status().message().find("fortunes"), std::string::npos);
}

TEST(GptData, DefaultCorpusIsTheInstalledFortunes) {
  if (!fs::is_directory(kFortunesDir)) GTEST_SKIP() << "no " << kFortunesDir;
  auto data = TextDataset::load("");
  ASSERT_TRUE(data.is_ok()) << data.status().to_string();
  EXPECT_GT(data->size(), 1'000'000);  // about 2.5 MB in Debian 12
  EXPECT_EQ(data->text().find("\n%\n"), std::string_view::npos);
}

}  // namespace
}  // namespace zinf::gpt
