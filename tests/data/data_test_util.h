// Helpers for data tests: scratch files and error-message checks.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

namespace spindle::testing {

// A directory removed at the end of the test.
class ScratchDir {
 public:
  ScratchDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            (std::string("spindle_data_") + (info ? info->name() : "x") + "_" +
             std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path write(const std::string& name, const std::string& content) const {
    auto file = path_ / name;
    std::ofstream(file, std::ios::binary) << content;
    return file;
  }

 private:
  std::filesystem::path path_;
};

}  // namespace spindle::testing

// Expects `statement` to throw an exception of `type` whose message contains every fragment.
#define EXPECT_THROW_WITH(statement, type, ...)                                             \
  do {                                                                                      \
    bool thrown_ = false;                                                                   \
    try {                                                                                   \
      statement;                                                                            \
    } catch (const type& e_) {                                                              \
      thrown_ = true;                                                                       \
      for (const char* fragment_ : {__VA_ARGS__})                                           \
        EXPECT_NE(std::string(e_.what()).find(fragment_), std::string::npos)                \
            << "message: " << e_.what() << "\nmissing: " << fragment_;                      \
    }                                                                                       \
    EXPECT_TRUE(thrown_) << #statement " did not throw " #type;                             \
  } while (0)
