// Executes a parsed template against a context, with jinja2's scoping rules.
#pragma once

#include <string>
#include <vector>

#include "data/chat/ast.h"
#include "data/chat/chat_template.h"

namespace spindle::chat {

struct Program {
  std::string source;
  StmtList body;
  bool has_generation_blocks = false;
};

// Parses and validates (unknown filters/tests are reported at parse time, as jinja2 does).
std::shared_ptr<const Program> compile_program(std::string source);

std::string run_program(const Program& program, const nlohmann::ordered_json& context, const RenderOptions& options,
                        std::vector<ByteSpan>* generation_spans);

}  // namespace spindle::chat
