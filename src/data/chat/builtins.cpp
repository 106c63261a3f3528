#include "data/chat/builtins.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "data/chat/unicode.h"

namespace spindle::chat {
namespace {

// Positional-or-keyword argument access, as Python binds a filter's signature.
class Arguments {
 public:
  Arguments(CallArguments& args, std::string function) : args_(args), function_(std::move(function)) {}
  const Value* find(size_t position, const char* name) const {
    if (position < args_.positional.size()) return &args_.positional[position];
    for (const auto& [k, v] : args_.keywords)
      if (k == name) return &v;
    return nullptr;
  }
  Value get(size_t position, const char* name, Value fallback = Value::none()) const {
    const Value* v = find(position, name);
    return v ? *v : fallback;
  }
  Value require(size_t position, const char* name) const {
    const Value* v = find(position, name);
    if (!v) raise("{}() missing required argument '{}'", function_, name);
    return *v;
  }
  size_t positional_count() const { return args_.positional.size(); }
  const CallArguments& raw() const { return args_; }

 private:
  CallArguments& args_;
  std::string function_;
};

std::string quoted_type(const Value& v) { return "'" + v.type_name() + "'"; }

int64_t as_int(const Value& v, const char* what) {
  if (v.kind == Kind::Int) return v.integer;
  if (v.kind == Kind::Bool) return v.boolean;
  raise("{} must be an integer, not {}", what, quoted_type(v));
}

double as_double(const Value& v) {
  if (v.kind == Kind::Float) return v.floating;
  if (v.kind == Kind::Bool) return v.boolean;
  return static_cast<double>(v.integer);
}

const std::string& as_string(const Value& v, const char* what) {
  if (v.kind != Kind::String) raise("{} must be a string, not {}", what, quoted_type(v));
  return v.text;
}

Value generator(std::vector<Value> items) {
  Value v = Value::from_list(std::move(items));
  v.list->is_generator = true;
  return v;
}

Value make_callable(std::string name, std::function<Value(CallArguments&)> fn) {
  Value v;
  v.kind = Kind::Callable;
  v.callable = std::make_shared<CallableObject>(CallableObject{std::move(name), std::move(fn)});
  return v;
}

Value string_like(const Value& model, std::string text) { return Value::from_string(std::move(text), model.markup); }

// ---------------------------------------------------------------- str methods

std::vector<Value> split_string(const std::string& s, const Value& separator, int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (separator.is_none()) {
    std::u32string cps = unicode::decode(s);
    // Whitespace split: runs of whitespace separate, leading/trailing whitespace produces nothing.
    std::vector<std::pair<size_t, size_t>> words;
    size_t i = 0;
    while (i < cps.size()) {
      while (i < cps.size() && unicode::is_space(cps[i])) ++i;
      if (i >= cps.size()) break;
      size_t j = i;
      while (j < cps.size() && !unicode::is_space(cps[j])) ++j;
      words.emplace_back(i, j);
      i = j;
    }
    if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit + 1) {
      if (!from_right) {
        std::vector<std::pair<size_t, size_t>> kept(words.begin(), words.begin() + maxsplit);
        size_t rest_begin = words[maxsplit].first;
        size_t rest_end = cps.size();
        while (rest_end > rest_begin && unicode::is_space(cps[rest_end - 1])) --rest_end;
        kept.emplace_back(rest_begin, rest_end);
        words = kept;
      } else {
        std::vector<std::pair<size_t, size_t>> kept;
        size_t first_kept = words.size() - maxsplit;
        size_t rest_begin = 0;
        while (rest_begin < cps.size() && unicode::is_space(cps[rest_begin])) ++rest_begin;
        kept.emplace_back(rest_begin, words[first_kept - 1].second);
        kept.insert(kept.end(), words.begin() + first_kept, words.end());
        words = kept;
      }
    }
    for (auto [b, e] : words) parts.push_back(unicode::encode(std::u32string_view(cps).substr(b, e - b)));
  } else {
    const std::string& sep = as_string(separator, "split separator");
    if (sep.empty()) raise("empty separator");
    if (!from_right) {
      size_t start = 0;
      while (true) {
        size_t found = s.find(sep, start);
        if (found == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(parts.size()) >= maxsplit)) {
          parts.push_back(s.substr(start));
          break;
        }
        parts.push_back(s.substr(start, found - start));
        start = found + sep.size();
      }
    } else {
      size_t end = s.size();
      std::vector<std::string> reversed;
      while (true) {
        size_t found = end >= sep.size() ? s.rfind(sep, end - sep.size()) : std::string::npos;
        if (found == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(reversed.size()) >= maxsplit)) {
          reversed.push_back(s.substr(0, end));
          break;
        }
        reversed.push_back(s.substr(found + sep.size(), end - found - sep.size()));
        end = found;
      }
      parts.assign(reversed.rbegin(), reversed.rend());
    }
  }
  std::vector<Value> out;
  for (auto& p : parts) out.push_back(Value::from_string(std::move(p)));
  return out;
}

std::string replace_all(const std::string& s, const std::string& old, const std::string& replacement, int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts the replacement between every code point (and at both ends).
    std::u32string cps = unicode::decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += replacement;
        ++done;
      }
      if (i < cps.size()) unicode::append_code_point(out, cps[i]);
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (true) {
    size_t found = s.find(old, start);
    if (found == std::string::npos || (count >= 0 && done >= count)) break;
    out += s.substr(start, found - start) + replacement;
    start = found + old.size();
    ++done;
  }
  return out + s.substr(start);
}

// Python's start/end arguments of startswith/find, in code points, as byte offsets.
std::pair<size_t, size_t> code_point_range(const std::string& s, const Value& start, const Value& end) {
  std::u32string cps = unicode::decode(s);
  int64_t n = static_cast<int64_t>(cps.size());
  auto clamp = [&](const Value& v, int64_t fallback) {
    if (v.is_none() || v.is_undefined()) return fallback;
    int64_t i = as_int(v, "slice index");
    if (i < 0) i += n;
    return std::clamp<int64_t>(i, 0, n);
  };
  int64_t b = clamp(start, 0), e = clamp(end, n);
  if (e < b) e = b;
  size_t byte_b = unicode::encode(std::u32string_view(cps).substr(0, b)).size();
  size_t byte_e = byte_b + unicode::encode(std::u32string_view(cps).substr(b, e - b)).size();
  return {byte_b, byte_e};
}

Value string_method(const Value& self, const std::string& name, CallArguments& call) {
  const std::string& s = self.text;
  Arguments args(call, "str." + name);
  if (name == "split" || name == "rsplit") {
    Value sep = args.get(0, "sep");
    int64_t maxsplit = as_int(args.get(1, "maxsplit", Value::from_int(-1)), "maxsplit");
    auto parts = split_string(s, sep, maxsplit, name == "rsplit");
    if (self.markup)
      for (auto& p : parts) p.markup = true;
    return Value::from_list(std::move(parts));
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    Value chars = args.get(0, "chars");
    std::string chars_text = chars.is_none() ? std::string() : as_string(chars, "strip characters");
    return string_like(self, unicode::strip(s, chars.is_none() ? nullptr : &chars_text, name != "rstrip", name != "lstrip"));
  }
  if (name == "startswith" || name == "endswith") {
    Value affixes = args.require(0, "prefix");
    auto [b, e] = code_point_range(s, args.get(1, "start"), args.get(2, "end"));
    std::string_view window = std::string_view(s).substr(b, e - b);
    std::vector<Value> candidates = affixes.kind == Kind::List && affixes.list->is_tuple ? affixes.list->items
                                                                                        : std::vector<Value>{affixes};
    for (const Value& candidate : candidates) {
      const std::string& a = as_string(candidate, (name + " argument").c_str());
      if (a.size() > window.size()) continue;
      if (name == "startswith" ? window.substr(0, a.size()) == a : window.substr(window.size() - a.size()) == a)
        return Value::from_bool(true);
    }
    return Value::from_bool(false);
  }
  if (name == "replace") {
    const std::string& old = as_string(args.require(0, "old"), "replace() argument 1");
    const std::string& replacement = as_string(args.require(1, "new"), "replace() argument 2");
    int64_t count = as_int(args.get(2, "count", Value::from_int(-1)), "count");
    if (self.markup) return Value::from_string(replace_all(s, html_escape(old), html_escape(replacement), count), true);
    return Value::from_string(replace_all(s, old, replacement, count));
  }
  if (name == "upper") return string_like(self, unicode::to_upper(s));
  if (name == "lower") return string_like(self, unicode::to_lower(s));
  if (name == "title") return string_like(self, unicode::python_title(s));
  if (name == "capitalize") return string_like(self, unicode::python_capitalize(s));
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    const std::string& needle = as_string(args.require(0, "sub"), (name + " argument").c_str());
    auto [b, e] = code_point_range(s, args.get(1, "start"), args.get(2, "end"));
    std::string window = s.substr(b, e - b);
    if (name == "count") {
      if (needle.empty()) return Value::from_int(static_cast<int64_t>(unicode::code_point_count(window) + 1));
      int64_t n = 0;
      for (size_t p = window.find(needle); p != std::string::npos; p = window.find(needle, p + needle.size())) ++n;
      return Value::from_int(n);
    }
    size_t found = name[0] == 'r' ? window.rfind(needle) : window.find(needle);
    if (found == std::string::npos) {
      if (name == "index" || name == "rindex") raise("substring not found");
      return Value::from_int(-1);
    }
    return Value::from_int(static_cast<int64_t>(unicode::code_point_count(s.substr(0, b + found))));
  }
  if (name == "join") {
    std::string out;
    bool first = true;
    for (const Value& item : iterate(args.require(0, "iterable"))) {
      if (!first) out += s;
      first = false;
      out += as_string(item, "sequence item");
    }
    return Value::from_string(std::move(out));
  }
  if (name == "splitlines") {
    std::vector<Value> lines;
    size_t start = 0;
    while (start < s.size()) {
      size_t nl = s.find('\n', start);
      if (nl == std::string::npos) nl = s.size();
      lines.push_back(Value::from_string(s.substr(start, nl - start)));
      start = nl + 1;
    }
    return Value::from_list(std::move(lines));
  }
  auto all_of = [&](auto predicate) {
    std::u32string cps = unicode::decode(s);
    return Value::from_bool(!cps.empty() && std::all_of(cps.begin(), cps.end(), predicate));
  };
  if (name == "isdigit") return all_of([](char32_t c) { return c >= '0' && c <= '9'; });
  if (name == "isspace") return all_of(unicode::is_space);
  if (name == "isalnum") return all_of(unicode::is_alnum);
  if (name == "isalpha") return all_of([](char32_t c) { return unicode::is_alnum(c) && !(c >= '0' && c <= '9'); });
  if (name == "isupper" || name == "islower") {
    bool want_upper = name == "isupper";
    std::string converted = want_upper ? unicode::to_upper(s) : unicode::to_lower(s);
    std::string other = want_upper ? unicode::to_lower(s) : unicode::to_upper(s);
    return Value::from_bool(converted == s && other != s);
  }
  raise("str method '{}' is not supported by spindle's renderer", name);
}

const std::set<std::string> kStringMethods = {"split", "rsplit", "strip", "lstrip", "rstrip", "startswith", "endswith",
                                              "replace", "upper", "lower", "title", "capitalize", "find", "rfind",
                                              "index", "rindex", "count", "join", "splitlines", "isdigit", "isspace",
                                              "isalnum", "isalpha", "isupper", "islower", "format", "center", "ljust",
                                              "rjust", "zfill", "swapcase", "casefold", "partition", "rpartition",
                                              "encode", "expandtabs", "isnumeric", "isdecimal", "istitle"};
const std::set<std::string> kDictMethods = {"items", "keys", "values", "get", "copy"};
const std::set<std::string> kDictMutators = {"pop", "popitem", "setdefault", "update", "clear"};
const std::set<std::string> kListMethods = {"index", "count", "copy"};
const std::set<std::string> kListMutators = {"append", "extend", "insert", "pop", "remove", "reverse", "sort", "clear"};

std::vector<Value> dict_items(const Value& d) {
  std::vector<Value> out;
  for (const auto& [k, v] : d.dict->entries) out.push_back(Value::from_list({k, v}, true));
  return out;
}

Value dict_method(const Value& self, const std::string& name, CallArguments& call) {
  Arguments args(call, "dict." + name);
  if (name == "items") return Value::from_list(dict_items(self));
  if (name == "keys" || name == "values") {
    std::vector<Value> out;
    for (const auto& [k, v] : self.dict->entries) out.push_back(name == "keys" ? k : v);
    return Value::from_list(std::move(out));
  }
  if (name == "get") {
    const Value* found = self.dict->find(args.require(0, "key"));
    return found ? *found : args.get(1, "default");
  }
  Value copy = Value::empty_dict();
  copy.dict->entries = self.dict->entries;
  return copy;
}

Value list_method(const Value& self, const std::string& name, CallArguments& call) {
  Arguments args(call, "list." + name);
  if (name == "copy") return Value::from_list(self.list->items, self.list->is_tuple);
  Value needle = args.require(0, "value");
  int64_t n = 0;
  for (size_t i = 0; i < self.list->items.size(); ++i) {
    if (python_equal(self.list->items[i], needle)) {
      if (name == "index") return Value::from_int(static_cast<int64_t>(i));
      ++n;
    }
  }
  if (name == "index") raise("{} is not in list", python_repr(needle));
  return Value::from_int(n);
}

Value bound_method(const Value& self, const std::string& name,
                   Value (*method)(const Value&, const std::string&, CallArguments&)) {
  return make_callable(name, [self, name, method](CallArguments& args) { return method(self, name, args); });
}

Value unsafe_method(const Value& self, const std::string& name) {
  std::string type = self.type_name();
  return make_callable(name, [type, name](CallArguments&) -> Value {
    raise("access to attribute '{}' of '{}' object is unsafe: templates run in jinja2's immutable sandbox, so "
          "lists and dicts cannot be modified; keep mutable state in a namespace() object",
          name, type);
  });
}

// ---------------------------------------------------------------- filters

Value do_tojson(const Value& base, const Arguments& args) {
  // transformers' signature: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
  JsonDumpOptions options;
  options.ensure_ascii = args.get(0, "ensure_ascii", Value::from_bool(false)).truthy();
  Value indent = args.get(1, "indent");
  Value separators = args.get(2, "separators");
  options.sort_keys = args.get(3, "sort_keys", Value::from_bool(false)).truthy();
  if (!indent.is_none()) {
    options.has_indent = true;
    if (indent.kind == Kind::String)
      options.indent = indent.text;
    else
      options.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, as_int(indent, "indent"))), ' ');
    options.item_separator = ",";
  }
  if (!separators.is_none()) {
    auto items = iterate(separators);
    if (items.size() != 2) raise("tojson separators must be an (item_separator, key_separator) pair");
    options.item_separator = as_string(items[0], "item separator");
    options.key_separator = as_string(items[1], "key separator");
  }
  return Value::from_string(json_dumps(base, options));
}

Value do_default(const Value& base, const Arguments& args) {
  Value fallback = args.get(0, "default_value", Value::from_string(""));
  bool boolean = args.get(1, "boolean", Value::from_bool(false)).truthy();
  if (base.is_undefined() || (boolean && !base.truthy())) return fallback;
  return base;
}

// jinja's attribute paths for map/selectattr/sort/join: "a.b" or "0" index lookups.
Value lookup_attribute_path(const Value& item, const Value& attribute) {
  if (attribute.kind == Kind::Int) return get_item(item, attribute);
  Value current = item;
  std::string path = as_string(attribute, "attribute");
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    current = numeric ? get_item(current, Value::from_int(std::stoll(part))) : get_item(current, Value::from_string(part));
    if (dot == std::string::npos) return current;
    start = dot + 1;
  }
}

// select/reject/selectattr/rejectattr share jinja's `select_or_reject`.
Value select_or_reject(const Value& base, const CallArguments& raw, bool by_attribute, bool keep_if_true) {
  size_t next_arg = 0;
  Value attribute;
  if (by_attribute) {
    if (raw.positional.empty()) raise("selectattr/rejectattr need an attribute name");
    attribute = raw.positional[next_arg++];
  }
  std::string test_name;
  CallArguments test_args;
  bool has_test = next_arg < raw.positional.size();
  if (has_test) {
    test_name = as_string(raw.positional[next_arg++], "test name");
    test_args.positional.assign(raw.positional.begin() + next_arg, raw.positional.end());
    test_args.keywords = raw.keywords;
    if (!is_known_test(test_name)) raise("no test named '{}'", test_name);
  }
  std::vector<Value> kept;
  if (!base.truthy()) return generator({});  // jinja2 yields nothing for a falsy sequence
  for (const Value& item : iterate(base)) {
    Value subject = by_attribute ? lookup_attribute_path(item, attribute) : item;
    bool result;
    if (has_test) {
      CallArguments copy = test_args;
      result = apply_test(test_name, subject, copy);
    } else {
      result = subject.truthy();
    }
    if (result == keep_if_true) kept.push_back(item);
  }
  return generator(std::move(kept));
}

Value do_map(const Value& base, const CallArguments& raw) {
  std::vector<Value> out;
  if (!base.truthy()) return generator({});
  const Value* attribute = nullptr;
  const Value* fallback = nullptr;
  for (const auto& [k, v] : raw.keywords) {
    if (k == "attribute") attribute = &v;
    if (k == "default") fallback = &v;
  }
  if (attribute) {
    for (const Value& item : iterate(base)) {
      Value v = lookup_attribute_path(item, *attribute);
      out.push_back(v.is_undefined() && fallback ? *fallback : v);
    }
    return generator(std::move(out));
  }
  if (raw.positional.empty()) raise("map needs a filter name or attribute=");
  std::string filter = as_string(raw.positional[0], "filter name");
  if (!is_known_filter(filter)) raise("no filter named '{}'", filter);
  for (const Value& item : iterate(base)) {
    CallArguments args;
    args.positional.assign(raw.positional.begin() + 1, raw.positional.end());
    for (const auto& kw : raw.keywords) args.keywords.push_back(kw);
    out.push_back(apply_filter(filter, item, args));
  }
  return generator(std::move(out));
}

bool python_less(const Value& a, const Value& b) { return compare("<", a, b); }

Value do_indent(const Value& base, const Arguments& args) {
  Value width = args.get(0, "width", Value::from_int(4));
  std::string indentation = width.kind == Kind::String ? width.text : std::string(as_int(width, "width"), ' ');
  bool first = args.get(1, "first", Value::from_bool(false)).truthy();
  bool blank = args.get(2, "blank", Value::from_bool(false)).truthy();
  std::string s = python_str(base) + "\n";
  // jinja splits with str.splitlines() and re-joins with "\n" + indentation.
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < s.size()) {
    size_t nl = s.find('\n', start);
    lines.push_back(s.substr(start, nl - start));
    start = nl + 1;
  }
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i == 0) {
      out = lines[0];
      continue;
    }
    out += "\n";
    if (blank || !unicode::strip(lines[i], nullptr, true, true).empty()) out += indentation;
    out += lines[i];
  }
  if (first) out = indentation + out;
  return Value::from_string(out, base.markup);
}

Value do_title_filter(const Value& base) {
  // jinja's |title: capitalise each chunk after runs of [-\s({\[<]
  std::string s = python_str(base);
  std::string out;
  bool word_start = true;
  for (char32_t c : unicode::decode(s)) {
    bool separator = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || unicode::is_space(c);
    if (separator) {
      unicode::append_code_point(out, c);
      word_start = true;
    } else if (word_start) {
      std::string one;
      unicode::append_code_point(one, c);
      out += unicode::to_upper(one);
      word_start = false;
    } else {
      std::string one;
      unicode::append_code_point(one, c);
      out += unicode::to_lower(one);
    }
  }
  return Value::from_string(out, base.markup);
}

}  // namespace

void raise_undefined(const Value& undefined) {
  raise("{}", undefined.text.empty() ? std::string("value is undefined") : undefined.text);
}

std::vector<Value> iterate(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined: return {};
    case Kind::List: return v.list->items;
    case Kind::Dict: {
      std::vector<Value> keys;
      for (const auto& [k, item] : v.dict->entries) keys.push_back(k);
      return keys;
    }
    case Kind::String: {
      std::vector<Value> chars;
      for (char32_t c : unicode::decode(v.text)) {
        std::string one;
        unicode::append_code_point(one, c);
        chars.push_back(Value::from_string(std::move(one), v.markup));
      }
      return chars;
    }
    default: raise("{} object is not iterable", quoted_type(v));
  }
}

static const std::set<std::string> kFilters = {
    "abs", "attr", "capitalize", "count", "d", "default", "dictsort", "e", "escape", "first", "float", "forceescape",
    "indent", "int", "items", "join", "last", "length", "list", "lower", "map", "max", "min", "reject", "rejectattr",
    "replace", "reverse", "round", "safe", "select", "selectattr", "sort", "string", "sum", "title", "tojson", "trim",
    "unique", "upper", "wordcount", "center", "batch"};
static const std::set<std::string> kTests = {
    "defined", "undefined", "none", "boolean", "false", "true", "integer", "float", "number", "string", "mapping",
    "iterable", "sequence", "callable", "sameas", "escaped", "in", "eq", "equalto", "==", "ne", "!=", "lt", "<",
    "lessthan", "le", "<=", "gt", ">", "greaterthan", "ge", ">=", "odd", "even", "divisibleby", "lower", "upper",
    "filter", "test"};

bool is_known_filter(const std::string& name) { return kFilters.count(name) > 0; }
bool is_known_test(const std::string& name) { return kTests.count(name) > 0; }

Value apply_filter(const std::string& name, const Value& base, CallArguments& call) {
  Arguments args(call, name);
  if (name == "tojson") return do_tojson(base, args);
  if (name == "default" || name == "d") return do_default(base, args);
  if (name == "safe") return Value::from_string(base.is_string() ? base.text : python_str(base), true);
  if (name == "escape" || name == "e" || name == "forceescape") {
    if (base.markup && name != "forceescape") return base;
    return Value::from_string(html_escape(python_str(base)), true);
  }
  if (name == "string") return base.is_string() ? base : Value::from_string(python_str(base));
  if (name == "length" || name == "count") {
    switch (base.kind) {
      case Kind::Undefined: return Value::from_int(0);
      case Kind::String: return Value::from_int(static_cast<int64_t>(unicode::code_point_count(base.text)));
      case Kind::List:
        if (base.list->is_generator) raise("object of type 'generator' has no len()");
        return Value::from_int(static_cast<int64_t>(base.list->items.size()));
      case Kind::Dict: return Value::from_int(static_cast<int64_t>(base.dict->entries.size()));
      default: raise("object of type {} has no len()", quoted_type(base));
    }
  }
  if (name == "trim") {
    Value chars = args.get(0, "chars");
    std::string chars_text = chars.is_none() ? std::string() : as_string(chars, "trim characters");
    return string_like(base, unicode::strip(python_str(base), chars.is_none() ? nullptr : &chars_text, true, true));
  }
  if (name == "upper") return string_like(base, unicode::to_upper(python_str(base)));
  if (name == "lower") return string_like(base, unicode::to_lower(python_str(base)));
  if (name == "capitalize") return string_like(base, unicode::python_capitalize(python_str(base)));
  if (name == "title") return do_title_filter(base);
  if (name == "replace") {
    std::string s = python_str(base);
    const std::string old = python_str(args.require(0, "old"));
    const std::string replacement = python_str(args.require(1, "new"));
    Value count = args.get(2, "count");
    return string_like(base, replace_all(s, old, replacement, count.is_none() ? -1 : as_int(count, "count")));
  }
  if (name == "items") {
    if (base.is_undefined()) return Value::from_list({});
    if (base.kind != Kind::Dict) raise("Can only get item pairs from a mapping.");
    return Value::from_list(dict_items(base));
  }
  if (name == "list") return Value::from_list(iterate(base));
  if (name == "join") {
    std::string separator = python_str(args.get(0, "d", Value::from_string("")));
    Value attribute = args.get(1, "attribute");
    std::string out;
    bool first = true;
    bool any_markup = false;
    for (const Value& item : iterate(base)) {
      Value v = attribute.is_none() ? item : lookup_attribute_path(item, attribute);
      if (!first) out += separator;
      first = false;
      any_markup = any_markup || v.markup;
      out += python_str(v);
    }
    return Value::from_string(out);
  }
  if (name == "first" || name == "last") {
    auto items = iterate(base);
    if (items.empty()) return Value::undefined(fmt::format("No {} item, sequence was empty.", name));
    return name == "first" ? items.front() : items.back();
  }
  if (name == "reverse") {
    if (base.is_string()) {
      std::u32string cps = unicode::decode(base.text);
      std::reverse(cps.begin(), cps.end());
      return string_like(base, unicode::encode(cps));
    }
    auto items = iterate(base);
    std::reverse(items.begin(), items.end());
    return Value::from_list(std::move(items));
  }
  if (name == "select" || name == "reject") return select_or_reject(base, call, false, name == "select");
  if (name == "selectattr" || name == "rejectattr") return select_or_reject(base, call, true, name == "selectattr");
  if (name == "map") return do_map(base, call);
  if (name == "attr") return get_attribute(base, as_string(args.require(0, "name"), "attribute name"));
  if (name == "unique" || name == "sort" || name == "min" || name == "max") {
    bool case_sensitive = args.get(name == "sort" ? 1 : 0, "case_sensitive", Value::from_bool(false)).truthy();
    Value attribute = args.get(name == "sort" ? 2 : 1, "attribute");
    auto key = [&](const Value& item) {
      Value v = attribute.is_none() ? item : lookup_attribute_path(item, attribute);
      if (!case_sensitive && v.is_string()) return Value::from_string(unicode::to_lower(v.text));
      return v;
    };
    auto items = iterate(base);
    if (name == "unique") {
      std::vector<Value> out, seen;
      for (const Value& item : items) {
        Value k = key(item);
        if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return python_equal(s, k); })) {
          seen.push_back(k);
          out.push_back(item);
        }
      }
      return Value::from_list(std::move(out));
    }
    if (name == "sort") {
      bool reverse = args.get(0, "reverse", Value::from_bool(false)).truthy();
      std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
        return reverse ? python_less(key(b), key(a)) : python_less(key(a), key(b));
      });
      return Value::from_list(std::move(items));
    }
    if (items.empty()) return Value::undefined(fmt::format("No aggregated item, sequence was empty."));
    Value best = items[0];
    for (const Value& item : items)
      if (name == "min" ? python_less(key(item), key(best)) : python_less(key(best), key(item))) best = item;
    return best;
  }
  if (name == "dictsort") {
    if (base.kind != Kind::Dict) raise("You can only sort by either \"key\" or \"value\" of a mapping");
    bool case_sensitive = args.get(0, "case_sensitive", Value::from_bool(false)).truthy();
    std::string by = python_str(args.get(1, "by", Value::from_string("key")));
    bool reverse = args.get(2, "reverse", Value::from_bool(false)).truthy();
    auto items = dict_items(base);
    auto key = [&](const Value& pair) {
      Value v = pair.list->items[by == "value" ? 1 : 0];
      if (!case_sensitive && v.is_string()) return Value::from_string(unicode::to_lower(v.text));
      return v;
    };
    std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
      return reverse ? python_less(key(b), key(a)) : python_less(key(a), key(b));
    });
    return Value::from_list(std::move(items));
  }
  if (name == "int") {
    Value fallback = args.get(0, "default", Value::from_int(0));
    if (base.kind == Kind::Int) return base;
    if (base.kind == Kind::Bool) return Value::from_int(base.boolean);
    if (base.kind == Kind::Float) return Value::from_int(static_cast<int64_t>(base.floating));
    if (base.is_string()) {
      std::string t = unicode::strip(base.text, nullptr, true, true);
      try {
        size_t used = 0;
        int64_t v = std::stoll(t, &used, 10);
        if (used == t.size()) return Value::from_int(v);
        double d = std::stod(t, &used);
        if (used == t.size()) return Value::from_int(static_cast<int64_t>(d));
      } catch (const std::exception&) {
      }
    }
    return fallback;
  }
  if (name == "float") {
    Value fallback = args.get(0, "default", Value::from_float(0.0));
    if (base.is_number()) return Value::from_float(as_double(base));
    if (base.is_string()) {
      try {
        size_t used = 0;
        std::string t = unicode::strip(base.text, nullptr, true, true);
        double d = std::stod(t, &used);
        if (used == t.size()) return Value::from_float(d);
      } catch (const std::exception&) {
      }
    }
    return fallback;
  }
  if (name == "abs") {
    if (base.kind == Kind::Float) return Value::from_float(std::fabs(base.floating));
    int64_t v = as_int(base, "abs() argument");
    return Value::from_int(v < 0 ? -v : v);
  }
  if (name == "round") {
    int64_t precision = as_int(args.get(0, "precision", Value::from_int(0)), "precision");
    std::string method = python_str(args.get(1, "method", Value::from_string("common")));
    double scale = std::pow(10.0, static_cast<double>(precision));
    double v = as_double(base) * scale;
    double r = method == "ceil" ? std::ceil(v) : method == "floor" ? std::floor(v) : std::round(v);
    return Value::from_float(r / scale);
  }
  if (name == "sum") {
    Value attribute = args.get(0, "attribute");
    Value total = args.get(1, "start", Value::from_int(0));
    for (const Value& item : iterate(base))
      total = binary_operation("+", total, attribute.is_none() ? item : lookup_attribute_path(item, attribute));
    return total;
  }
  if (name == "wordcount") return Value::from_int(static_cast<int64_t>(split_string(python_str(base), Value::none(), -1, false).size()));
  if (name == "indent") return do_indent(base, args);
  if (name == "center") {
    std::string s = python_str(base);
    int64_t width = as_int(args.get(0, "width", Value::from_int(80)), "width");
    int64_t length = static_cast<int64_t>(unicode::code_point_count(s));
    if (width <= length) return Value::from_string(s);
    int64_t total = width - length;
    int64_t left = total / 2 + (total & width & 1);
    return Value::from_string(std::string(left, ' ') + s + std::string(total - left, ' '));
  }
  if (name == "batch") {
    int64_t size = as_int(args.require(0, "linecount"), "linecount");
    if (size <= 0) raise("batch size must be positive");
    Value fill = args.get(1, "fill_with");
    std::vector<Value> batches, current;
    for (const Value& item : iterate(base)) {
      current.push_back(item);
      if (static_cast<int64_t>(current.size()) == size) {
        batches.push_back(Value::from_list(std::move(current)));
        current.clear();
      }
    }
    if (!current.empty()) {
      if (!fill.is_none())
        while (static_cast<int64_t>(current.size()) < size) current.push_back(fill);
      batches.push_back(Value::from_list(std::move(current)));
    }
    return Value::from_list(std::move(batches));
  }
  raise("no filter named '{}'", name);
}

bool apply_test(const std::string& name, const Value& v, CallArguments& call) {
  Arguments args(call, name);
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.kind == Kind::Bool;
  if (name == "false") return v.kind == Kind::Bool && !v.boolean;
  if (name == "true") return v.kind == Kind::Bool && v.boolean;
  if (name == "integer") return v.kind == Kind::Int;
  if (name == "float") return v.kind == Kind::Float;
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.kind == Kind::Dict;
  if (name == "iterable")
    return v.kind == Kind::Undefined || v.kind == Kind::String || v.kind == Kind::List || v.kind == Kind::Dict;
  if (name == "sequence")
    return v.kind == Kind::Undefined || v.kind == Kind::String || (v.kind == Kind::List && !v.list->is_generator) ||
           v.kind == Kind::Dict;
  if (name == "callable") return v.kind == Kind::Callable;
  if (name == "escaped") return v.markup;
  if (name == "sameas") {
    Value other = args.require(0, "other");
    if (v.kind != other.kind) return false;
    if (v.kind == Kind::None || v.kind == Kind::Undefined) return true;
    if (v.kind == Kind::Bool) return v.boolean == other.boolean;
    if (v.kind == Kind::List) return v.list == other.list;
    if (v.kind == Kind::Dict) return v.dict == other.dict;
    if (v.kind == Kind::Namespace) return v.ns == other.ns;
    return python_equal(v, other);
  }
  if (name == "in") {
    Value container = args.require(0, "seq");
    return compare("in", v, container);
  }
  if (name == "eq" || name == "equalto" || name == "==") return compare("==", v, args.require(0, "other"));
  if (name == "ne" || name == "!=") return compare("!=", v, args.require(0, "other"));
  if (name == "lt" || name == "<" || name == "lessthan") return compare("<", v, args.require(0, "other"));
  if (name == "le" || name == "<=") return compare("<=", v, args.require(0, "other"));
  if (name == "gt" || name == ">" || name == "greaterthan") return compare(">", v, args.require(0, "other"));
  if (name == "ge" || name == ">=") return compare(">=", v, args.require(0, "other"));
  if (name == "odd" || name == "even") {
    int64_t i = as_int(v, "value");
    int64_t mod = ((i % 2) + 2) % 2;
    return name == "odd" ? mod == 1 : mod == 0;
  }
  if (name == "divisibleby") {
    int64_t d = as_int(args.require(0, "num"), "divisor");
    if (d == 0) raise("integer division or modulo by zero");
    return as_int(v, "value") % d == 0;
  }
  if (name == "lower" || name == "upper") {
    CallArguments none;
    return string_method(Value::from_string(python_str(v)), name == "lower" ? "islower" : "isupper", none).boolean;
  }
  if (name == "filter") return v.is_string() && is_known_filter(v.text);
  if (name == "test") return v.is_string() && is_known_test(v.text);
  raise("no test named '{}'", name);
}

Value get_attribute(const Value& object, const std::string& name) {
  switch (object.kind) {
    case Kind::Undefined: raise_undefined(object);
    case Kind::String:
      if (kStringMethods.count(name)) return bound_method(object, name, string_method);
      return Value::undefined(fmt::format("'str object' has no attribute '{}'", name));
    case Kind::Dict: {
      if (kDictMethods.count(name)) return bound_method(object, name, dict_method);
      if (kDictMutators.count(name)) return unsafe_method(object, name);
      const Value* found = object.dict->find(Value::from_string(name));
      if (found) return *found;
      return Value::undefined(fmt::format("'dict object' has no attribute '{}'", name));
    }
    case Kind::List:
      if (kListMethods.count(name)) return bound_method(object, name, list_method);
      if (kListMutators.count(name)) return unsafe_method(object, name);
      return Value::undefined(fmt::format("'{} object' has no attribute '{}'", object.type_name(), name));
    case Kind::Namespace: {
      const Value* found = object.ns->find(name);
      if (found) return *found;
      return Value::undefined(fmt::format("'{}' object has no attribute '{}'", object.type_name(), name));
    }
    default:
      return Value::undefined(fmt::format("'{} object' has no attribute '{}'", object.type_name(), name));
  }
}

namespace {

int64_t normalize_index(int64_t index, size_t size, bool& in_range) {
  int64_t n = static_cast<int64_t>(size);
  if (index < 0) index += n;
  in_range = index >= 0 && index < n;
  return index;
}

}  // namespace

Value get_item(const Value& object, const Value& key) {
  switch (object.kind) {
    case Kind::Undefined: raise_undefined(object);
    case Kind::Dict: {
      const Value* found = object.dict->find(key);
      if (found) return *found;
      if (key.is_string() && (kDictMethods.count(key.text) || kDictMutators.count(key.text))) return get_attribute(object, key.text);
      return Value::undefined(fmt::format("'dict object' has no attribute {}", python_repr(key)));
    }
    case Kind::List:
      if (object.list->is_generator) return Value::undefined("'generator' object is not subscriptable");
      if (key.kind == Kind::Int || key.kind == Kind::Bool) {
        bool ok = false;
        int64_t i = normalize_index(key.kind == Kind::Bool ? key.boolean : key.integer, object.list->items.size(), ok);
        if (ok) return object.list->items[i];
        return Value::undefined(fmt::format("'{} object' has no element {}", object.type_name(), python_str(key)));
      }
      if (key.is_string()) return get_attribute(object, key.text);
      return Value::undefined(fmt::format("'{} object' has no element {}", object.type_name(), python_repr(key)));
    case Kind::String:
      if (key.kind == Kind::Int || key.kind == Kind::Bool) {
        std::u32string cps = unicode::decode(object.text);
        bool ok = false;
        int64_t i = normalize_index(key.kind == Kind::Bool ? key.boolean : key.integer, cps.size(), ok);
        if (ok) return string_like(object, unicode::encode(std::u32string(1, cps[i])));
        return Value::undefined(fmt::format("'str object' has no element {}", python_str(key)));
      }
      if (key.is_string()) return get_attribute(object, key.text);
      return Value::undefined(fmt::format("'str object' has no element {}", python_repr(key)));
    case Kind::Namespace:
      if (key.is_string()) return get_attribute(object, key.text);
      [[fallthrough]];
    default:
      return Value::undefined(fmt::format("'{} object' has no element {}", object.type_name(), python_repr(key)));
  }
}

Value get_slice(const Value& object, const Value& start_v, const Value& stop_v, const Value& step_v) {
  if (object.is_undefined()) raise_undefined(object);
  if (object.kind != Kind::List && object.kind != Kind::String)
    raise("{} object is not subscriptable with a slice", quoted_type(object));
  auto optional_int = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_none() || v.is_undefined()) return std::nullopt;
    return as_int(v, what);
  };
  int64_t step = optional_int(step_v, "slice step").value_or(1);
  if (step == 0) raise("slice step cannot be zero");
  std::u32string cps;
  size_t length = 0;
  if (object.is_string()) {
    cps = unicode::decode(object.text);
    length = cps.size();
  } else {
    length = object.list->items.size();
  }
  int64_t n = static_cast<int64_t>(length);
  // CPython's PySlice_AdjustIndices.
  auto adjust = [&](std::optional<int64_t> v, int64_t fallback) {
    if (!v) return fallback;
    int64_t i = *v;
    if (i < 0) {
      i += n;
      if (i < 0) i = step < 0 ? -1 : 0;
    } else if (i >= n) {
      i = step < 0 ? n - 1 : n;
    }
    return i;
  };
  int64_t start = adjust(optional_int(start_v, "slice start"), step < 0 ? n - 1 : 0);
  int64_t stop = adjust(optional_int(stop_v, "slice stop"), step < 0 ? -1 : n);
  std::vector<int64_t> indices;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) indices.push_back(i);
  if (object.is_string()) {
    std::u32string out;
    for (int64_t i : indices) out.push_back(cps[i]);
    return string_like(object, unicode::encode(out));
  }
  std::vector<Value> out;
  for (int64_t i : indices) out.push_back(object.list->items[i]);
  return Value::from_list(std::move(out), object.list->is_tuple);
}

namespace {

int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

[[noreturn]] void unsupported_operands(const std::string& op, const Value& a, const Value& b) {
  raise("unsupported operand type(s) for {}: {} and {}", op, quoted_type(a), quoted_type(b));
}

}  // namespace

Value binary_operation(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") {
    return Value::from_string(python_str(a) + python_str(b));
  }
  if (a.is_undefined()) raise_undefined(a);
  if (b.is_undefined()) raise_undefined(b);
  bool numeric = a.is_number() && b.is_number();
  bool integral = numeric && a.kind != Kind::Float && b.kind != Kind::Float;
  auto int_of = [](const Value& v) { return v.kind == Kind::Bool ? static_cast<int64_t>(v.boolean) : v.integer; };
  if (op == "+") {
    if (integral) return Value::from_int(int_of(a) + int_of(b));
    if (numeric) return Value::from_float(as_double(a) + as_double(b));
    if (a.is_string() && b.is_string()) {
      // markupsafe: Markup + str escapes the plain str (and vice versa).
      if (a.markup && !b.markup) return Value::from_string(a.text + html_escape(b.text), true);
      if (!a.markup && b.markup) return Value::from_string(html_escape(a.text) + b.text, true);
      return Value::from_string(a.text + b.text, a.markup);
    }
    if (a.kind == Kind::List && b.kind == Kind::List && a.list->is_tuple == b.list->is_tuple) {
      std::vector<Value> items = a.list->items;
      items.insert(items.end(), b.list->items.begin(), b.list->items.end());
      return Value::from_list(std::move(items), a.list->is_tuple);
    }
    if (a.is_string()) raise("can only concatenate str (not \"{}\") to str", b.type_name());
    if (a.kind == Kind::List) raise("can only concatenate list (not \"{}\") to list", b.type_name());
    unsupported_operands("+", a, b);
  }
  if (op == "-") {
    if (integral) return Value::from_int(int_of(a) - int_of(b));
    if (numeric) return Value::from_float(as_double(a) - as_double(b));
    unsupported_operands("-", a, b);
  }
  if (op == "*") {
    if (integral) return Value::from_int(int_of(a) * int_of(b));
    if (numeric) return Value::from_float(as_double(a) * as_double(b));
    const Value* sequence = a.is_string() || a.kind == Kind::List ? &a : &b;
    const Value* count = sequence == &a ? &b : &a;
    if ((sequence->is_string() || sequence->kind == Kind::List) && (count->kind == Kind::Int || count->kind == Kind::Bool)) {
      int64_t n = std::max<int64_t>(0, int_of(*count));
      if (sequence->is_string()) {
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += sequence->text;
        return string_like(*sequence, out);
      }
      std::vector<Value> items;
      for (int64_t i = 0; i < n; ++i) items.insert(items.end(), sequence->list->items.begin(), sequence->list->items.end());
      return Value::from_list(std::move(items), sequence->list->is_tuple);
    }
    unsupported_operands("*", a, b);
  }
  if (op == "/") {
    if (!numeric) unsupported_operands("/", a, b);
    if (as_double(b) == 0.0) raise("division by zero");
    return Value::from_float(as_double(a) / as_double(b));
  }
  if (op == "//" || op == "%") {
    if (!numeric) {
      if (op == "%" && a.is_string())
        raise("printf-style '%' string formatting is not supported by spindle's renderer; use ~ or + to build the string");
      unsupported_operands(op, a, b);
    }
    if (integral) {
      if (int_of(b) == 0) raise("integer division or modulo by zero");
      int64_t q = floor_div(int_of(a), int_of(b));
      return op == "//" ? Value::from_int(q) : Value::from_int(int_of(a) - q * int_of(b));
    }
    double x = as_double(a), y = as_double(b);
    if (y == 0.0) raise("float division by zero");
    double q = std::floor(x / y);
    if (op == "//") return Value::from_float(q);
    double m = std::fmod(x, y);
    if (m != 0.0 && ((m < 0) != (y < 0))) m += y;
    return Value::from_float(m);
  }
  if (op == "**") {
    if (!numeric) unsupported_operands("** or pow()", a, b);
    if (integral && int_of(b) >= 0) {
      int64_t result = 1;
      for (int64_t i = 0; i < int_of(b); ++i) result *= int_of(a);
      return Value::from_int(result);
    }
    return Value::from_float(std::pow(as_double(a), as_double(b)));
  }
  raise("unknown operator {}", op);
}

bool compare(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return python_equal(a, b);
  if (op == "!=") return !python_equal(a, b);
  if (op == "in" || op == "notin") {
    bool found = false;
    switch (b.kind) {
      case Kind::Undefined: found = false; break;
      case Kind::String:
        if (!a.is_string()) raise("'in <string>' requires string as left operand, not {}", a.type_name());
        found = b.text.find(a.text) != std::string::npos;
        break;
      case Kind::List:
        found = std::any_of(b.list->items.begin(), b.list->items.end(), [&](const Value& x) { return python_equal(x, a); });
        break;
      case Kind::Dict: found = b.dict->find(a) != nullptr; break;
      default: raise("argument of type {} is not iterable", quoted_type(b));
    }
    return op == "in" ? found : !found;
  }
  if (a.is_undefined()) raise_undefined(a);
  if (b.is_undefined()) raise_undefined(b);
  int order = 0;
  if (a.is_number() && b.is_number()) {
    double x = as_double(a), y = as_double(b);
    if (a.kind != Kind::Float && b.kind != Kind::Float) {
      int64_t i = a.kind == Kind::Bool ? a.boolean : a.integer, j = b.kind == Kind::Bool ? b.boolean : b.integer;
      order = i < j ? -1 : i > j ? 1 : 0;
    } else {
      if (std::isnan(x) || std::isnan(y)) return false;
      order = x < y ? -1 : x > y ? 1 : 0;
    }
  } else if (a.is_string() && b.is_string()) {
    order = a.text < b.text ? -1 : a.text > b.text ? 1 : 0;  // UTF-8 byte order is code point order
  } else if (a.kind == Kind::List && b.kind == Kind::List) {
    size_t n = std::min(a.list->items.size(), b.list->items.size());
    size_t i = 0;
    while (i < n && python_equal(a.list->items[i], b.list->items[i])) ++i;
    if (i < n) return compare(op, a.list->items[i], b.list->items[i]);
    order = a.list->items.size() < b.list->items.size() ? -1 : a.list->items.size() > b.list->items.size() ? 1 : 0;
  } else {
    raise("'{}' not supported between instances of {} and {}", op, quoted_type(a), quoted_type(b));
  }
  if (op == "<") return order < 0;
  if (op == ">") return order > 0;
  if (op == "<=") return order <= 0;
  return order >= 0;
}

Value negate(const Value& v) {
  if (v.is_undefined()) raise_undefined(v);
  if (v.kind == Kind::Int) return Value::from_int(-v.integer);
  if (v.kind == Kind::Bool) return Value::from_int(-static_cast<int64_t>(v.boolean));
  if (v.kind == Kind::Float) return Value::from_float(-v.floating);
  raise("bad operand type for unary -: {}", quoted_type(v));
}

}  // namespace spindle::chat
