#include "io/hub_cache.h"

#include <pwd.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace spindle::io {

namespace fs = std::filesystem;

namespace {

std::string environment(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::string(value) : std::string();
}

std::string home_directory() {
  std::string home = environment("HOME");
  if (home.empty())
    if (const passwd* entry = ::getpwuid(::getuid())) home = entry->pw_dir;
  return home;
}

// Python's os.path.expanduser for "~" and "~/..." (the forms the cache variables use).
fs::path expand_user(const std::string& path) {
  if (path == "~" || path.starts_with("~/")) return fs::path(home_directory() + path.substr(1));
  return fs::path(path);
}

// huggingface_hub's rule for each part of a repo id: word characters, '-' and '.', starting and
// ending with a word character, without "--" or "..".
bool valid_repo_part(std::string_view part) {
  if (part.empty() || part.size() > 96) return false;
  auto word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  if (!word(part.front()) || !word(part.back())) return false;
  for (char c : part)
    if (!word(c) && c != '-' && c != '.') return false;
  return part.find("--") == std::string_view::npos && part.find("..") == std::string_view::npos;
}

// A revision names a file under refs/ or a folder under snapshots/: it must stay inside them.
bool valid_revision(std::string_view revision) {
  if (revision.empty() || revision.front() == '/' || revision.find("..") != std::string_view::npos) return false;
  for (char c : revision)
    if (std::isspace(static_cast<unsigned char>(c)) || std::iscntrl(static_cast<unsigned char>(c))) return false;
  return true;
}

std::string read_ref(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::string commit = text.str();
  while (!commit.empty() && std::isspace(static_cast<unsigned char>(commit.back()))) commit.pop_back();
  while (!commit.empty() && std::isspace(static_cast<unsigned char>(commit.front()))) commit.erase(0, 1);
  return commit;
}

}  // namespace

HubCacheLocation hub_cache_location() {
  if (std::string v = environment("HF_HUB_CACHE"); !v.empty()) return {expand_user(v), "$HF_HUB_CACHE"};
  if (std::string v = environment("HUGGINGFACE_HUB_CACHE"); !v.empty()) return {expand_user(v), "$HUGGINGFACE_HUB_CACHE"};
  if (std::string v = environment("HF_HOME"); !v.empty()) return {expand_user(v) / "hub", "$HF_HOME/hub"};
  if (std::string v = environment("XDG_CACHE_HOME"); !v.empty())
    return {expand_user(v) / "huggingface" / "hub", "$XDG_CACHE_HOME/huggingface/hub"};
  return {fs::path(home_directory()) / ".cache" / "huggingface" / "hub", "~/.cache/huggingface/hub"};
}

std::optional<HubModelId> parse_hub_model_id(std::string_view text) {
  HubModelId id;
  const size_t at = text.find('@');
  if (at != std::string_view::npos) {
    id.revision = std::string(text.substr(at + 1));
    if (!valid_revision(id.revision)) return std::nullopt;
    text = text.substr(0, at);
  }
  const size_t slash = text.find('/');
  if (slash == std::string_view::npos) return std::nullopt;
  const std::string_view org = text.substr(0, slash), name = text.substr(slash + 1);
  if (!valid_repo_part(org) || !valid_repo_part(name)) return std::nullopt;
  id.org = std::string(org);
  id.name = std::string(name);
  return id;
}

std::string resolve_model_reference(const std::string& reference, std::string_view option) {
  std::error_code ignored;
  if (reference.empty() || fs::exists(reference, ignored)) return reference;
  const std::optional<HubModelId> id = parse_hub_model_id(reference);
  if (!id) return reference;

  const HubCacheLocation cache = hub_cache_location();
  const fs::path repo = cache.path / id->cache_folder_name();
  const fs::path ref = repo / "refs" / id->revision;
  std::string problem;
  std::string commit = id->revision;
  if (!fs::is_directory(repo, ignored)) {
    problem = fmt::format("{} does not exist", repo.string());
  } else {
    if (fs::is_regular_file(ref, ignored)) commit = read_ref(ref);
    const fs::path snapshot = repo / "snapshots" / commit;
    if (!commit.empty() && commit.find('/') == std::string::npos && fs::is_directory(snapshot, ignored))
      return snapshot.string();
    problem = fs::is_regular_file(ref, ignored)
                  ? fmt::format("{} names commit '{}' but {} is missing (an interrupted download?)", ref.string(),
                                commit, snapshot.string())
                  : fmt::format("{} has no revision '{}' (neither refs/{} nor snapshots/{})", repo.string(),
                                id->revision, id->revision, id->revision);
  }
  const std::string revision_flag = id->revision == "main" ? "" : " --revision " + id->revision;
  fail("{} {}: no such folder, and the model is not in the local Hugging Face cache ({}, chosen by {}): {}. "
       "spindle does not download; fetch it with `hf download {}{}` (or `huggingface-cli download {}{}`), set "
       "HF_HUB_CACHE or HF_HOME to the cache that holds it, or pass the model's folder",
       option, reference, cache.path.string(), cache.source, problem, id->repo_id(), revision_flag, id->repo_id(),
       revision_flag);
}

}  // namespace spindle::io
