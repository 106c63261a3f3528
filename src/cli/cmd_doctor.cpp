// spindle doctor: whether this machine can run spindle, and for each problem what to do. It looks
// at what a run would use — the GPUs and the kernels this build has for them, the NVIDIA driver and
// the CUDA runtime, cuBLASLt, cuDNN and NCCL as loaded (version and file), host memory and the
// control group's cap, /dev/shm, the launcher's variables (torchrun, SLURM), Parquet support and
// the Hugging Face caches — and changes nothing. --json prints the same as one JSON object.
//
// Exit status: 0 when nothing found stops spindle here (notes and warnings may remain: a machine
// without a GPU runs the CPU backend); 1 when a problem would make a run fail (a GPU this build has
// no kernels for, a driver older than the CUDA runtime, malformed launcher variables); 2 for a
// usage error. docs/usage.md, "spindle doctor".
#include <dlfcn.h>
#include <gnu/libc-version.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "comm/process_group.h"
#include "data/dataset_files.h"
#include "data/table_reader.h"
#include "io/hub_cache.h"
#include "plan/auto_recompute.h"

#if SPINDLE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace spindle::cli {

namespace {

using Json = nlohmann::ordered_json;

bool fs_exists(const std::filesystem::path& path) {
  std::error_code error;
  return std::filesystem::exists(path, error);
}

struct Problem {
  std::string severity;  // "error": a run fails; "warning": it runs, worse; "note": worth knowing
  std::string what;
  std::string fix;
};

std::string gib(int64_t bytes) { return fmt::format("{:.1f} GiB", static_cast<double>(bytes) / (1ull << 30)); }

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}


// The file a loaded symbol comes from (dladdr), or empty.
std::string library_of(void* symbol) {
  Dl_info info{};
  if (symbol && ::dladdr(symbol, &info) && info.dli_fname) return info.dli_fname;
  return "";
}

// A library's version function: from the copy this process loaded (spindle links it), else from
// the copy the system loader would find (this build does not use it then).
struct Library {
  std::string name;
  std::optional<std::string> version;
  std::string file;
  bool linked = false;  // this spindle uses it
};

Library probe_library(const char* name, const char* soname, const char* symbol,
                      const std::function<std::string(void*)>& version_of) {
  Library lib{name, std::nullopt, "", false};
  void* fn = ::dlsym(RTLD_DEFAULT, symbol);
  if (fn) {
    lib.linked = true;
  } else if (void* handle = ::dlopen(soname, RTLD_LAZY | RTLD_LOCAL)) {
    fn = ::dlsym(handle, symbol);
  }
  if (!fn) return lib;
  lib.file = library_of(fn);
  lib.version = version_of(fn);
  return lib;
}

// ---- GPUs ----------------------------------------------------------------------------------------

#if SPINDLE_WITH_CUDA
std::string version_text(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }  // 13000 -> 13.0

struct Gpu {
  int index = 0;
  std::string name;
  int major = 0, minor = 0;
  int64_t memory = 0;
  int multiprocessors = 0;
  std::string pci;
  std::string family;
  bool supported = false;
};

std::string family_of(int major, int minor) {
  if (major == 7 && minor == 5) return "Turing";
  if (major == 8 && minor == 9) return "Ada";
  if (major == 8) return "Ampere";
  if (major == 9) return "Hopper";
  if (major == 10 || major == 11) return "Blackwell (data centre)";
  if (major == 12) return "Blackwell (RTX)";
  return "unknown";
}

// Whether a CMAKE_CUDA_ARCHITECTURES entry ("90a", "100f", "80", "90a-real") has code for a GPU of
// compute capability major.minor: "a" targets run on exactly that GPU, "f" targets on the family
// (same major, minor at least), plain SASS on the same major with minor at least.
bool architecture_runs(std::string arch, int major, int minor) {
  if (auto dash = arch.find('-'); dash != std::string::npos) arch.erase(dash);
  char suffix = 0;
  if (!arch.empty() && (arch.back() == 'a' || arch.back() == 'f')) suffix = arch.back(), arch.pop_back();
  int number = 0;
  try {
    number = std::stoi(arch);
  } catch (const std::exception&) {
    return false;
  }
  const int a_major = number / 10, a_minor = number % 10;
  if (suffix == 'a') return a_major == major && a_minor == minor;
  return a_major == major && a_minor <= minor;
}

#endif

std::vector<std::string> split_list(const std::string& text, char separator) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, separator))
    if (!item.empty()) out.push_back(item);
  return out;
}

#ifndef SPINDLE_CUDA_ARCHITECTURES
#define SPINDLE_CUDA_ARCHITECTURES ""
#endif

struct Report {
  Json json;
  std::vector<std::string> text;
  std::vector<Problem> problems;
  void line(const std::string& s) { text.push_back(s); }
  void problem(std::string severity, std::string what, std::string fix) {
    problems.push_back({std::move(severity), std::move(what), std::move(fix)});
  }
};

void check_gpus(Report& r) {
  Json gpus = Json::array();
  Json cuda;
  r.line("GPUs");
  const std::string driver_line = read_first_line("/proc/driver/nvidia/version");
  std::string driver;
  if (auto at = driver_line.find("Kernel Module"); at != std::string::npos) {
    std::istringstream words(driver_line.substr(at + 13));
    words >> driver;
  }
  cuda["driver"] = driver.empty() ? Json(nullptr) : Json(driver);
#if SPINDLE_WITH_CUDA
  int driver_cuda = 0, runtime = 0;
  cudaDriverGetVersion(&driver_cuda);
  cudaRuntimeGetVersion(&runtime);
  cuda["driver_supports_cuda"] = driver_cuda ? Json(version_text(driver_cuda)) : Json(nullptr);
  cuda["runtime"] = version_text(runtime);
  cuda["runtime_library"] = library_of(reinterpret_cast<void*>(&cudaRuntimeGetVersion));
  cuda["architectures"] = SPINDLE_CUDA_ARCHITECTURES;
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    count = 0;
    cudaGetLastError();
  }
  const std::vector<std::string> archs = split_list(SPINDLE_CUDA_ARCHITECTURES, ',');
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    Gpu g;
    g.index = i;
    g.name = p.name;
    g.major = p.major;
    g.minor = p.minor;
    g.memory = static_cast<int64_t>(p.totalGlobalMem);
    g.multiprocessors = p.multiProcessorCount;
    g.pci = fmt::format("{:04x}:{:02x}:{:02x}.0", p.pciDomainID, p.pciBusID, p.pciDeviceID);
    g.family = family_of(g.major, g.minor);
    for (const std::string& a : archs) g.supported |= architecture_runs(a, g.major, g.minor);
    r.line(fmt::format("  GPU {}: {}, compute capability {}.{} ({}), {}, {} SMs, PCI {}", i, g.name, g.major, g.minor,
                       g.family, gib(g.memory), g.multiprocessors, g.pci));
    r.line(fmt::format("         kernels: {}", g.supported
                                                  ? fmt::format("this build's {} kernels (sm_{})", g.family,
                                                                SPINDLE_CUDA_ARCHITECTURES)
                                                  : "none in this build: not supported yet"));
    gpus.push_back({{"index", i}, {"name", g.name}, {"compute_capability", fmt::format("{}.{}", g.major, g.minor)},
                    {"family", g.family}, {"memory_bytes", g.memory}, {"multiprocessors", g.multiprocessors},
                    {"pci_bus_id", g.pci}, {"kernels", g.supported ? SPINDLE_CUDA_ARCHITECTURES : ""},
                    {"supported", g.supported}});
    if (!g.supported)
      r.problem("error",
                fmt::format("GPU {} ({}, compute capability {}.{}, {}) is not supported yet: this spindle's CUDA "
                            "kernels are built for sm_{} only (CMAKE_CUDA_ARCHITECTURES), and its attention and MoE "
                            "kernels use Hopper-only instructions (wgmma, TMA), so a CUDA run would fail at its "
                            "first kernel",
                            i, g.name, g.major, g.minor, g.family, SPINDLE_CUDA_ARCHITECTURES),
                "run on a Hopper GPU (compute capability 9.0), or on this machine use --device cpu (the CPU "
                "reference backend: exact but slow, for small models and tests); kernels for Ampere, Ada and "
                "Blackwell are planned");
  }
  if (count == 0) {
    std::string why;
    if (status == cudaErrorInsufficientDriver && driver.empty())
      why = "no NVIDIA driver is loaded (no /proc/driver/nvidia/version)";
    else if (status == cudaErrorInsufficientDriver)
      why = fmt::format("the NVIDIA driver {} is older than this spindle's CUDA runtime {}", driver,
                        version_text(runtime));
    else if (status == cudaErrorNoDevice)
      why = driver.empty() ? "no NVIDIA driver and no CUDA device" : "the driver sees no CUDA device";
    else if (status != cudaSuccess)
      why = fmt::format("the CUDA runtime reports: {}", cudaGetErrorString(status));
    else
      why = "the driver reports none";
    if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"))
      why += fmt::format("; CUDA_VISIBLE_DEVICES='{}'", visible);
    r.line("  none visible: " + why);
    r.json["gpu_status"] = why;
    const bool driver_problem = status == cudaErrorInsufficientDriver && !driver.empty();
    r.problem(driver_problem ? "error" : "note", "no GPU: " + why + ". spindle runs here on its CPU backend only",
              driver_problem ? "update the NVIDIA driver to R580 or newer (CUDA 13 needs it)"
                             : "for real training run on a machine with an NVIDIA Hopper GPU (H100, H200); the CPU "
                               "backend (--device cpu, chosen by --device auto here) is exact but slow: tests, small "
                               "models, the demo");
  }
  if (driver_cuda && runtime && driver_cuda < runtime)
    r.problem("error",
              fmt::format("the NVIDIA driver {} supports CUDA up to {}, older than the CUDA runtime {} spindle uses",
                          driver.empty() ? "" : driver, version_text(driver_cuda), version_text(runtime)),
              "update the NVIDIA driver (CUDA 13 needs R580 or newer)");
  r.line("");
  r.line("CUDA");
  r.line(fmt::format("  driver: {}{}", driver.empty() ? "none loaded" : driver,
                     driver_cuda ? fmt::format(" (supports CUDA up to {})", version_text(driver_cuda)) : ""));
  r.line(fmt::format("  runtime: CUDA {} ({})", version_text(runtime), cuda["runtime_library"].get<std::string>()));
  r.line(fmt::format("  kernels built for: sm_{}", SPINDLE_CUDA_ARCHITECTURES));
#else
  cuda["runtime"] = nullptr;
  r.line("  this spindle was built without the CUDA backend (no nvcc at build time): it runs on the CPU only");
  r.json["gpu_status"] = "built without the CUDA backend";
  const bool has_driver = !driver.empty();
  r.problem(has_driver ? "error" : "note",
            has_driver ? fmt::format("this machine has the NVIDIA driver {} but spindle was built without CUDA", driver)
                       : "no GPU support: this spindle was built without the CUDA backend",
            "rebuild where the CUDA toolkit (nvcc) is installed: make");
  r.line("");
  r.line("CUDA");
  r.line(fmt::format("  driver: {}", driver.empty() ? "none loaded" : driver));
#endif
  // The libraries as this process loaded them (or as the system loader would find them).
  auto cudnn = probe_library("cuDNN", "libcudnn.so.9", "cudnnGetVersion", [](void* fn) {
    const size_t v = reinterpret_cast<size_t (*)()>(fn)();
    return fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
  });
  auto nccl = probe_library("NCCL", "libnccl.so.2", "ncclGetVersion", [](void* fn) {
    int v = 0;
    reinterpret_cast<int (*)(int*)>(fn)(&v);
    return fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
  });
  auto cublaslt = probe_library("cuBLASLt", "libcublasLt.so.13", "cublasLtGetVersion", [](void* fn) {
    const size_t v = reinterpret_cast<size_t (*)()>(fn)();
    return fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
  });
  Json libraries;
  for (const Library* lib : {&cublaslt, &cudnn, &nccl}) {
    libraries[lib->name] = {{"version", lib->version ? Json(*lib->version) : Json(nullptr)},
                            {"library", lib->file.empty() ? Json(nullptr) : Json(lib->file)},
                            {"used_by_this_build", lib->linked}};
    r.line(fmt::format("  {}: {}", lib->name,
                       !lib->version ? "not found"
                                     : fmt::format("{} ({}){}", *lib->version, lib->file,
                                                   lib->linked ? "" : ", not used by this build")));
  }
#if SPINDLE_WITH_CUDA
  if (!cudnn.linked)
    r.problem("warning", "this spindle was built without cuDNN: attention runs the engine's own kernels",
              "rebuild with cuDNN 9 installed (its cudnn.h and libcudnn found by CMake) for the faster cuDNN attention");
  if (!nccl.linked && gpus.size() > 1)
    r.problem("warning", "this spindle was built without NCCL: a job runs on one GPU only",
              "rebuild with NCCL installed (nccl.h, libnccl)");
#endif
  r.json["gpus"] = gpus;
  r.json["cuda"] = cuda;
  r.json["libraries"] = libraries;
}

// ---- host ------------------------------------------------------------------------------------------

void check_host(Report& r, int gpus) {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  const int64_t physical = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
  int64_t available = 0;
  {
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    int64_t kib = 0;
    std::string unit;
    while (meminfo >> key >> kib >> unit)
      if (key == "MemAvailable:") available = kib * 1024;
  }
  std::ifstream in("/proc/self/cgroup");
  const std::string groups((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int cgroup_version = 0;
  for (const std::string& l : split_list(groups, '\n')) {
    if (l.rfind("0::", 0) == 0) cgroup_version = cgroup_version ? cgroup_version : 2;
    else if (l.find(":memory:") != std::string::npos || l.find(",memory") != std::string::npos) cgroup_version = 1;
  }
  const int64_t limit = plan::cgroup_memory_limit("/sys/fs/cgroup", groups);
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  struct statvfs shm {};
  const int64_t shm_bytes = ::statvfs("/dev/shm", &shm) == 0 ? static_cast<int64_t>(shm.f_bsize) * shm.f_blocks : -1;
  r.line("");
  r.line("Host");
  r.line(fmt::format("  memory: {} ({} available)", gib(physical), gib(available)));
  r.line(fmt::format("  control group: {}",
                     cgroup_version == 0 ? "none found"
                     : limit > 0         ? fmt::format("cgroup v{}, memory capped at {}", cgroup_version, gib(limit))
                                         : fmt::format("cgroup v{}, no memory cap", cgroup_version)));
  r.line(fmt::format("  CPU cores: {}; glibc {}", cpus, gnu_get_libc_version()));
  r.line(fmt::format("  /dev/shm: {}", shm_bytes < 0 ? "missing" : gib(shm_bytes)));
  r.json["host"] = {{"memory_bytes", physical},
                    {"available_bytes", available},
                    {"cgroup", {{"version", cgroup_version ? Json(cgroup_version) : Json(nullptr)},
                                {"memory_limit_bytes", limit > 0 ? Json(limit) : Json(nullptr)}}},
                    {"cpus", cpus},
                    {"glibc", gnu_get_libc_version()},
                    {"shm_bytes", shm_bytes}};
  if (limit > 0 && physical > 0 && limit < physical)
    r.problem("note",
              fmt::format("this process's control group caps memory at {} of the machine's {}: host offload "
                          "(--offload activations) and data loading live within the cap",
                          gib(limit), gib(physical)),
              "ask the scheduler for more memory (SLURM: --mem) if a run needs it; --recompute auto budgets with the "
              "cap");
  if (gpus > 1 && shm_bytes >= 0 && shm_bytes < (int64_t{1} << 30))
    r.problem("warning",
              fmt::format("/dev/shm holds only {}: NCCL moves data between the GPUs of one machine through it and "
                          "fails or slows when it is small (a container's default is 64 MiB)",
                          gib(shm_bytes)),
              "start the container with --ipc=host or --shm-size=16g");
}

// ---- launcher --------------------------------------------------------------------------------------

void check_launcher(Report& r) {
  static const char* kNames[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                 "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS",
                                 "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NNODES", "SLURM_TASKS_PER_NODE",
                                 "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_GPUS_ON_NODE",
                                 "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "SPINDLE_STORE_PORT"};
  Json variables = Json::object();
  for (const char* name : kNames)
    if (const char* v = std::getenv(name)) variables[name] = v;
  for (char** e = ::environ; e && *e; ++e) {  // NCCL's own settings, whatever they are
    const std::string entry = *e;
    if (entry.rfind("NCCL_", 0) == 0 && entry.find('=') != std::string::npos)
      variables[entry.substr(0, entry.find('='))] = entry.substr(entry.find('=') + 1);
  }
  r.line("");
  r.line("Launcher");
  if (variables.empty()) r.line("  no torchrun, SLURM, CUDA or NCCL variables are set");
  for (const auto& [name, value] : variables.items()) r.line(fmt::format("  {}={}", name, value.get<std::string>()));
  Json launcher;
  launcher["variables"] = variables;
  try {
    const ProcessGroupInfo info = process_group_from_environment();
    r.line("  this process: " + (info.distributed() ? info.describe()
                                                    : "one process (start several with --nproc-per-node N, torchrun "
                                                      "or srun)"));
    launcher["source"] = info.source;
    launcher["rank"] = info.rank;
    launcher["world_size"] = info.world_size;
    launcher["local_rank"] = info.local_rank;
    launcher["local_world_size"] = info.local_world_size;
    if (info.distributed()) {
      launcher["master_addr"] = info.master_addr;
      launcher["master_port"] = info.master_port;
    }
    if (variables.contains("SLURM_JOB_ID") && !variables.contains("SLURM_PROCID") && !variables.contains("RANK"))
      r.problem("note",
                "inside a SLURM job but not started by srun: spindle runs as one process unless told otherwise",
                "start each node's processes with srun (one task per GPU), or one spindle per node with "
                "--nproc-per-node N");
  } catch (const Error& e) {
    r.line(std::string("  this process: cannot tell: ") + e.what());
    launcher["error"] = e.what();
    r.problem("error", std::string("the launcher's environment is inconsistent: ") + e.what(),
              "fix or unset the variables it names (docs/parallelism.md lists what spindle reads)");
  }
  r.json["launcher"] = launcher;
}

// ---- data ------------------------------------------------------------------------------------------

void check_data(Report& r) {
  const TableSupport support = table_support();
  const io::HubCacheLocation hub = io::hub_cache_location();
  const DatasetsCacheLocation datasets = datasets_cache_location();
  r.line("");
  r.line("Data");
  r.line(fmt::format("  Parquet and Arrow datasets: {}",
                     support.loaded ? fmt::format("yes (Arrow {}, {})", support.arrow_version, support.plugin)
                                    : "no"));
  r.line(fmt::format("  hub cache: {} ({}{})", hub.path.string(), hub.source,
                     fs_exists(hub.path) ? "" : ", does not exist yet"));
  r.line(fmt::format("  datasets cache: {} ({}{})", datasets.path.string(), datasets.source,
                     fs_exists(datasets.path) ? "" : ", does not exist yet"));
  r.json["data"] = {
      {"parquet", {{"available", support.loaded},
                   {"built", support.built},
                   {"built_against", support.built_against.empty() ? Json(nullptr) : Json(support.built_against)},
                   {"arrow_version", support.loaded ? Json(support.arrow_version) : Json(nullptr)},
                   {"plugin", support.plugin.empty() ? Json(nullptr) : Json(support.plugin)}}},
      {"hub_cache", {{"path", hub.path.string()}, {"source", hub.source}, {"exists", fs_exists(hub.path)}}},
      {"datasets_cache",
       {{"path", datasets.path.string()}, {"source", datasets.source}, {"exists", fs_exists(datasets.path)}}}};
  if (!support.loaded)
    r.problem("warning", "--data cannot read Parquet or Arrow files: " + support.problem,
              support.built ? "reinstall the pyarrow the build used, or rebuild (make)"
                            : "python3 -m pip install pyarrow, then rebuild (make)");
}

int run_doctor(bool json) {
  Report r;
  r.json["spindle"] = {{"version", SPINDLE_VERSION}, {"build", SPINDLE_BUILD_FEATURES}};
  r.line(fmt::format("spindle {} ({})", SPINDLE_VERSION, SPINDLE_BUILD_FEATURES));
  r.line("");
  check_gpus(r);
  check_host(r, static_cast<int>(r.json["gpus"].size()));
  check_launcher(r);
  check_data(r);
  bool errors = false;
  Json problems = Json::array();
  for (const Problem& p : r.problems) {
    errors |= p.severity == "error";
    problems.push_back({{"severity", p.severity}, {"what", p.what}, {"fix", p.fix}});
  }
  r.json["problems"] = problems;
  r.json["ok"] = !errors;
  if (json) {
    std::printf("%s\n", r.json.dump(2).c_str());
  } else {
    r.line("");
    r.line(r.problems.empty() ? "Problems: none" : "Problems");
    for (const Problem& p : r.problems) {
      r.line(fmt::format("  [{}] {}", p.severity, p.what));
      r.line(fmt::format("      fix: {}", p.fix));
    }
    r.line("");
    r.line(errors ? "spindle cannot run as it is here: fix the errors above"
                  : "spindle can run here" + std::string(r.json["gpus"].empty() ? " (on the CPU backend)" : ""));
    for (const std::string& line : r.text) std::printf("%s\n", line.c_str());
  }
  return errors ? 1 : 0;
}

}  // namespace

void add_doctor_command(CLI::App& app, CommandList& commands) {
  auto json = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand(
      "doctor", "Whether this machine can run spindle: GPUs and their kernels, driver, CUDA, cuDNN, NCCL, memory, "
                "launcher, Parquet; each problem with its fix (exit 1 when one would stop a run)");
  cmd->add_flag("--json", *json, "print the report as one JSON object");
  commands.push_back({cmd, [json] { return run_doctor(*json); }});
}

}  // namespace spindle::cli
