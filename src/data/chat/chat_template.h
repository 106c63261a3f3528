// spindle::chat::ChatTemplate: renders a Hugging Face chat template (Jinja) byte for byte as
// transformers' apply_chat_template does (jinja2 ImmutableSandboxedEnvironment, trim_blocks,
// lstrip_blocks, loopcontrols, HF's tojson, raise_exception, strftime_now, {% generation %}).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace spindle::chat {

// [begin, end) byte offsets into a rendered string.
struct ByteSpan {
  size_t begin = 0;
  size_t end = 0;
  bool operator==(const ByteSpan&) const = default;
};

struct RenderOptions {
  // What strftime_now() sees as "now" (local time); unset means the real clock, as transformers.
  std::optional<std::chrono::system_clock::time_point> now;
};

// A template error: `line` is the template line (1-based), `reason` the bare message; what()
// is "chat template line N: reason" so callers can prefix the sample's line number.
class TemplateError : public Error {
 public:
  TemplateError(int line, std::string reason);
  int line() const { return line_; }
  const std::string& reason() const { return reason_; }

 private:
  int line_;
  std::string reason_;
};

struct Program;

class ChatTemplate {
 public:
  // Throws TemplateError for syntax errors and constructs the renderer does not support.
  static ChatTemplate parse(std::string source);

  // Renders with exactly the variables in `context` (an object): transformers passes messages,
  // tools, documents, add_generation_prompt, the special tokens and any extra kwargs; see
  // transformers_context() in model_folder.h to build that set.
  std::string render(const nlohmann::ordered_json& context, const RenderOptions& options = {}) const;

  struct Rendered {
    std::string text;
    // Byte spans of the output of each {% generation %} block, in order, measured as transformers
    // does (offset into what the top-level template had emitted when the block finished).
    std::vector<ByteSpan> generation_spans;
  };
  Rendered render_with_generation_spans(const nlohmann::ordered_json& context, const RenderOptions& options = {}) const;

  bool has_generation_blocks() const;
  const std::string& source() const;

 private:
  std::shared_ptr<const Program> program_;
};

}  // namespace spindle::chat
