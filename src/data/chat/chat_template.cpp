#include "data/chat/chat_template.h"

#include "data/chat/interpreter.h"
#include "data/chat/parser.h"

namespace spindle::chat {

TemplateError::TemplateError(int line, std::string reason)
    : Error(fmt::format("chat template line {}: {}", line, reason)), line_(line), reason_(std::move(reason)) {}

ChatTemplate ChatTemplate::parse(std::string source) {
  ChatTemplate t;
  t.program_ = compile_program(std::move(source));
  return t;
}

std::string ChatTemplate::render(const nlohmann::ordered_json& context, const RenderOptions& options) const {
  return run_program(*program_, context, options, nullptr);
}

ChatTemplate::Rendered ChatTemplate::render_with_generation_spans(const nlohmann::ordered_json& context,
                                                                  const RenderOptions& options) const {
  Rendered r;
  r.text = run_program(*program_, context, options, &r.generation_spans);
  return r;
}

bool ChatTemplate::has_generation_blocks() const { return program_->has_generation_blocks; }
const std::string& ChatTemplate::source() const { return program_->source; }

}  // namespace spindle::chat
