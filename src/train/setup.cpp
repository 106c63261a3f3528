#include "train/setup.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <unistd.h>
#include <thread>

#include "core/error.h"
#include "data/dataset_files.h"
#include "data/prepared_dataset.h"
#include "data/sample_encoder.h"
#include "io/checkpoint.h"
#include "parallel/sp_attention.h"
#include "train/metrics.h"
#include "train/run_assembly.h"
#include "train/run_folder.h"
#if SPINDLE_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace spindle {

namespace fs = std::filesystem;

namespace {

bool is_prepared(const fs::path& p) {
  return (fs::is_directory(p) && fs::exists(p / kPreparedDataFile)) || p.extension() == ".bin";
}

// Beside a dataset tokenized into OUTPUT/data/<name>: what it was made from. A later session of the
// run (--resume) finds the same record and reads the dataset instead of tokenizing again.
constexpr const char* kPreparedFromFile = "prepared_from.json";

nlohmann::ordered_json preparation_record(const TrainConfig& config, const fs::path& input) {
  nlohmann::ordered_json j;
  j["input"] = data_fingerprint(input.string());
  j["max_length"] = config.max_length;
  j["over_length"] = config.over_length;
  j["skip_bad_samples"] = config.skip_bad_samples;
  j["format"] = config.format;
  for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
    if (fs::exists(fs::path(config.tokenizer_folder()) / file))
      j["tokenizer"][file] = file_fingerprint(fs::path(config.tokenizer_folder()) / file);
  return j;
}

bool prepared_from(const fs::path& folder, const nlohmann::ordered_json& record) {
  std::ifstream in(folder / kPreparedFromFile);
  if (!in || !fs::exists(folder / kPreparedDataFile)) return false;
  const nlohmann::ordered_json stored = nlohmann::ordered_json::parse(in, nullptr, /*allow_exceptions=*/false);
  return stored == record;
}

// JSONL inputs are tokenized once into OUTPUT/data/<name>; prepared datasets are used as they are.
// Only the main rank (build = true) tokenizes, into a staging folder renamed into place when whole;
// the others get the folder it writes to.
fs::path prepared_path(const TrainConfig& config, const DataSource& input, const std::string& name,
                       const std::function<const TextEncoder*()>& encoder, bool build, RunOutputClaim* claim) {
  if (is_prepared(input.path)) return input.path;
  (void)resolve_dataset(input.path.string());  // a path, a folder's split or a hub id (data/dataset_files.h)
  const fs::path data_folder = fs::path(config.output) / "data";
  const fs::path target = data_folder / name;
  if (!build) return target;
  const nlohmann::ordered_json record = preparation_record(config, input.path);
  if (prepared_from(target, record)) {
    std::fprintf(stderr, "%s: tokenized earlier into %s, read from there\n", input.name().c_str(), target.string().c_str());
    return target;
  }
  if (!fs::exists(data_folder) && claim) claim->created(data_folder);
  fs::path staging = data_folder / fmt::format(".{}.tmp.{}", name, getpid());
  fs::remove_all(staging);
  PrepareOptions options;
  options.data = input.path;
  options.output_dir = staging;
  options.encode.format = parse_sample_format(config.format);
  options.encode.read.on_bad_sample = config.skip_bad_samples ? BadSamplePolicy::kSkip : BadSamplePolicy::kFail;
  options.fit.max_length = config.max_length;
  options.fit.over_length = parse_over_length(config.over_length);
  options.tokenizer_description = config.tokenizer_folder();
  try {
    PrepareReport report = prepare_dataset(options, encoder());
    train::write_file_atomically(staging / kPreparedFromFile, record.dump(1) + "\n");
    fs::remove_all(target);
    fs::rename(staging, target);
    if (claim) claim->created(target);
    report.file = target / kPreparedDataFile;
    std::fprintf(stderr, "%s: %s\n", input.name().c_str(), report.summary().c_str());
  } catch (...) {
    std::error_code error;
    fs::remove_all(staging, error);
    throw;
  }
  return target;
}

}  // namespace

PackOptions pack_options(const TrainConfig& config) {
  PackOptions pack;
  pack.max_length = config.max_length;
  pack.packing = !config.no_packing;
  pack.over_length = parse_over_length(config.over_length);
  return pack;
}


std::string ComputeDevice::describe() const {
  return cuda ? fmt::format("CUDA device {}, {}", index, dtype_name(dtype)) : fmt::format("CPU, {}", dtype_name(dtype));
}

ComputeDevice choose_device(const TrainConfig& config, const ProcessGroupInfo& process) {
  ComputeDevice device = choose_device(config.device, config.dtype, process);
  device.cuda_options.attention = parse_cuda_attention(config.attention);
  if (!device.cuda)
    check_cuda_attention_off_gpu(device.cuda_options.attention,
                                 config.device == "cpu" ? "--device cpu" : "no GPU is visible to --device auto");
  return device;
}

ComputeDevice choose_device(const std::string& device_flag, const std::string& dtype_flag,
                            const ProcessGroupInfo& process) {
  ComputeDevice device;
#if SPINDLE_WITH_CUDA
  const int gpus = cuda_device_count();
#else
  const int gpus = 0;
#endif
  if (device_flag == "cuda" && gpus == 0) {
#if SPINDLE_WITH_CUDA
    fail("--device cuda: no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES and the driver)");
#else
    fail("--device cuda: this spindle was built without the CUDA backend (rebuild where nvcc is installed)");
#endif
  }
  device.cuda = device_flag == "cuda" || (device_flag == "auto" && gpus > 0);
  if (device.cuda) {
    device.index = process.local_rank;
    if (device.index >= gpus)
      fail("local rank {} has no GPU: {} CUDA devices are visible and each process takes the one of its local rank; "
           "start at most {} processes per machine",
           process.local_rank, gpus, gpus);
    if (dtype_flag == "f64") fail("--dtype f64 is a CPU precision; on CUDA choose bf16 (default) or f32");
    // f32 on CUDA: a slower accuracy reference (same kernels, F32 storage), for checks and debugging.
    device.dtype = dtype_flag == "f32" ? DType::F32 : DType::BF16;
  } else {
    if (dtype_flag == "bf16") fail("--dtype bf16 needs --device cuda; the CPU reference computes in f32 or f64");
    device.dtype = dtype_flag == "f64" ? DType::F64 : DType::F32;
  }
  return device;
}

std::unique_ptr<Backend> make_backend(const ComputeDevice& device, int cpu_threads) {
  if (device.cuda) {
#if SPINDLE_WITH_CUDA
    return make_cuda_backend(device.index, device.cuda_options);
#else
    fail("--device cuda: this spindle was built without the CUDA backend (rebuild where nvcc is installed)");
#endif
  }
  return make_cpu_backend(cpu_threads);
}

RunTopology connect_training_run(const TrainConfig& config, const ModelConfig& model, const ComputeDevice& device) {
  return connect_run(config.mesh_flags(), static_cast<int>(model.num_heads), static_cast<int>(model.num_kv_heads),
                     device.cuda ? device.index : -1);
}

void check_mesh_before_launch(const parallel::MeshFlags& flags, const std::string& model, int world_size,
                              const char* option) {
  if (model.empty()) fail("{} is required: a Hugging Face model folder", option);
  const ModelConfig config = ModelConfig::from_file(model);
  // Throws naming the flags when the mesh does not fit the world or the model's heads.
  (void)parallel::resolve_mesh(flags, world_size, static_cast<int>(config.num_heads),
                               static_cast<int>(config.num_kv_heads));
}

TrainingData training_data(const TrainConfig& config, const RunTopology& run, RunOutputClaim* claim) {
  const bool main_rank = run.is_main();
  // The tokenizer loads only when a dataset has to be tokenized (not for prepared or reused ones).
  std::unique_ptr<TextEncoder> loaded;
  auto encoder = [&]() -> const TextEncoder* {
    if (!loaded && fs::exists(fs::path(config.tokenizer_folder()) / "tokenizer.json"))
      loaded = load_text_encoder(config.tokenizer_folder());
    return loaded.get();
  };
  TrainingData data;
  for (size_t i = 0; i < config.data.size(); ++i) {
    DataSource src = parse_data_spec(config.data[i]);
    src.path = prepared_path(config, src, fmt::format("train-{}", i), encoder, main_rank, claim);
    data.sources.push_back(src);
  }
  if (!config.eval_data.empty())
    data.eval = prepared_path(config, DataSource{config.eval_data, 1.0, config.eval_data}, "eval", encoder, main_rank,
                              claim);
  return data;
}

TrainingData prepare_training_data(const TrainConfig& config, const RunTopology& run) {
  if (run.is_main()) fs::create_directories(config.output);
  TrainingData data = training_data(config, run, nullptr);
  if (run.world) run.world->barrier();
  return data;
}

void on_main_rank(Backend& backend, const RunTopology& run, const std::function<void()>& work) {
  std::exception_ptr failure;
  if (run.is_main()) {
    try {
      work();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (run.world) {
    float failed = failure ? 1.0f : 0.0f;
    Tensor flag = backend.empty(Shape{1}, DType::F32);
    backend.copy_from_host(backend.default_stream(), &failed, flag);
    run.world->all_reduce_sum(backend.default_stream(), flag);
    backend.copy_to_host(backend.default_stream(), flag, &failed);
    if (failed > 0 && !failure) fail("rank 0 stopped the run before training (its message above says why)");
  }
  if (failure) std::rethrow_exception(failure);
}

int threads_per_process(const TrainConfig& config, const RunTopology& run) {
  if (config.threads > 0 || run.process.local_world_size <= 1) return config.threads;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / run.process.local_world_size);
}

int effective_cpu_threads(int requested) {
  if (requested > 0) return requested;
  if (const char* omp = std::getenv("OMP_NUM_THREADS")) {
    const int value = std::atoi(omp);
    if (value > 0) return value;
  }
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

DecoderOptions decoder_options(const TrainConfig& config, const ModelConfig& model_config) {
  const RecomputeMode mode = parse_recompute_mode(config.recompute);
  const bool offload = parse_offload(config.offload, mode);
  check_offload_layers(offload, config.offload_layers);
  check_checkpoint_stride(mode, config.checkpoint_stride);
  return memory_options(mode, model_config.num_layers, config.recompute_layers, offload, config.offload_layers,
                        parse_mlp_tile_tokens(config.mlp_tile_tokens), config.checkpoint_stride);
}

std::vector<PackedRow> load_rows(const fs::path& prepared, const PackOptions& pack) {
  PreparedDataset set = PreparedDataset::open(prepared);
  PackStats stats;
  std::vector<PackedRow> rows;
  for (const RowPlan& plan : plan_prepared_rows(set, pack, stats))
    rows.push_back(build_row(plan, [&](int64_t d) { return set.document(d); }, pack, stats));
  return rows;
}

}  // namespace spindle
