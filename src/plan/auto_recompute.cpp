#include "plan/auto_recompute.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "model/config.h"
#include "parallel/mesh.h"

#ifdef SPINDLE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace spindle::plan {

namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

// The plan of `base` with `setting` at `seq`: the peak (largest rank), the host bytes of offload and
// the predicted step time (slowest rank).
Planned plan_with(PlanOptions o, const RecomputeSetting& setting, int64_t seq) {
  SPINDLE_CHECK(setting.offload_layers >= -1, "plan_with: offload_layers {} is not resolved", setting.offload_layers);
  o.recompute = setting.recompute;
  o.recompute_layers = setting.recompute_layers;
  o.offload = setting.offload;
  o.offload_layers = setting.offload ? setting.offload_layers : -1;
  o.mlp_tile_tokens = setting.mlp_tile_tokens;
  o.checkpoint_stride = setting.checkpoint_stride;
  o.seq_lengths = {seq};
  o.device_memory_gib = 0;
  const PlanReport report = run_plan(o);
  const RankPlan& top = report.lengths.at(0).largest();
  Planned p{top.peak_allocated_bytes, 0, report.lengths[0].slowest().time};
  for (const RankPlan& r : report.lengths[0].ranks) p.host = std::max(p.host, r.host_peak_bytes);
  return p;
}

// Offload's host tensors may take three quarters of the host's memory (pinned on CUDA: the kernel
// cannot page it out, and the process, its data and the OS need the rest): --host-memory when
// given, else what this process may use here (machine_host_memory); 0: no limit known.
int64_t host_budget(const PlanOptions& o) {
  return (o.host_memory_bytes > 0 ? o.host_memory_bytes : machine_host_memory()) / 4 * 3;
}

// A cgroup memory file's limit: "max" or a v1 "unlimited" (2^63 rounded down to a page) is none (0).
int64_t read_limit(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::string text;
  if (!(in >> text) || text == "max") return 0;
  try {
    const unsigned long long v = std::stoull(text);
    return v == 0 || v >= (1ull << 62) ? 0 : static_cast<int64_t>(v);
  } catch (const std::exception&) {
    return 0;  // not a number: no usable limit
  }
}

bool fits(const Planned& p, int64_t usable_bytes, const PlanOptions& o) {
  const int64_t host = host_budget(o);
  return p.peak <= usable_bytes && (host == 0 || p.host <= host);
}

// Offload's copies run beside compute on a copy engine of their own: a step loses only the part of
// a copy that outlasts the compute it runs under (layer l's copy out runs under layer l+1's forward,
// its copy back under layer l+1's backward and recompute). On an H200 the copies reached 54.9 GB/s
// and the step waited 0.0 ms for them (Qwen2.5-1.5B at 32k, docs/memory.md). Counted on every
// offloadable layer (the choice may offload fewer), with the layers' predicted times of `time`;
// where the copies take the compute's own resources (the CPU backend) all of their time.
double unhidden_copy_seconds(const PlanOptions& o, const ModelConfig& c, const RecomputeSetting& s,
                             const StepTime& time, const DeviceRates& rates, int64_t tokens) {
  if (!s.offload || c.num_layers < 2 || rates.host_copy_bytes_per_s <= 0) return 0;
  const int64_t recomputed = s.recompute_layers < 0 ? c.num_layers : s.recompute_layers;
  const int64_t offloaded = std::min(recomputed, c.num_layers - 1);
  const double element = o.dtype == "f64" ? 8 : o.dtype == "f32" || (o.dtype == "auto" && o.device != "cuda") ? 4 : 2;
  const double stat = o.dtype == "f64" ? 8 : 4;
  const double t = static_cast<double>(tokens);
  // A layer's kept tensors: its input, and with keep-attention its attention output and LSE.
  double bytes = t * static_cast<double>(c.hidden_size) * element;
  if (s.recompute == "keep-attention")
    bytes += t * static_cast<double>(c.num_heads * c.head_dim) * element + t * static_cast<double>(c.num_heads) * stat;
  const double copy = bytes / rates.host_copy_bytes_per_s;
  double lost = 0;
  for (int64_t l = 0; l < offloaded; ++l) {
    const size_t next = static_cast<size_t>(l + 1);
    const double under_forward = rates.copies_beside_compute ? time.layer_forward_s.at(next) : 0;
    const double under_backward = rates.copies_beside_compute ? time.layer_backward_s.at(next) : 0;
    lost += std::max(0.0, copy - under_forward) + std::max(0.0, copy - under_backward);
  }
  return lost;
}

// The MLP tilings --recompute auto tries: the one given, or with auto untiled then
// kAutoMlpTileTokens (only when the model has a SwiGLU MLP layer to tile and no norm after it).
std::vector<int64_t> candidate_tiles(const PlanOptions& o, const ModelConfig& config) {
  if (o.mlp_tile_tokens != kMlpTileAuto) return {o.mlp_tile_tokens};
  if (config.sandwich_norms) return {0};  // Gemma's norm after the MLP needs the MLP's whole output
  for (int64_t l = 0; l < config.num_layers; ++l)
    if (config.layer_kind(l).feed_forward == FeedForwardKind::SwiGLU) return {0, kAutoMlpTileTokens};
  return {0};
}

}  // namespace

int64_t parse_memory_size(const std::string& text, const std::string& option) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = text.substr(used);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::tolower(c); });
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "k" || unit == "kib") scale = 1024.0;
  else if (unit == "m" || unit == "mib") scale = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib") scale = static_cast<double>(kGiB);
  else if (unit == "t" || unit == "tib") scale = 1024.0 * static_cast<double>(kGiB);
  if (used == 0 || scale == 0 || !(value > 0))
    fail("{} {}: give bytes or a size with a binary unit (80GiB, 80G, 512MiB)", option, text);
  return static_cast<int64_t>(std::llround(value * scale));
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 0.1 * kGiB) return fmt::format("{:.2f} GiB", b / kGiB);
  if (b >= 0.1 * (1 << 20)) return fmt::format("{:.2f} MiB", b / (1 << 20));
  return fmt::format("{:.1f} KiB", b / 1024);
}

int64_t usable_memory(int64_t device_bytes, const std::string& device) {
  if (device != "cuda") return device_bytes;
  // What the plan leaves out on CUDA (docs/memory.md): the context and module images (~0.5 GiB on an
  // H200), cuBLASLt's 32 MiB and cuDNN's workspaces, NCCL's buffers with several GPUs, and the
  // stream-ordered pool's fragmentation (reserved − allocated: 0.1–1.5 % of the peak measured).
  // 2 GiB plus 3 % of the device covers them with room; on an H200 (139.8 GiB) that is 6.2 GiB.
  const int64_t margin = 2 * kGiB + device_bytes * 3 / 100;
  return std::max<int64_t>(0, device_bytes - margin);
}

int64_t cgroup_memory_limit(const std::string& sysfs, const std::string& cgroup_of_process) {
  namespace fs = std::filesystem;
  int64_t limit = 0;
  auto take = [&](const fs::path& file) {
    const int64_t v = read_limit(file);
    if (v > 0 && (limit == 0 || v < limit)) limit = v;
  };
  // Each line is "id:controllers:path": v2's has id 0 and no controllers, v1's memory line names
  // "memory". A group's limit binds every group below it, so the group's own file and its
  // ancestors' (up to the mount, which in a container is the container's own group) count.
  std::istringstream lines(cgroup_of_process);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1);
    fs::path group = fs::path(line.substr(b + 1)).relative_path();
    fs::path base, name;
    if (id == "0" && controllers.empty()) {
      base = fs::path(sysfs);
      name = "memory.max";
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      base = fs::path(sysfs) / "memory";
      name = "memory.limit_in_bytes";
    } else {
      continue;
    }
    for (;;) {
      take(base / group / name);
      if (group.empty()) break;
      group = group.parent_path();
    }
  }
  return limit;
}

int64_t machine_host_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  const int64_t physical = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
  std::ifstream in("/proc/self/cgroup");
  const std::string groups((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const int64_t capped = cgroup_memory_limit("/sys/fs/cgroup", groups);
  return capped > 0 && (physical == 0 || capped < physical) ? capped : physical;
}

int64_t machine_device_memory(const std::string& device, int index) {
  if (device == "cpu") return machine_host_memory();
#ifdef SPINDLE_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || index < 0 || index >= count) {
    cudaGetLastError();
    return 0;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) return 0;
  return static_cast<int64_t>(prop.totalGlobalMem);
#else
  (void)index;
  return 0;
#endif
}

int machine_multiprocessors(int index) {
#ifdef SPINDLE_WITH_CUDA
  int count = 0, sms = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && index >= 0 && index < count &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, index) == cudaSuccess && sms > 0)
    return sms;
  cudaGetLastError();
#else
  (void)index;
#endif
  return kDefaultMultiprocessors;
}

RecomputeSetting most_frugal_setting(const PlanOptions& base) {
  return {"all", -1, true, kFewestOffloadLayers, candidate_tiles(base, ModelConfig::from_file(base.model)).back()};
}

bool plan_fits(const PlanOptions& base, RecomputeSetting& setting, int64_t seq, int64_t usable_bytes, Planned& planned,
               int& plans, int64_t min_offload_layers) {
  if (!setting.offload || setting.offload_layers != kFewestOffloadLayers) {
    planned = plan_with(base, setting, seq);
    ++plans;
    return fits(planned, usable_bytes, base);
  }
  // Layers that can offload: the recomputed ones but the last layer (model/decoder.h).
  const int64_t layers = ModelConfig::from_file(base.model).num_layers;
  const int64_t recomputed = setting.recompute_layers < 0 ? layers : setting.recompute_layers;
  const int64_t most = std::min(recomputed, layers - 1);
  auto with = [&](int64_t m) {
    RecomputeSetting s = setting;
    s.offload = m > 0;
    s.offload_layers = m >= most ? -1 : m;
    return s;
  };
  auto device_fits = [&](int64_t m, Planned& p) {
    p = plan_with(base, with(m), seq);
    ++plans;
    return p.peak <= usable_bytes;
  };
  // Every offloadable layer first: the least the device can hold. Then the fewest that still fit.
  int64_t hi = most;
  if (!device_fits(hi, planned) || most < min_offload_layers) {
    setting = with(most);
    return false;
  }
  int64_t lo = min_offload_layers - 1;  // lo does not fit (or is below the range), hi fits
  Planned hi_plan = planned;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    Planned p;
    if (device_fits(mid, p)) {
      hi = mid;
      hi_plan = p;
    } else {
      lo = mid;
    }
  }
  setting = with(hi);
  planned = hi_plan;
  return fits(planned, usable_bytes, base);
}

std::string RecomputeSetting::describe() const {
  std::string s = recompute;
  if (recompute != "none" && recompute_layers >= 0) s += fmt::format(" on the first {} layers", recompute_layers);
  if (offload && offload_layers == kFewestOffloadLayers)
    s += ", activations of the fewest first layers that fit offloaded to host memory";
  else if (offload && offload_layers >= 0)
    s += fmt::format(", activations of the first {} layers offloaded to host memory", offload_layers);
  else if (offload) s += ", activations offloaded to host memory";
  if (mlp_tile_tokens > 0) s += fmt::format(", MLP in {}-token tiles", mlp_tile_tokens);
  if (checkpoint_stride > 1)
    s += fmt::format(", one layer input kept in {} (--checkpoint-stride {})", checkpoint_stride, checkpoint_stride);
  return s;
}

std::string AutoChoice::summary(int64_t num_layers) const {
  (void)num_layers;
  std::string s = fmt::format("--recompute auto: {} (planned peak {} per device of {}, {} usable after the margin",
                              setting.describe(), format_bytes(peak_bytes), format_bytes(device_bytes),
                              format_bytes(usable_bytes));
  if (setting.offload) s += fmt::format("; {} of host memory", format_bytes(host_bytes));
  return s + fmt::format("; predicted step {:.3f} s on {}; {} settings planned)", predicted_step_s, device_kind,
                         candidates_planned);
}

int64_t longest_fitting_seq(const PlanOptions& base, const RecomputeSetting& setting, int64_t usable_bytes,
                            int64_t limit, int64_t* peak_bytes, int64_t* host_bytes, RecomputeSetting* chosen) {
  const ModelConfig config = ModelConfig::from_file(base.model);
  parallel::MeshFlags flags;
  if (base.dp) flags.dp = base.dp;
  if (base.sp) flags.sp = base.sp;
  if (base.ulysses) flags.ulysses = base.ulysses;
  if (base.ring) flags.ring = base.ring;
  const int64_t step = parallel::sequence_multiple(parallel::resolve_mesh(
      flags, base.world, static_cast<int>(config.num_heads), static_cast<int>(config.num_kv_heads)));
  // Whether a length fits (host memory of offload within host_budget); the plan and the setting of
  // the longest that does so far.
  Planned lo_plan;
  RecomputeSetting lo_setting = setting;
  int plans = 0;
  auto fits_at = [&](int64_t units) {
    RecomputeSetting s = setting;
    Planned p;
    if (!plan_fits(base, s, units * step, usable_bytes, p, plans)) return false;
    lo_plan = p;
    lo_setting = s;
    return true;
  };
  auto done = [&](int64_t units) {
    if (peak_bytes) *peak_bytes = lo_plan.peak;
    if (host_bytes) *host_bytes = lo_plan.host;
    if (chosen) *chosen = lo_setting;
    return units * step;
  };
  int64_t lo = 0, hi = 1;  // lo·step fits (0: none known), hi·step is the next to try
  const int64_t most = limit / step;
  while (hi <= most) {  // doubling
    if (!fits_at(hi)) break;
    lo = hi;
    hi = hi * 2;
  }
  if (hi > most) {
    if (lo == most || most == 0) return done(lo);
    hi = most + 1;  // most itself is untried: bisect up to it
  }
  while (hi - lo > 1) {  // bisection: lo fits, hi does not (or is past the limit)
    const int64_t mid = lo + (hi - lo) / 2;
    if (fits_at(mid)) lo = mid;
    else hi = mid;
  }
  return done(lo);
}

int64_t longest_fitting_seq_auto(const PlanOptions& base, int64_t usable_bytes, int64_t limit, int64_t* peak_bytes,
                                 int64_t* host_bytes, RecomputeSetting* chosen, int64_t* every_input_kept) {
  RecomputeSetting setting = most_frugal_setting(base);
  std::vector<int64_t> strides{1};
  strides.insert(strides.end(), std::begin(kAutoCheckpointStrides), std::end(kAutoCheckpointStrides));
  int64_t longest = 0;
  for (int64_t stride : strides) {
    setting.checkpoint_stride = stride;
    int64_t peak = 0, host = 0;
    RecomputeSetting fitted = setting;
    const int64_t n = longest_fitting_seq(base, setting, usable_bytes, limit, &peak, &host, &fitted);
    if (stride == 1 && every_input_kept) *every_input_kept = n;
    if (stride == 1 || n > longest) {  // keeping every input wins ties: it runs no layer a third time
      longest = n;
      if (peak_bytes) *peak_bytes = peak;
      if (host_bytes) *host_bytes = host;
      if (chosen) *chosen = fitted;
    }
    if (longest == limit) break;  // nothing can reach further
  }
  return longest;
}

std::vector<RankedSetting> rank_recompute_settings(const PlanOptions& base, int64_t seq, bool offload_only,
                                                   int* plans) {
  const ModelConfig config = ModelConfig::from_file(base.model);
  const int64_t layers = config.num_layers;
  const DeviceRates rates = plan_rates(base);
  int planned = 0;
  // Each layer's time with each mode on every layer, per tiling: a setting recomputing the first N
  // layers runs their windows as that mode's plan does and the others' as none's; what runs outside
  // the layers' windows (embedding, LM head, loss) is the same for every setting.
  struct ModeTimes {
    StepTime none, keep_attention, all;
  };
  std::map<int64_t, ModeTimes> by_tile;
  auto time_of = [&](const RecomputeSetting& s) {
    ++planned;
    return plan_with(base, s, seq).time;
  };
  const std::vector<int64_t> tiles = candidate_tiles(base, config);
  for (int64_t tile : tiles) {
    ModeTimes& m = by_tile[tile];
    m.none = time_of({"none", -1, false, -1, tile, 1});
    m.keep_attention = time_of({"keep-attention", -1, false, -1, tile, 1});
    m.all = time_of({"all", -1, false, -1, tile, 1});
  }
  // The layers' times of a setting (its own step, offload's copies aside).
  auto layer_times = [&](const RecomputeSetting& s) {
    const ModeTimes& m = by_tile.at(s.mlp_tile_tokens);
    const StepTime& mode = s.recompute == "all" ? m.all : s.recompute == "keep-attention" ? m.keep_attention : m.none;
    const int64_t n = s.recompute == "none" ? 0 : s.recompute_layers < 0 ? layers : s.recompute_layers;
    StepTime t;
    t.outside_layers_s = m.none.outside_layers_s;
    for (int64_t l = 0; l < layers; ++l) {
      const StepTime& from = l < n ? mode : m.none;
      t.layer_forward_s.push_back(from.layer_forward_s.at(static_cast<size_t>(l)));
      t.layer_backward_s.push_back(from.layer_backward_s.at(static_cast<size_t>(l)));
    }
    return t;
  };
  auto step_seconds = [](const StepTime& t) {
    double total = t.outside_layers_s;
    for (size_t l = 0; l < t.layer_forward_s.size(); ++l) total += t.layer_forward_s[l] + t.layer_backward_s[l];
    return total;
  };

  std::vector<RankedSetting> candidates;
  std::map<std::pair<int64_t, int64_t>, StepTime> strided;  // (tile, stride): planned as a whole
  auto add = [&](const std::string& mode, int64_t n, bool offload, int64_t tile, int64_t stride = 1) {
    RankedSetting c;
    c.setting = {mode, mode == "none" || n == layers ? -1 : n, offload, offload ? kFewestOffloadLayers : -1, tile,
                 stride};
    StepTime t;
    if (stride > 1) {
      // Regenerated inputs rerun whole forwards inside other layers' backward windows: planned whole.
      auto it = strided.find({tile, stride});
      if (it == strided.end()) it = strided.emplace(std::pair{tile, stride}, time_of({mode, -1, false, -1, tile, stride})).first;
      t = it->second;
      c.seconds = t.total_s();
    } else {
      t = layer_times(c.setting);
      c.seconds = step_seconds(t);
    }
    c.seconds += unhidden_copy_seconds(base, config, c.setting, t, rates, seq);
    candidates.push_back(c);
  };
  for (int64_t tile : tiles)
    for (bool offload : {false, true}) {
      if (offload ? false : offload_only) continue;
      if (!offload) add("none", 0, false, tile);
      for (const char* mode : {"keep-attention", "all"})
        for (int64_t n = 1; n <= layers; ++n) add(mode, n, offload, tile);
      for (int64_t stride : kAutoCheckpointStrides)
        if (stride < layers) add("all", layers, offload, tile, stride);
    }
  // Fastest first within each group: every untiled setting before the tiled ones (auto), sparse
  // checkpoints after every setting that keeps each recomputed layer's input; at equal times the
  // setting without offload first (it needs no host memory).
  std::stable_sort(candidates.begin(), candidates.end(), [](const RankedSetting& a, const RankedSetting& b) {
    if ((a.setting.checkpoint_stride > 1) != (b.setting.checkpoint_stride > 1)) return a.setting.checkpoint_stride == 1;
    if ((a.setting.mlp_tile_tokens > 0) != (b.setting.mlp_tile_tokens > 0)) return a.setting.mlp_tile_tokens == 0;
    if (a.seconds != b.seconds) return a.seconds < b.seconds;
    return !a.setting.offload && b.setting.offload;
  });
  if (plans) *plans += planned;
  return candidates;
}

AutoChoice choose_recompute(const PlanOptions& base, int64_t seq, int64_t device_bytes, bool offload_only) {
  if (device_bytes <= 0)
    fail("--recompute auto needs the device's memory: give --device-memory (bytes or e.g. 80GiB)");
  const ModelConfig config = ModelConfig::from_file(base.model);
  AutoChoice choice;
  choice.device_bytes = device_bytes;
  choice.usable_bytes = usable_memory(device_bytes, base.device);

  const std::vector<RankedSetting> ranked =
      rank_recompute_settings(base, seq, offload_only, &choice.candidates_planned);
  choice.device_kind = plan_rates(base).kind;
  Planned least{};
  for (const RankedSetting& c : ranked) {
    RecomputeSetting setting = c.setting;
    Planned p;
    // With offload at least one layer: a setting that fits without was planned before.
    if (plan_fits(base, setting, seq, choice.usable_bytes, p, choice.candidates_planned, 1)) {
      choice.setting = setting;
      choice.peak_bytes = p.peak;
      choice.host_bytes = p.host;
      choice.predicted_step_s = c.seconds;
      return choice;
    }
    if (least.peak == 0 || p.peak < least.peak) least = p;
  }

  // Nothing fits: what would, with the setting that needs least (all, offloaded, tiled when allowed).
  const RecomputeSetting smallest = most_frugal_setting(base);
  std::string would;
  parallel::MeshFlags flags;
  if (base.dp) flags.dp = base.dp;
  if (base.sp) flags.sp = base.sp;
  if (base.ulysses) flags.ulysses = base.ulysses;
  if (base.ring) flags.ring = base.ring;
  const parallel::MeshConfig mesh = parallel::resolve_mesh(flags, base.world, static_cast<int>(config.num_heads),
                                                           static_cast<int>(config.num_kv_heads));
  for (int sp = mesh.sp * 2; sp <= 64 && would.empty(); sp *= 2) {
    PlanOptions o = base;
    o.world = mesh.dp * sp;
    o.sp = sp;
    o.ulysses = o.ring = 0;
    o.dp = mesh.dp;
    try {
      parallel::MeshFlags wider;
      wider.dp = mesh.dp;
      wider.sp = sp;
      if (seq % parallel::sequence_multiple(parallel::resolve_mesh(wider, o.world, static_cast<int>(config.num_heads),
                                                                   static_cast<int>(config.num_kv_heads))) != 0)
        continue;
      RecomputeSetting wider_setting = smallest;
      Planned p;
      int plans = 0;
      if (plan_fits(o, wider_setting, seq, choice.usable_bytes, p, plans))
        would = fmt::format("--sp {} over {} processes ({} per device, recompute {})", sp, o.world,
                            format_bytes(p.peak), wider_setting.describe());
    } catch (const Error&) {
      // a mesh the heads do not allow: try the next
    }
  }
  RecomputeSetting longest_setting = smallest;
  const int64_t fits =
      longest_fitting_seq_auto(base, choice.usable_bytes, seq, nullptr, nullptr, &longest_setting);
  const std::string longest =
      fits > 0 ? fmt::format("--seq {} (the longest that fits on this mesh, recompute {})", fits,
                             longest_setting.describe())
             : std::string("no length on this mesh (the weights and optimizer state alone do not fit)");
  fail("--recompute auto: no setting fits {} per device ({} usable after the margin, docs/memory.md) at {} tokens: "
       "the one needing least plans {}. It would fit with {}{}",
       format_bytes(device_bytes), format_bytes(choice.usable_bytes), seq, format_bytes(least.peak),
       would.empty() ? "" : would + ", or with ", longest);
}

}  // namespace spindle::plan
