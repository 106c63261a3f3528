// What every training-like command (sft, check, dpo) sets up the same way: the device and the
// processes, the data every rank reads, the decoder options, the threads of each process (the model
// itself: train/run_assembly.h).
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_options.h"
#include "data/packing.h"
#include "model/decoder.h"
#include "model/weights.h"
#include "train/data_loader.h"
#include "train/step_runner.h"
#include "train/train_config.h"

namespace spindle {

// Where this process computes: --device (auto: CUDA when spindle has the CUDA backend and a GPU is
// visible), the GPU of its LOCAL_RANK, and the compute dtype (--dtype auto: F32 on the CPU, BF16
// storage with F32 accumulation on CUDA), and on CUDA the backend's options (--attention).
struct ComputeDevice {
  bool cuda = false;
  int index = 0;
  DType dtype = DType::F32;
  CudaBackendOptions cuda_options;
  std::string describe() const;  // "CUDA device 1, bf16" / "CPU, f32"
};
ComputeDevice choose_device(const TrainConfig& config, const ProcessGroupInfo& process);
// The same from the two flags alone (eval, generate: one process).
ComputeDevice choose_device(const std::string& device, const std::string& dtype, const ProcessGroupInfo& process);
std::unique_ptr<Backend> make_backend(const ComputeDevice& device, int cpu_threads);
// The mesh and process groups for this device (NCCL between GPUs, Gloo between CPU processes).
RunTopology connect_training_run(const TrainConfig& config, const ModelConfig& model, const ComputeDevice& device);
// What connect_training_run resolves on every rank of a `world_size`-process job, checked once
// before the launcher starts them: the mesh flags against that count and the heads in the
// config.json of `model` (a folder or the file; --model, or --ref-model whose heads share the mesh).
// `option` names the flag in errors.
void check_mesh_before_launch(const parallel::MeshFlags& flags, const std::string& model, int world_size,
                              const char* option = "--model");

struct TrainingData {
  std::vector<DataSource> sources;  // prepared datasets with their mixing weights
  std::filesystem::path eval;       // prepared --eval-data, or empty
};

class RunOutputClaim;

// JSONL inputs are tokenized once into OUTPUT/data/<name> by the main rank; prepared datasets are
// used as they are, and a dataset the run tokenized in an earlier session (same input, tokenizer and
// options: OUTPUT/data/<name>/prepared_from.json) is read again. The other ranks only learn the
// paths. Not collective: the main rank calls it inside on_main_rank. `claim`: told what is created.
TrainingData training_data(const TrainConfig& config, const RunTopology& run, RunOutputClaim* claim);
// The same, collective over the run's world: the others wait for the main rank (spindle check).
TrainingData prepare_training_data(const TrainConfig& config, const RunTopology& run);

// Collective: `work` runs on the main rank while the others wait; if it throws, every rank throws
// (the main rank its own error, the others one saying the main rank stopped the run), so no rank
// waits for a rank that gave up.
void on_main_rank(Backend& backend, const RunTopology& run, const std::function<void()>& work);

PackOptions pack_options(const TrainConfig& config);

// CPU threads for this process: --threads, else the machine's cores shared by its processes.
int threads_per_process(const TrainConfig& config, const RunTopology& run);
// The threads a CPU backend made with `requested` threads computes on (0: OpenMP's default,
// OMP_NUM_THREADS or the machine's cores).
int effective_cpu_threads(int requested);

// The decoder's memory options from --recompute, --recompute-layers, --offload, --offload-layers,
// --mlp-tile-tokens and --checkpoint-stride, checked.
DecoderOptions decoder_options(const TrainConfig& config, const ModelConfig& model_config);

// Rows of a prepared dataset, packed as training packs them (for evaluation).
std::vector<PackedRow> load_rows(const std::filesystem::path& prepared, const PackOptions& pack);

}  // namespace spindle
