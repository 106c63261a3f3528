// The value model of the interpreter: Python's objects as jinja2 sees them (None distinct from
// undefined, int distinct from float, insertion-ordered dicts, str as a Markup or plain string),
// with Python's printing (str/repr) and transformers' `tojson` (json.dumps).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace spindle::chat {

// Thrown by value operations that do not know where in the template they run; the interpreter
// rethrows it as spindle::Error with the template line of the statement being executed.
struct TemplateRuntimeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
template <typename... Args>
[[noreturn]] void raise(fmt::format_string<Args...> format, Args&&... args) {
  throw TemplateRuntimeError(fmt::format(format, std::forward<Args>(args)...));
}

struct Value;
struct ListObject;
struct DictObject;
struct NamespaceObject;
struct CallableObject;

enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Callable };

struct Value {
  Kind kind = Kind::Undefined;
  bool boolean = false;
  int64_t integer = 0;
  double floating = 0.0;
  // String payload; for Undefined, the reason it is undefined (for error messages).
  std::string text;
  // markupsafe.Markup (from |safe, |escape): `+` with a plain str escapes the plain side.
  bool markup = false;
  std::shared_ptr<ListObject> list;
  std::shared_ptr<DictObject> dict;
  std::shared_ptr<NamespaceObject> ns;
  std::shared_ptr<CallableObject> callable;

  static Value undefined(std::string reason = {});
  static Value none();
  static Value from_bool(bool b);
  static Value from_int(int64_t i);
  static Value from_float(double d);
  static Value from_string(std::string s, bool markup = false);
  static Value from_list(std::vector<Value> items, bool tuple = false);
  static Value empty_dict();
  static Value from_json(const nlohmann::ordered_json& json);

  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_none() const { return kind == Kind::None; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float || kind == Kind::Bool; }
  bool truthy() const;
  std::string type_name() const;  // Python's type name, for messages matching jinja2's
};

struct ListObject {
  std::vector<Value> items;
  bool is_tuple = false;
  // A generator (map/select/reject results): iterable, but json/len/indexing fail on it as in Python.
  bool is_generator = false;
};

struct DictObject {
  std::vector<std::pair<Value, Value>> entries;
  const Value* find(const Value& key) const;
  void set(const Value& key, Value value);
};

struct NamespaceObject {
  std::vector<std::pair<std::string, Value>> attributes;
  bool is_loop = false;  // jinja's LoopContext prints differently but is otherwise attribute bag
  const Value* find(const std::string& name) const;
  void set(const std::string& name, Value value);
};

struct CallArguments {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keywords;
};

struct CallableObject {
  std::string name;
  std::function<Value(CallArguments&)> call;
};

// Python semantics used by both the evaluator and the filters.
bool python_equal(const Value& a, const Value& b);
std::string python_str(const Value& v);   // str(v); undefined prints as ''
std::string python_repr(const Value& v);  // repr(v)
std::string python_float_repr(double d);
std::string python_string_repr(const std::string& s);

struct JsonDumpOptions {
  bool ensure_ascii = false;
  bool has_indent = false;
  std::string indent;  // indent unit when has_indent
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool separators_given = false;
  bool sort_keys = false;
};
// json.dumps(v, ...). Throws spindle::Error for values json cannot encode (undefined, callables).
std::string json_dumps(const Value& v, const JsonDumpOptions& options);

std::string html_escape(const std::string& s);

}  // namespace spindle::chat
