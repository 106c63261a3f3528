#include "comm/process_group.h"

#include <charconv>
#include <cstdlib>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"

namespace spindle {

namespace {

int parse_int(std::string_view name, const std::string& text, int minimum, int maximum) {
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end != text.data() + text.size() || value < minimum || value > maximum)
    fail("environment variable {}='{}' is not an integer in [{}, {}]; fix or unset it", name, text, minimum,
         maximum);
  return value;
}

struct Reader {
  const EnvironmentLookup& lookup;
  std::optional<std::string> get(std::string_view name) const {
    auto value = lookup(name);
    if (value && value->empty()) return std::nullopt;  // VAR= counts as unset, as in torchrun
    return value;
  }
  std::optional<int> integer(std::string_view name, int minimum, int maximum) const {
    auto value = get(name);
    if (!value) return std::nullopt;
    return parse_int(name, *value, minimum, maximum);
  }
};

// SLURM_TASKS_PER_NODE looks like "4(x2),3": 4 tasks on each of the first two nodes, 3 on the third.
std::optional<int> slurm_tasks_on_node(const std::string& tasks_per_node, int node_id) {
  int node = 0;
  size_t position = 0;
  while (position < tasks_per_node.size()) {
    size_t comma = tasks_per_node.find(',', position);
    std::string item = tasks_per_node.substr(position, comma == std::string::npos ? std::string::npos : comma - position);
    position = comma == std::string::npos ? tasks_per_node.size() : comma + 1;
    int tasks = 0, repeat = 1;
    size_t paren = item.find("(x");
    std::string count_text = item.substr(0, paren);
    tasks = parse_int("SLURM_TASKS_PER_NODE", count_text, 1, 1 << 20);
    if (paren != std::string::npos) {
      if (item.back() != ')') fail("environment variable SLURM_TASKS_PER_NODE='{}' is malformed", tasks_per_node);
      repeat = parse_int("SLURM_TASKS_PER_NODE", item.substr(paren + 2, item.size() - paren - 3), 1, 1 << 20);
    }
    if (node_id < node + repeat) return tasks;
    node += repeat;
  }
  return std::nullopt;
}

void check_ranks(const ProcessGroupInfo& info, std::string_view rank_name, std::string_view world_name,
                 std::string_view local_rank_name, std::string_view local_world_name) {
  if (info.rank >= info.world_size)
    fail("{}={} is not below {}={}; ranks run from 0 to world size - 1", rank_name, info.rank, world_name,
         info.world_size);
  if (info.local_rank >= info.local_world_size)
    fail("{}={} is not below {}={}", local_rank_name, info.local_rank, local_world_name, info.local_world_size);
  if (info.local_world_size > info.world_size)
    fail("{}={} exceeds {}={}", local_world_name, info.local_world_size, world_name, info.world_size);
}

void set_store_port(ProcessGroupInfo& info, const Reader& env) {
  info.store_port = info.master_port;
  // torchrun's agent hosts its own TCPStore on MASTER_PORT and tells workers so with this variable.
  if (env.get("TORCHELASTIC_USE_AGENT_STORE") || env.get("TORCHELASTIC_RUN_ID"))
    info.store_port = info.master_port + 1;
  if (auto port = env.integer("SPINDLE_STORE_PORT", 1, 65535)) info.store_port = *port;
  if (info.store_port > 65535)
    fail("MASTER_PORT={} leaves no port above it for spindle's rendezvous store under torchrun; set "
         "SPINDLE_STORE_PORT to a free port",
         info.master_port);
}

ProcessGroupInfo from_torchrun_variables(const Reader& env) {
  ProcessGroupInfo info;
  info.source = env.get("SPINDLE_LAUNCHER") ? "spindle launcher" : "torchrun-style environment";
  info.world_size = *env.integer("WORLD_SIZE", 1, 1 << 20);
  info.rank = *env.integer("RANK", 0, 1 << 20);
  info.local_rank = env.integer("LOCAL_RANK", 0, 1 << 20).value_or(info.rank);
  info.local_world_size = env.integer("LOCAL_WORLD_SIZE", 1, 1 << 20).value_or(info.world_size);
  check_ranks(info, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  auto address = env.get("MASTER_ADDR");
  auto port = env.integer("MASTER_PORT", 1, 65535);
  if (info.distributed() && (!address || !port))
    fail("RANK and WORLD_SIZE={} are set but {} is not; a multi-process job needs MASTER_ADDR (the host of rank "
         "0) and MASTER_PORT (a free TCP port there), as torchrun sets them",
         info.world_size, !address ? "MASTER_ADDR" : "MASTER_PORT");
  if (address) info.master_addr = *address;
  if (port) info.master_port = *port;
  set_store_port(info, env);
  return info;
}

ProcessGroupInfo from_slurm_variables(const Reader& env) {
  ProcessGroupInfo info;
  info.source = "SLURM";
  info.world_size = *env.integer("SLURM_NTASKS", 1, 1 << 20);
  info.rank = *env.integer("SLURM_PROCID", 0, 1 << 20);
  info.local_rank = env.integer("SLURM_LOCALID", 0, 1 << 20).value_or(0);
  if (auto per_node = env.integer("SLURM_NTASKS_PER_NODE", 1, 1 << 20)) {
    info.local_world_size = *per_node;
  } else if (auto tasks = env.get("SLURM_TASKS_PER_NODE")) {
    int node_id = env.integer("SLURM_NODEID", 0, 1 << 20).value_or(0);
    auto on_node = slurm_tasks_on_node(*tasks, node_id);
    if (!on_node)
      fail("SLURM_TASKS_PER_NODE='{}' has no entry for SLURM_NODEID={}", *tasks, node_id);
    info.local_world_size = *on_node;
  } else {
    info.local_world_size = info.world_size;
  }
  check_ranks(info, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE");

  if (auto address = env.get("MASTER_ADDR")) {
    info.master_addr = *address;
  } else if (auto nodes = env.get("SLURM_JOB_NODELIST") ? env.get("SLURM_JOB_NODELIST") : env.get("SLURM_NODELIST")) {
    info.master_addr = first_slurm_host(*nodes);  // SLURM_PROCID 0 runs on the first node of the list
  } else if (info.distributed()) {
    fail("SLURM job with SLURM_NTASKS={} but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; export "
         "MASTER_ADDR=<host of task 0>",
         info.world_size);
  }
  if (auto port = env.integer("MASTER_PORT", 1, 65535)) {
    info.master_port = *port;
  } else if (auto job = env.get("SLURM_JOB_ID")) {
    // Every task of a job derives the same port; different jobs sharing a node rarely collide.
    info.master_port = 20000 + static_cast<int>(std::strtoull(job->c_str(), nullptr, 10) % 20000);
  } else if (info.distributed()) {
    fail("SLURM job with SLURM_NTASKS={} but neither MASTER_PORT nor SLURM_JOB_ID is set; export "
         "MASTER_PORT=<free port>",
         info.world_size);
  }
  set_store_port(info, env);
  return info;
}

}  // namespace

std::string ProcessGroupInfo::describe() const {
  return fmt::format("rank {} of {} (local {} of {}), rendezvous {}:{}, from {}", rank, world_size, local_rank,
                     local_world_size, master_addr, store_port, source);
}

std::string first_slurm_host(std::string_view node_list) {
  // The first host ends at the first comma outside brackets; a bracket holds ranges "07-09" or lists.
  size_t bracket = node_list.find('[');
  size_t comma = node_list.find(',');
  if (node_list.empty() || node_list.front() == ',' || node_list.front() == '[')
    fail("SLURM node list '{}' does not start with a host name", node_list);
  if (bracket == std::string_view::npos || (comma != std::string_view::npos && comma < bracket))
    return std::string(node_list.substr(0, comma));
  size_t close = node_list.find(']', bracket);
  if (close == std::string_view::npos) fail("SLURM node list '{}' has an unclosed '['", node_list);
  std::string_view prefix = node_list.substr(0, bracket);
  std::string_view inside = node_list.substr(bracket + 1, close - bracket - 1);
  std::string_view first = inside.substr(0, inside.find_first_of(",-"));
  if (first.empty()) fail("SLURM node list '{}' has an empty range", node_list);
  // Text after ']' (e.g. "n[1-2]-ib") belongs to every host.
  std::string_view suffix = node_list.substr(close + 1);
  suffix = suffix.substr(0, suffix.find(','));
  return std::string(prefix) + std::string(first) + std::string(suffix);
}

ProcessGroupInfo process_group_from_environment(const EnvironmentLookup& lookup) {
  Reader env{lookup};
  bool has_rank = env.get("RANK").has_value(), has_world = env.get("WORLD_SIZE").has_value();
  if (has_rank != has_world)
    fail("{} is set but {} is not; set both (torchrun-style) or neither", has_rank ? "RANK" : "WORLD_SIZE",
         has_rank ? "WORLD_SIZE" : "RANK");
  // torchrun-style variables win: torchrun inside a SLURM allocation sets them per worker.
  if (has_rank) return from_torchrun_variables(env);
  if (env.get("SLURM_PROCID") && env.get("SLURM_NTASKS")) return from_slurm_variables(env);
  return ProcessGroupInfo{};
}

ProcessGroupInfo process_group_from_environment() {
  return process_group_from_environment([](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (!value) return std::nullopt;
    return std::string(value);
  });
}

}  // namespace spindle
