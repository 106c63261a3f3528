// Recursive-descent parser following jinja2's grammar and operator precedence.
#pragma once

#include <string>

#include "data/chat/ast.h"

namespace spindle::chat {

// Throws spindle::Error "template line N: ..." for syntax errors and unsupported constructs.
StmtList parse_template(const std::string& source);

}  // namespace spindle::chat
