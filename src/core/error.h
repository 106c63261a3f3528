// Errors are values that cross the library boundary as spindle::Error: a message that tells the
// user what was wrong and what to change. Library code never calls exit().
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace spindle {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

// Internal invariant check: a failure is a bug in spindle, not bad input.
#define SPINDLE_CHECK(cond, ...)                                                              \
  do {                                                                                        \
    if (!(cond))                                                                              \
      ::spindle::fail("internal error at {}:{}: check '{}' failed: {}", __FILE__, __LINE__, #cond, \
                      ::fmt::format(__VA_ARGS__));                                            \
  } while (0)

}  // namespace spindle
