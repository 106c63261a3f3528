// Helpers for --data resolution tests: the Hugging Face cache variables cleared and restored around
// each test, and fake caches laid out as huggingface_hub and `datasets` lay them out.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>

#include <fmt/format.h>

#include "data_test_util.h"

namespace spindle::testing {

inline constexpr const char* kCacheVariables[] = {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME",
                                                  "HF_DATASETS_CACHE", "XDG_CACHE_HOME", "HOME"};

// Clears the cache variables (HOME points into `home`) for the guard's life, then restores them.
class CacheEnvironment {
 public:
  explicit CacheEnvironment(const std::filesystem::path& home) {
    for (const char* name : kCacheVariables)
      if (const char* value = std::getenv(name)) saved_[name] = value;
    for (const char* name : kCacheVariables) ::unsetenv(name);
    ::setenv("HOME", home.c_str(), 1);
  }
  ~CacheEnvironment() {
    for (const char* name : kCacheVariables) ::unsetenv(name);
    for (const auto& [name, value] : saved_) ::setenv(name.c_str(), value.c_str(), 1);
  }
  CacheEnvironment(const CacheEnvironment&) = delete;
  CacheEnvironment& operator=(const CacheEnvironment&) = delete;

 private:
  std::map<std::string, std::string> saved_;
};

inline constexpr const char* kDatasetCommit = "0123456789abcdef0123456789abcdef01234567";

// A hub cache holding datasets--ORG--NAME as `huggingface-cli download --repo-type dataset` leaves
// it: blobs/, snapshots/COMMIT/<path> symlinks into blobs/, refs/main. Files are given by content.
inline std::filesystem::path add_hub_dataset(const std::filesystem::path& cache, const std::string& org,
                                             const std::string& name,
                                             const std::map<std::string, std::string>& files,
                                             const std::string& commit = kDatasetCommit) {
  namespace fs = std::filesystem;
  const fs::path repo = cache / fmt::format("datasets--{}--{}", org, name);
  const fs::path snapshot = repo / "snapshots" / commit;
  fs::create_directories(repo / "blobs");
  fs::create_directories(repo / "refs");
  for (const auto& [path, content] : files) {
    const std::string blob = fmt::format("{:016x}{}", std::hash<std::string>{}(content), path.size());
    std::ofstream(repo / "blobs" / blob, std::ios::binary) << content;
    const fs::path link = snapshot / path;
    fs::create_directories(link.parent_path());
    fs::path target = fs::path("../..") / "blobs" / blob;
    for (fs::path up = fs::path(path).parent_path(); !up.empty(); up = up.parent_path()) target = ".." / target;
    fs::create_symlink(target, link);
  }
  std::ofstream(repo / "refs" / "main") << commit;
  return snapshot;
}

}  // namespace spindle::testing
