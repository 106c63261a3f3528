// spindle generate: greedy decoding on the CPU, for demos and quick checks of a trained model.
//
// There is no KV cache: every new token recomputes the whole sequence with Decoder::logits at its
// last position. That costs O(length²) per sequence, which is nothing for the short prompts this
// command exists for and keeps generation on exactly the forward pass that training and
// `spindle eval` use. Several prompts (--input) are decoded together, one packed document each.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "cli/commands.h"
#include "core/error.h"
#include "data/chat/model_folder.h"
#include "data/tokenizer/tokenizer.h"
#include "io/checkpoint.h"
#include "model/decoder.h"
#include "train/setup.h"

namespace spindle::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

struct GenerateArgs {
  std::string model, adapter, prompt, messages, prompt_ids, input, device = "auto", dtype = "auto";
  int64_t max_new_tokens = 64;
  int64_t batch_tokens = 8192;
  bool chat = false, json_output = false;
  int threads = 0;
  std::string quantize;
  bool double_quant = false;
  int64_t quant_block_size = 64;
};

// One prompt and what has been generated for it so far.
struct Sequence {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> generated;
  std::string stop_reason;  // "eos" or "max_new_tokens" once finished
  bool finished() const { return !stop_reason.empty(); }
};

std::optional<json> read_json_file(const fs::path& path) {
  if (!fs::exists(path)) return std::nullopt;
  std::ifstream in(path);
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail("{} is not valid JSON: {}", path.string(), e.what());
  }
}

void add_token_ids(const json& value, std::set<int32_t>& ids) {
  if (value.is_number_integer()) ids.insert(value.get<int32_t>());
  if (value.is_array())
    for (const json& v : value)
      if (v.is_number_integer()) ids.insert(v.get<int32_t>());
}

// Where transformers' generate() looks for end-of-sequence ids (generation_config.json, else
// config.json), plus the tokenizer's eos_token: chat models often name their end-of-turn token
// only there.
std::set<int32_t> stop_token_ids(const fs::path& model_dir, const Tokenizer* tokenizer) {
  std::set<int32_t> ids;
  if (auto generation = read_json_file(model_dir / "generation_config.json"); generation && generation->contains("eos_token_id"))
    add_token_ids((*generation)["eos_token_id"], ids);
  else if (auto config = read_json_file(model_dir / "config.json"); config && config->contains("eos_token_id"))
    add_token_ids((*config)["eos_token_id"], ids);
  if (tokenizer && tokenizer->eos_token_id()) ids.insert(*tokenizer->eos_token_id());
  return ids;
}

std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what) {
  std::vector<int32_t> ids;
  std::string item;
  std::stringstream stream(text);
  while (std::getline(stream, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty()) continue;
    size_t used = 0;
    int64_t id = -1;
    try {
      id = std::stoll(item, &used);
    } catch (const std::exception&) {
    }
    if (used != item.size() || id < 0 || id > INT32_MAX)
      fail("{}: \"{}\" is not a token id (expected comma-separated non-negative integers)", what, item);
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

class PromptEncoder {
 public:
  PromptEncoder(const fs::path& model_dir, bool chat) : model_dir_(model_dir), chat_(chat) {
    if (fs::exists(model_dir / "tokenizer.json")) tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::load(model_dir.string()));
  }

  const Tokenizer* tokenizer() const { return tokenizer_.get(); }

  // A sample of --input, or the single prompt of the command line in the same shape:
  // {"prompt": TEXT} | {"messages": [...]} | {"input_ids": [...]}.
  std::vector<int32_t> encode(const json& sample, const std::string& where) {
    if (sample.contains("input_ids")) {
      const json& ids = sample["input_ids"];
      if (!ids.is_array() || ids.empty()) fail("{}: \"input_ids\" must be a non-empty array of token ids", where);
      std::vector<int32_t> out;
      for (const json& id : ids) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0) fail("{}: \"input_ids\" holds {}, not a token id", where, id.dump());
        out.push_back(id.get<int32_t>());
      }
      return out;
    }
    if (sample.contains("messages")) {
      if (!sample["messages"].is_array()) fail("{}: \"messages\" must be an array of {{\"role\", \"content\"}} objects", where);
      return encode_chat(sample, where);
    }
    if (sample.contains("prompt")) {
      if (!sample["prompt"].is_string()) fail("{}: \"prompt\" must be a string", where);
      const std::string& text = sample["prompt"].get_ref<const std::string&>();
      if (chat_) return encode_chat(json{{"messages", json::array({{{"role", "user"}, {"content", text}}})}}, where);
      return require_tokenizer(where).encode(text, /*add_special_tokens=*/true);
    }
    fail("{}: expected \"prompt\", \"messages\" or \"input_ids\"", where);
  }

  // The prompt as the model sees it, for --json output.
  std::optional<std::string> rendered(const std::vector<int32_t>& ids) const {
    if (!tokenizer_) return std::nullopt;
    return tokenizer_->decode(ids);
  }

 private:
  const Tokenizer& require_tokenizer(const std::string& where) const {
    if (!tokenizer_)
      fail("{}: {} has no tokenizer.json, so text prompts cannot be encoded; give token ids (--prompt-ids, or "
           "\"input_ids\" in --input)", where, model_dir_.string());
    return *tokenizer_;
  }

  // As transformers' apply_chat_template(messages, add_generation_prompt=True, tokenize=True): the
  // template already writes every special token, so none are added when tokenizing.
  std::vector<int32_t> encode_chat(json sample, const std::string& where) {
    const Tokenizer& tokenizer = require_tokenizer(where);
    if (!chat_template_) chat_template_ = chat::load_model_chat_template(model_dir_);
    sample["add_generation_prompt"] = true;
    const std::string text = chat_template_->chat_template.render(chat::transformers_context(sample, chat_template_->special_tokens));
    return tokenizer.encode(text, /*add_special_tokens=*/false);
  }

  fs::path model_dir_;
  bool chat_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::optional<chat::ModelChatTemplate> chat_template_;
};

PackedRow unsupervised_row(const Sequence& seq) {
  PackedRow row;
  row.input_ids = seq.prompt_ids;
  row.input_ids.insert(row.input_ids.end(), seq.generated.begin(), seq.generated.end());
  const size_t n = row.input_ids.size();
  row.positions.resize(n);
  for (size_t i = 0; i < n; ++i) row.positions[i] = static_cast<int32_t>(i);
  row.doc_ids.assign(n, 0);
  row.targets.assign(n, kIgnoreIndex);
  row.weights.assign(n, 0.0f);
  return row;
}

// Index of the largest logit; the lowest index among equal ones, as torch.argmax.
template <typename T>
int32_t argmax(const T* values, int64_t n) {
  return static_cast<int32_t>(std::max_element(values, values + n) - values);
}

// One greedy step for every unfinished sequence, as few forward passes as --batch-tokens allows.
void generate_one_token(Backend& backend, Decoder& decoder, DType dtype, int64_t vocab_size, int64_t batch_tokens,
                        const std::set<int32_t>& stop_ids, int64_t max_new_tokens, std::vector<Sequence>& sequences) {
  std::vector<Sequence*> active;
  for (Sequence& s : sequences)
    if (!s.finished()) active.push_back(&s);
  size_t begin = 0;
  while (begin < active.size()) {
    std::vector<PackedRow> rows;
    std::vector<int32_t> last_positions;
    int64_t tokens = 0;
    size_t end = begin;
    while (end < active.size()) {
      PackedRow row = unsupervised_row(*active[end]);
      if (!rows.empty() && tokens + row.length() > batch_tokens) break;
      tokens += row.length();
      last_positions.push_back(static_cast<int32_t>(tokens - 1));
      rows.push_back(std::move(row));
      ++end;
    }
    const int64_t n = static_cast<int64_t>(rows.size());
    Tensor row_index = backend.empty(Shape{n}, DType::I32);
    backend.copy_from_host(backend.default_stream(), last_positions.data(), row_index);
    Tensor logits = backend.empty(Shape{n, vocab_size}, dtype);
    decoder.logits(make_micro_batch(backend, rows, dtype), row_index, logits);
    std::vector<int32_t> next(n);
    if (dtype == DType::F64) {
      std::vector<double> host(n * vocab_size);
      backend.copy_to_host(backend.default_stream(), logits, host.data());
      for (int64_t i = 0; i < n; ++i) next[i] = argmax(host.data() + i * vocab_size, vocab_size);
    } else {
      // BF16 logits (CUDA) are widened on the device before they come back.
      Tensor wide = dtype == DType::F32 ? logits : backend.empty(logits.shape(), DType::F32);
      if (dtype != DType::F32) backend.copy(backend.default_stream(), logits, wide);
      std::vector<float> host(n * vocab_size);
      backend.copy_to_host(backend.default_stream(), wide, host.data());
      for (int64_t i = 0; i < n; ++i) next[i] = argmax(host.data() + i * vocab_size, vocab_size);
    }
    for (int64_t i = 0; i < n; ++i) {
      Sequence& s = *active[begin + i];
      if (stop_ids.count(next[i])) {
        s.stop_reason = "eos";
        continue;
      }
      s.generated.push_back(next[i]);
      if (static_cast<int64_t>(s.generated.size()) >= max_new_tokens) s.stop_reason = "max_new_tokens";
    }
    begin = end;
  }
}

std::string ids_text(const std::vector<int32_t>& ids) {
  std::string out;
  for (int32_t id : ids) out += (out.empty() ? "" : " ") + std::to_string(id);
  return out;
}

int run_generate(const GenerateArgs& args) {
  if (args.max_new_tokens <= 0) fail("--max-new-tokens must be positive, got {}", args.max_new_tokens);
  if (args.batch_tokens <= 0) fail("--batch-tokens must be positive, got {}", args.batch_tokens);
  const int given = !args.prompt.empty() + !args.messages.empty() + !args.prompt_ids.empty() + !args.input.empty();
  if (given != 1) fail("give exactly one of --prompt, --messages, --prompt-ids or --input");

  const fs::path model_dir(args.model);
  PromptEncoder encoder(model_dir, args.chat);
  std::vector<json> samples;
  std::vector<std::string> origins;
  if (!args.prompt.empty()) {
    samples.push_back({{"prompt", args.prompt}});
    origins.push_back("--prompt");
  } else if (!args.messages.empty()) {
    json messages;
    try {
      messages = json::parse(args.messages);
    } catch (const json::exception& e) {
      fail("--messages is not valid JSON ({}); expected e.g. '[{{\"role\": \"user\", \"content\": \"Hi\"}}]'", e.what());
    }
    // A bare list of messages, or an object with "messages" (and template kwargs such as tools).
    samples.push_back(messages.is_array() ? json{{"messages", messages}} : messages);
    if (!samples.back().is_object() || !samples.back().contains("messages"))
      fail("--messages: expected a JSON array of {{\"role\", \"content\"}} objects");
    origins.push_back("--messages");
  } else if (!args.prompt_ids.empty()) {
    samples.push_back({{"input_ids", parse_id_list(args.prompt_ids, "--prompt-ids")}});
    origins.push_back("--prompt-ids");
  } else {
    std::ifstream in(args.input);
    if (!in) fail("--input {}: cannot open", args.input);
    std::string line;
    for (int64_t number = 1; std::getline(in, line); ++number) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = fmt::format("{} line {}", args.input, number);
      try {
        samples.push_back(json::parse(line));
      } catch (const json::exception& e) {
        fail("{}: not valid JSON ({})", where, e.what());
      }
      if (!samples.back().is_object()) fail("{}: expected a JSON object", where);
      origins.push_back(where);
    }
    if (samples.empty()) fail("--input {}: no prompts in it", args.input);
  }

  const ComputeDevice device = choose_device(args.device, args.dtype, ProcessGroupInfo{});
  const DType dtype = device.dtype;
  auto backend = make_backend(device, args.threads);
  const ModelConfig config = ModelConfig::from_file(args.model);
  std::vector<Sequence> sequences;
  for (size_t i = 0; i < samples.size(); ++i) {
    Sequence s;
    s.prompt_ids = encoder.encode(samples[i], origins[i]);
    if (s.prompt_ids.empty()) fail("{}: the prompt encodes to no tokens", origins[i]);
    for (int32_t id : s.prompt_ids)
      if (id >= config.vocab_size)
        fail("{}: token id {} is outside the model's vocabulary (vocab_size {} in {}/config.json)", origins[i], id,
             config.vocab_size, args.model);
    sequences.push_back(std::move(s));
  }
  const std::set<int32_t> stop_ids = stop_token_ids(model_dir, encoder.tokenizer());

  ModelWeights weights =
      ModelWeights::load(*backend, config, io::Checkpoint(args.model), dtype,
                         parse_quantize_options(args.quantize, args.double_quant, args.quant_block_size));
  if (!args.adapter.empty()) weights.load_peft_adapter(*backend, args.adapter);
  Decoder decoder(*backend, weights);
  for (int64_t step = 0; step < args.max_new_tokens; ++step) {
    generate_one_token(*backend, decoder, dtype, config.vocab_size, args.batch_tokens, stop_ids, args.max_new_tokens,
                       sequences);
    if (std::all_of(sequences.begin(), sequences.end(), [](const Sequence& s) { return s.finished(); })) break;
  }

  const Tokenizer* tokenizer = encoder.tokenizer();
  for (const Sequence& s : sequences) {
    if (args.json_output) {
      json out;
      out["prompt_ids"] = s.prompt_ids;
      if (auto text = encoder.rendered(s.prompt_ids)) out["prompt_text"] = *text;
      out["ids"] = s.generated;
      if (tokenizer) out["text"] = tokenizer->decode(s.generated);
      out["stop"] = s.stop_reason;
      std::printf("%s\n", out.dump().c_str());
    } else {
      std::printf("%s\n", tokenizer ? tokenizer->decode(s.generated).c_str() : ids_text(s.generated).c_str());
    }
  }
  return 0;
}

}  // namespace

void add_generate_command(CLI::App& app, CommandList& commands) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "generate",
      "Greedy decoding (on the GPU when there is one, else the CPU: --device), stopping at EOS. No KV cache: each new token recomputes the whole sequence, "
      "fine for demos and short prompts, not for serving");
  cmd->add_option("--model", args->model, "Hugging Face model folder (config.json, *.safetensors, tokenizer)")->required();
  cmd->add_option("--adapter", args->adapter, "PEFT LoRA adapter folder to apply");
  add_quantize_options(cmd, args->quantize, args->double_quant, args->quant_block_size);
  cmd->add_option("--prompt", args->prompt, "text to continue (tokenized with special tokens added, as tokenizer(text))");
  cmd->add_option("--messages", args->messages,
                  "a conversation as JSON, '[{\"role\": \"user\", \"content\": \"...\"}]', rendered with the model's "
                  "chat template and the generation prompt");
  cmd->add_option("--prompt-ids", args->prompt_ids, "token ids to continue, comma-separated (no tokenizer needed)");
  cmd->add_option("--input", args->input,
                  "JSONL, one prompt per line: {\"prompt\": ...}, {\"messages\": [...]} or {\"input_ids\": [...]}; "
                  "decoded together, one output line each");
  cmd->add_flag("--chat", args->chat, "render --prompt (and \"prompt\" lines of --input) as one user message with the "
                                      "chat template");
  cmd->add_option("--max-new-tokens", args->max_new_tokens, "most tokens to generate per prompt")->capture_default_str();
  cmd->add_flag("--json", args->json_output, "one JSON object per prompt: prompt_ids, prompt_text, ids, text, stop "
                                             "(eos or max_new_tokens)");
  cmd->add_option("--batch-tokens", args->batch_tokens, "most tokens per forward pass when decoding several prompts")
      ->capture_default_str();
  cmd->add_option("--device", args->device, "cpu, cuda (GPU 0) or auto (CUDA when built with it and a GPU is visible)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "auto (cpu: f32, cuda: bf16), f32, f64 (cpu) or bf16 (cuda)")
      ->check(CLI::IsMember({"auto", "f32", "f64", "bf16"}))->capture_default_str();
  cmd->add_option("--threads", args->threads, "CPU threads (default: all)");
  commands.push_back({cmd, [args] { return run_generate(*args); }});
}

}  // namespace spindle::cli
