// jinja2's operators, filters, tests and the Python methods the sandbox allows, over Values.
// Everything here throws TemplateRuntimeError; the interpreter adds the template line.
#pragma once

#include <ctime>
#include <optional>
#include <string>

#include "data/chat/value.h"

namespace spindle::chat {

bool is_known_filter(const std::string& name);
bool is_known_test(const std::string& name);

Value apply_filter(const std::string& name, const Value& base, CallArguments& args);
bool apply_test(const std::string& name, const Value& base, CallArguments& args);

// obj.name: Python attribute first (a bound method), then the item, as the sandbox does.
Value get_attribute(const Value& object, const std::string& name);
// obj[key]: the item first, then the attribute.
Value get_item(const Value& object, const Value& key);
Value get_slice(const Value& object, const Value& start, const Value& stop, const Value& step);

Value binary_operation(const std::string& op, const Value& left, const Value& right);
bool compare(const std::string& op, const Value& left, const Value& right);
Value negate(const Value& operand);

// Iteration as jinja's `for` sees it: list items, dict keys, string characters; undefined is empty.
std::vector<Value> iterate(const Value& v);

[[noreturn]] void raise_undefined(const Value& undefined);

}  // namespace spindle::chat
