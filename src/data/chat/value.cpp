#include "data/chat/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "data/chat/unicode.h"

namespace spindle::chat {

Value Value::undefined(std::string reason) {
  Value v;
  v.text = std::move(reason);
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::None;
  return v;
}
Value Value::from_bool(bool b) {
  Value v;
  v.kind = Kind::Bool;
  v.boolean = b;
  return v;
}
Value Value::from_int(int64_t i) {
  Value v;
  v.kind = Kind::Int;
  v.integer = i;
  return v;
}
Value Value::from_float(double d) {
  Value v;
  v.kind = Kind::Float;
  v.floating = d;
  return v;
}
Value Value::from_string(std::string s, bool markup) {
  Value v;
  v.kind = Kind::String;
  v.text = std::move(s);
  v.markup = markup;
  return v;
}
Value Value::from_list(std::vector<Value> items, bool tuple) {
  Value v;
  v.kind = Kind::List;
  v.list = std::make_shared<ListObject>();
  v.list->items = std::move(items);
  v.list->is_tuple = tuple;
  return v;
}
Value Value::empty_dict() {
  Value v;
  v.kind = Kind::Dict;
  v.dict = std::make_shared<DictObject>();
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& json) {
  switch (json.type()) {
    case nlohmann::json::value_t::null: return none();
    case nlohmann::json::value_t::boolean: return from_bool(json.get<bool>());
    case nlohmann::json::value_t::number_integer: return from_int(json.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      auto u = json.get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return from_int(static_cast<int64_t>(u));
      return from_float(static_cast<double>(u));
    }
    case nlohmann::json::value_t::number_float: return from_float(json.get<double>());
    case nlohmann::json::value_t::string: return from_string(json.get<std::string>());
    case nlohmann::json::value_t::array: {
      std::vector<Value> items;
      items.reserve(json.size());
      for (const auto& item : json) items.push_back(from_json(item));
      return from_list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      Value d = empty_dict();
      for (const auto& [key, item] : json.items()) d.dict->entries.emplace_back(from_string(key), from_json(item));
      return d;
    }
    default: return none();
  }
}

bool Value::truthy() const {
  switch (kind) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool: return boolean;
    case Kind::Int: return integer != 0;
    case Kind::Float: return floating != 0.0;
    case Kind::String: return !text.empty();
    case Kind::List: return list->is_generator || !list->items.empty();
    case Kind::Dict: return !dict->entries.empty();
    default: return true;
  }
}

std::string Value::type_name() const {
  switch (kind) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return markup ? "Markup" : "str";
    case Kind::List: return list->is_generator ? "generator" : list->is_tuple ? "tuple" : "list";
    case Kind::Dict: return "dict";
    case Kind::Namespace: return ns->is_loop ? "LoopContext" : "Namespace";
    case Kind::Callable: return "function";
  }
  return "object";
}

const Value* DictObject::find(const Value& key) const {
  for (const auto& [k, v] : entries)
    if (python_equal(k, key)) return &v;
  return nullptr;
}

void DictObject::set(const Value& key, Value value) {
  for (auto& [k, v] : entries)
    if (python_equal(k, key)) {
      v = std::move(value);
      return;
    }
  entries.emplace_back(key, std::move(value));
}

const Value* NamespaceObject::find(const std::string& name) const {
  for (const auto& [k, v] : attributes)
    if (k == name) return &v;
  return nullptr;
}

void NamespaceObject::set(const std::string& name, Value value) {
  for (auto& [k, v] : attributes)
    if (k == name) {
      v = std::move(value);
      return;
    }
  attributes.emplace_back(name, std::move(value));
}

namespace {

double as_double(const Value& v) {
  if (v.kind == Kind::Float) return v.floating;
  if (v.kind == Kind::Bool) return v.boolean ? 1.0 : 0.0;
  return static_cast<double>(v.integer);
}

}  // namespace

bool python_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind != Kind::Float && b.kind != Kind::Float) {
      int64_t x = a.kind == Kind::Bool ? a.boolean : a.integer;
      int64_t y = b.kind == Kind::Bool ? b.boolean : b.integer;
      return x == y;
    }
    return as_double(a) == as_double(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::Undefined:
    case Kind::None: return true;
    case Kind::String: return a.text == b.text;
    case Kind::List: {
      if (a.list == b.list) return true;
      if (a.list->items.size() != b.list->items.size() || a.list->is_tuple != b.list->is_tuple) return false;
      for (size_t i = 0; i < a.list->items.size(); ++i)
        if (!python_equal(a.list->items[i], b.list->items[i])) return false;
      return true;
    }
    case Kind::Dict: {
      if (a.dict == b.dict) return true;
      if (a.dict->entries.size() != b.dict->entries.size()) return false;
      for (const auto& [k, v] : a.dict->entries) {
        const Value* other = b.dict->find(k);
        if (!other || !python_equal(v, *other)) return false;
      }
      return true;
    }
    case Kind::Namespace: return a.ns == b.ns;
    case Kind::Callable: return a.callable == b.callable;
    default: return false;
  }
}

std::string python_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0.0) return std::signbit(d) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then CPython's layout: scientific when the decimal exponent is
  // below -4 or at least 16, with a signed two-digit-minimum exponent.
  char buffer[64];
  auto result = std::to_chars(buffer, buffer + sizeof buffer, d, std::chars_format::scientific);
  std::string sci(buffer, result.ptr);
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  size_t e = sci.find('e');
  std::string mantissa = sci.substr(0, e);
  int exponent = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits.push_back(c);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  int decimal_point = exponent + 1;  // value = 0.digits * 10^decimal_point
  std::string out = sign;
  if (decimal_point > 16 || decimal_point < -3) {
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
  } else if (decimal_point <= 0) {
    out += "0." + std::string(-decimal_point, '0') + digits;
  } else if (decimal_point >= static_cast<int>(digits.size())) {
    out += digits + std::string(decimal_point - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, decimal_point) + "." + digits.substr(decimal_point);
  }
  return out;
}

std::string python_string_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : unicode::decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned>(c));
    } else if (c < 0x80 || unicode::is_printable(c)) {
      unicode::append_code_point(out, c);
    } else if (c <= 0xFF) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned>(c));
    } else if (c <= 0xFFFF) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
    } else {
      out += fmt::format("\\U{:08x}", static_cast<unsigned>(c));
    }
  }
  out.push_back(quote);
  return out;
}

std::string python_repr(const Value& v) {
  switch (v.kind) {
    case Kind::String: return v.markup ? "Markup(" + python_string_repr(v.text) + ")" : python_string_repr(v.text);
    case Kind::List: {
      if (v.list->is_generator) return "<generator object>";
      const auto& items = v.list->items;
      std::string out = v.list->is_tuple ? "(" : "[";
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += ", ";
        out += python_repr(items[i]);
      }
      if (v.list->is_tuple && items.size() == 1) out += ",";
      out += v.list->is_tuple ? ")" : "]";
      return out;
    }
    case Kind::Dict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, item] : v.dict->entries) {
        if (!first) out += ", ";
        first = false;
        out += python_repr(k) + ": " + python_repr(item);
      }
      return out + "}";
    }
    default: return python_str(v);
  }
}

std::string python_str(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined: return "";
    case Kind::None: return "None";
    case Kind::Bool: return v.boolean ? "True" : "False";
    case Kind::Int: return std::to_string(v.integer);
    case Kind::Float: return python_float_repr(v.floating);
    case Kind::String: return v.text;
    case Kind::List:
    case Kind::Dict: return python_repr(v);
    case Kind::Namespace: {
      if (v.ns->is_loop) return "<LoopContext>";
      std::string out = "<Namespace {";
      bool first = true;
      for (const auto& [k, item] : v.ns->attributes) {
        if (!first) out += ", ";
        first = false;
        out += python_string_repr(k) + ": " + python_repr(item);
      }
      return out + "}>";
    }
    case Kind::Callable: return "<function " + v.callable->name + ">";
  }
  return "";
}

namespace {

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out.push_back('"');
  for (char32_t c : unicode::decode(s)) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
        } else if (ensure_ascii && c > 0x7E) {
          if (c >= 0x10000) {
            char32_t v = c - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
          } else {
            out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
          }
        } else {
          unicode::append_code_point(out, c);
        }
    }
  }
  out.push_back('"');
}

std::string json_float(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return python_float_repr(d);
}

void json_value(std::string& out, const Value& v, const JsonDumpOptions& o, int depth) {
  auto newline_indent = [&](int level) {
    out.push_back('\n');
    for (int i = 0; i < level; ++i) out += o.indent;
  };
  switch (v.kind) {
    case Kind::None: out += "null"; return;
    case Kind::Bool: out += v.boolean ? "true" : "false"; return;
    case Kind::Int: out += std::to_string(v.integer); return;
    case Kind::Float: out += json_float(v.floating); return;
    case Kind::String: json_string(out, v.text, o.ensure_ascii); return;
    case Kind::List: {
      if (v.list->is_generator) raise("Object of type generator is not JSON serializable (add |list before |tojson)");
      const auto& items = v.list->items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += o.item_separator;
        if (o.has_indent) newline_indent(depth + 1);
        json_value(out, items[i], o, depth + 1);
      }
      if (o.has_indent) newline_indent(depth);
      out.push_back(']');
      return;
    }
    case Kind::Dict: {
      if (v.dict->entries.empty()) {
        out += "{}";
        return;
      }
      std::vector<std::pair<std::string, const Value*>> entries;
      for (const auto& [k, item] : v.dict->entries) {
        std::string key;
        switch (k.kind) {
          case Kind::String: key = k.text; break;
          case Kind::Int: key = std::to_string(k.integer); break;
          case Kind::Float: key = json_float(k.floating); break;
          case Kind::Bool: key = k.boolean ? "true" : "false"; break;
          case Kind::None: key = "null"; break;
          default: raise("keys must be str, int, float, bool or None, not {}", k.type_name());
        }
        entries.emplace_back(std::move(key), &item);
      }
      if (o.sort_keys)
        std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
          return unicode::decode(a.first) < unicode::decode(b.first);
        });
      out.push_back('{');
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += o.item_separator;
        if (o.has_indent) newline_indent(depth + 1);
        json_string(out, entries[i].first, o.ensure_ascii);
        out += o.key_separator;
        json_value(out, *entries[i].second, o, depth + 1);
      }
      if (o.has_indent) newline_indent(depth);
      out.push_back('}');
      return;
    }
    default:
      raise("Object of type {} is not JSON serializable (tojson of an undefined value or a generator; "
            "pass a concrete value, e.g. add |list after map/select)",
            v.type_name());
  }
}

}  // namespace

std::string json_dumps(const Value& v, const JsonDumpOptions& options) {
  std::string out;
  json_value(out, v, options, 0);
  return out;
}

std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

}  // namespace spindle::chat
