// Hub ids (ORG/NAME[@REVISION]) resolved in a fake Hugging Face cache laid out as huggingface_hub
// lays it out (refs/, snapshots/ of symlinks into blobs/), the cache's location from the same
// variables, the errors for what is not there, and every spindle command that takes a model folder.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "io/hub_cache.h"
#include "support/tiny_model.h"

namespace spindle::io {
namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

constexpr const char* kCommitMain = "0123456789abcdef0123456789abcdef01234567";
constexpr const char* kCommitV2 = "89abcdef0123456789abcdef0123456789abcdef";

// A cache folder with models stored the way `hf download` stores them: each file's content once
// under blobs/, each snapshot a folder of relative symlinks to those blobs, refs/<name> holding a
// commit id.
class FakeHubCache {
 public:
  explicit FakeHubCache(const fs::path& root) : root_(root) { fs::create_directories(root_); }
  const fs::path& root() const { return root_; }

  fs::path add(const std::string& repo_folder, const std::string& commit, const std::map<std::string, std::string>& files,
               const std::string& ref = "main") {
    const fs::path repo = root_ / repo_folder;
    const fs::path snapshot = repo / "snapshots" / commit;
    fs::create_directories(repo / "blobs");
    fs::create_directories(snapshot);
    for (const auto& [name, content] : files) {
      const std::string blob = fmt::format("{:016x}", std::hash<std::string>{}(content));
      std::ofstream(repo / "blobs" / blob, std::ios::binary) << content;
      fs::create_symlink(fs::path("../../blobs") / blob, snapshot / name);
    }
    if (!ref.empty()) {
      fs::create_directories((repo / "refs" / ref).parent_path());
      std::ofstream(repo / "refs" / ref) << commit;  // no newline, as huggingface_hub writes it
    }
    return snapshot;
  }

 private:
  fs::path root_;
};

constexpr const char* kCacheVariables[] = {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HOME"};

class HubCache : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kCacheVariables)
      if (const char* value = std::getenv(name)) saved_[name] = value;
    scratch_ = fs::path(::testing::TempDir()) / fmt::format("hub_cache_{}_{}", ::getpid(), counter_++);
    fs::remove_all(scratch_);
    fs::create_directories(scratch_);
    for (const char* name : kCacheVariables) ::unsetenv(name);
    ::setenv("HOME", (scratch_ / "home").c_str(), 1);
  }
  void TearDown() override {
    for (const char* name : kCacheVariables) ::unsetenv(name);
    for (const auto& [name, value] : saved_) ::setenv(name.c_str(), value.c_str(), 1);
    fs::remove_all(scratch_);
  }
  // The fake cache under $HF_HUB_CACHE with Org/Tiny at two revisions: main and the tag v2.
  FakeHubCache tiny_cache() {
    FakeHubCache cache(scratch_ / "cache");
    ::setenv("HF_HUB_CACHE", cache.root().c_str(), 1);
    cache.add("models--Org--Tiny", kCommitMain, {{"config.json", "{\"main\": true}"}, {"tokenizer.json", "{}"}});
    cache.add("models--Org--Tiny", kCommitV2, {{"config.json", "{\"v2\": true}"}}, "v2");
    return cache;
  }
  fs::path scratch_;

 private:
  std::map<std::string, std::string> saved_;
  static inline int counter_ = 0;
};

TEST_F(HubCache, AHubIdIsTheSnapshotThatRefsMainNames) {
  const FakeHubCache cache = tiny_cache();
  const fs::path snapshot = cache.root() / "models--Org--Tiny" / "snapshots" / kCommitMain;
  EXPECT_EQ(resolve_model_reference("Org/Tiny", "--model"), snapshot.string());
  // The files are read through the snapshot's symlinks into blobs/.
  const fs::path config = fs::path(resolve_model_reference("Org/Tiny", "--model")) / "config.json";
  EXPECT_TRUE(fs::is_symlink(config));
  EXPECT_EQ(read_text(config), "{\"main\": true}");
}

TEST_F(HubCache, ARevisionIsABranchATagOrACommit) {
  const FakeHubCache cache = tiny_cache();
  const fs::path snapshots = cache.root() / "models--Org--Tiny" / "snapshots";
  EXPECT_EQ(resolve_model_reference("Org/Tiny@main", "--model"), (snapshots / kCommitMain).string());
  EXPECT_EQ(resolve_model_reference("Org/Tiny@v2", "--model"), (snapshots / kCommitV2).string());
  EXPECT_EQ(read_text(snapshots / kCommitV2 / "config.json"), "{\"v2\": true}");
  // A commit id has no ref: it names the snapshot itself.
  EXPECT_EQ(resolve_model_reference(std::string("Org/Tiny@") + kCommitV2, "--model"), (snapshots / kCommitV2).string());
  // A ref written with a trailing newline (by hand, or by other tools) still names the commit.
  std::ofstream(cache.root() / "models--Org--Tiny" / "refs" / "main") << kCommitV2 << "\n";
  EXPECT_EQ(resolve_model_reference("Org/Tiny", "--model"), (snapshots / kCommitV2).string());
}

TEST_F(HubCache, TheCacheIsFoundAsHuggingFaceHubFindsIt) {
  const fs::path home = scratch_ / "home";
  EXPECT_EQ(hub_cache_location().path, home / ".cache" / "huggingface" / "hub");
  EXPECT_EQ(hub_cache_location().source, "~/.cache/huggingface/hub");
  ::setenv("XDG_CACHE_HOME", (scratch_ / "xdg").c_str(), 1);
  EXPECT_EQ(hub_cache_location().path, scratch_ / "xdg" / "huggingface" / "hub");
  ::setenv("HF_HOME", "~/hf", 1);  // expanded as Python's os.path.expanduser does
  EXPECT_EQ(hub_cache_location().path, home / "hf" / "hub");
  EXPECT_EQ(hub_cache_location().source, "$HF_HOME/hub");
  ::setenv("HUGGINGFACE_HUB_CACHE", (scratch_ / "old").c_str(), 1);
  EXPECT_EQ(hub_cache_location().path, scratch_ / "old");
  ::setenv("HF_HUB_CACHE", (scratch_ / "new").c_str(), 1);
  EXPECT_EQ(hub_cache_location().path, scratch_ / "new");
  EXPECT_EQ(hub_cache_location().source, "$HF_HUB_CACHE");

  // A model is found through each of them.
  for (const char* name : kCacheVariables)
    if (std::string(name) != "HOME") ::unsetenv(name);
  const fs::path in_home = FakeHubCache(home / ".cache" / "huggingface" / "hub")
                               .add("models--Org--Home", kCommitMain, {{"config.json", "{}"}});
  EXPECT_EQ(resolve_model_reference("Org/Home", "--model"), in_home.string());
  ::setenv("HF_HOME", (scratch_ / "hf_home").c_str(), 1);
  const fs::path in_hf_home =
      FakeHubCache(scratch_ / "hf_home" / "hub").add("models--Org--HfHome", kCommitMain, {{"config.json", "{}"}});
  EXPECT_EQ(resolve_model_reference("Org/HfHome", "--model"), in_hf_home.string());
  EXPECT_THROW(resolve_model_reference("Org/Home", "--model"), Error) << "HF_HOME hides the default cache";
}

TEST_F(HubCache, PathsAndWhatIsNotAHubIdStayAsGiven) {
  tiny_cache();
  // An existing folder wins over the cache, as in transformers.
  const fs::path cwd = fs::current_path();
  fs::create_directories(scratch_ / "work" / "Org" / "Tiny");
  fs::current_path(scratch_ / "work");
  EXPECT_EQ(resolve_model_reference("Org/Tiny", "--model"), "Org/Tiny");
  fs::current_path(cwd);
  for (const char* text : {"", "model", "a/b/c", "./Org/Tiny", "/no/such/Org/Tiny", "../Org/Tiny", "Org/..", "Org/x--y",
                           "-Org/Tiny", "Org/Tiny.", "Org/Tiny@", "Org/Tiny@../../x", "Org/Tiny@/etc", "~/Org",
                           "Org/Ti ny"}) {
    EXPECT_FALSE(parse_hub_model_id(text).has_value()) << text;
    EXPECT_EQ(resolve_model_reference(text, "--model"), text);
  }
  const auto id = parse_hub_model_id("Qwen/Qwen2.5-7B-Instruct@refs/pr/3");
  ASSERT_TRUE(id.has_value());
  EXPECT_EQ(id->repo_id(), "Qwen/Qwen2.5-7B-Instruct");
  EXPECT_EQ(id->revision, "refs/pr/3");
  EXPECT_EQ(id->cache_folder_name(), "models--Qwen--Qwen2.5-7B-Instruct");
  EXPECT_EQ(parse_hub_model_id("meta-llama/Llama-3.1-8B")->revision, "main");
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST_F(HubCache, AModelNotInTheCacheSaysWhereItLookedAndHowToDownloadIt) {
  const FakeHubCache cache = tiny_cache();
  std::string message = error_of([] { resolve_model_reference("Qwen/Qwen2.5-7B", "--ref-model"); });
  for (const std::string& part :
       {std::string("--ref-model Qwen/Qwen2.5-7B: no such folder"), (cache.root() / "models--Qwen--Qwen2.5-7B").string(),
        std::string("does not exist"), std::string("chosen by $HF_HUB_CACHE"), std::string("hf download Qwen/Qwen2.5-7B"),
        std::string("huggingface-cli download Qwen/Qwen2.5-7B"), std::string("HF_HOME")})
    EXPECT_NE(message.find(part), std::string::npos) << part << " not in: " << message;

  message = error_of([] { resolve_model_reference("Org/Tiny@v9", "--model"); });
  EXPECT_NE(message.find("has no revision 'v9'"), std::string::npos) << message;
  EXPECT_NE(message.find("hf download Org/Tiny --revision v9"), std::string::npos) << message;

  // refs/main names a commit whose snapshot is gone.
  fs::remove_all(cache.root() / "models--Org--Tiny" / "snapshots" / kCommitMain);
  message = error_of([] { resolve_model_reference("Org/Tiny", "--model"); });
  EXPECT_NE(message.find(std::string("names commit '") + kCommitMain + "'"), std::string::npos) << message;
  EXPECT_NE(message.find("interrupted download"), std::string::npos) << message;
}

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

// spindle with `arguments` and this process's environment (the cache variables), stdin empty.
CliRun run_spindle(const std::vector<std::string>& arguments, const fs::path& scratch) {
  std::string command = SPINDLE_CLI;
  for (const auto& a : arguments) command += " '" + a + "'";
  command += " < /dev/null > '" + (scratch / "out.txt").string() + "' 2> '" + (scratch / "err.txt").string() + "'";
  const int status = std::system(command.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_text(scratch / "out.txt"), read_text(scratch / "err.txt")};
}

// Every command that takes a model, adapter or tokenizer folder takes a hub id too.
TEST_F(HubCache, EveryCommandTakesAHubIdWhereItTakesAModelFolder) {
  tiny_cache();
  const std::vector<std::vector<std::string>> uses = {
      {"sft", "--model"},      {"sft", "--adapter"}, {"dpo", "--model"},      {"dpo", "--ref-model"},
      {"check", "--model"},    {"eval", "--model"},  {"eval", "--adapter"},   {"generate", "--model"},
      {"generate", "--adapter"}, {"bench", "--model"}, {"prepare", "--tokenizer"}, {"tokenize", "--tokenizer"}};
  for (const auto& use : uses) {
    const CliRun run = run_spindle({use[0], use[1], "Org/Missing"}, scratch_);
    EXPECT_EQ(run.exit_code, 2) << use[0] << " " << use[1] << ": " << run.err;
    EXPECT_NE(run.err.find(use[1] + " Org/Missing: no such folder"), std::string::npos) << use[0] << ": " << run.err;
    EXPECT_NE(run.err.find("hf download Org/Missing"), std::string::npos) << use[0] << ": " << run.err;
  }
}

// A model from the cache runs: bench reads the architecture from the snapshot's config.json.
TEST_F(HubCache, BenchRunsAModelFromTheCache) {
  FakeHubCache cache(scratch_ / "cache");
  ::setenv("HF_HUB_CACHE", cache.root().c_str(), 1);
  const fs::path snapshot = cache.add(
      "models--Org--Tiny", kCommitMain,
      {{"config.json",
        spindle::test::TinyModel{.model_type = "qwen2", .intermediate_size = 32, .num_layers = 1, .rms_norm_eps = 1e-6}
            .config_json()
            .dump()}});
  const CliRun run = run_spindle(
      {"bench", "--model", "Org/Tiny", "--seq", "16", "--steps", "1", "--warmup", "0", "--device", "cpu", "--json"},
      scratch_);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("\"model\": \"" + snapshot.string() + "\""), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("\"model_type\": \"qwen2\""), std::string::npos) << run.out;
}

}  // namespace
}  // namespace spindle::io
