// Throwing a TemplateError that names the template line.
#pragma once

#include <fmt/format.h>

#include "data/chat/chat_template.h"

namespace spindle::chat {

template <typename... Args>
[[noreturn]] void template_fail(int line, fmt::format_string<Args...> format, Args&&... args) {
  throw TemplateError(line, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace spindle::chat
