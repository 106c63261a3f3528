#include "data/chat/interpreter.h"

#include <ctime>
#include <unordered_map>

#include "data/chat/builtins.h"
#include "data/chat/parser.h"
#include "data/chat/template_fail.h"

namespace spindle::chat {
namespace {

// ---------------------------------------------------------------- validation

void validate_expr(const Expr* e);

void validate_body(const StmtList& body, bool& has_generation);

void validate_expr(const Expr* e) {
  if (!e) return;
  if (e->kind == ExprKind::Filter && !is_known_filter(e->name))
    template_fail(e->line, "no filter named '{}' (spindle supports the jinja2 filters chat templates use; see "
                           "docs/chat_templates.md)", e->name);
  if (e->kind == ExprKind::Test && !is_known_test(e->name))
    template_fail(e->line, "no test named '{}' (see docs/chat_templates.md for the supported tests)", e->name);
  validate_expr(e->base.get());
  validate_expr(e->index.get());
  validate_expr(e->slice_start.get());
  validate_expr(e->slice_stop.get());
  validate_expr(e->slice_step.get());
  validate_expr(e->condition.get());
  validate_expr(e->otherwise.get());
  validate_expr(e->star_args.get());
  validate_expr(e->star_kwargs.get());
  for (const auto& a : e->args) validate_expr(a.get());
  for (const auto& a : e->values) validate_expr(a.get());
  for (const auto& k : e->keywords) validate_expr(k.value.get());
  for (const auto& c : e->comparisons) validate_expr(c.second.get());
}

void validate_body(const StmtList& body, bool& has_generation) {
  for (const auto& s : body) {
    if (s->kind == StmtKind::Generation) has_generation = true;
    validate_expr(s->expr.get());
    validate_expr(s->loop_filter.get());
    for (const auto& f : s->filters) validate_expr(f.get());
    for (const auto& [cond, branch] : s->branches) {
      validate_expr(cond.get());
      validate_body(branch, has_generation);
    }
    for (const auto& p : s->parameters) validate_expr(p.default_value.get());
    for (const auto& w : s->with_assignments) validate_expr(w.second.get());
    validate_body(s->body, has_generation);
    validate_body(s->else_body, has_generation);
  }
}

// ---------------------------------------------------------------- execution

struct Frame {
  std::unordered_map<std::string, Value> variables;
  std::shared_ptr<Frame> parent;

  const Value* lookup(const std::string& name) const {
    for (const Frame* f = this; f; f = f->parent.get()) {
      auto it = f->variables.find(name);
      if (it != f->variables.end()) return &it->second;
    }
    return nullptr;
  }
};
using FramePtr = std::shared_ptr<Frame>;

FramePtr child_frame(const FramePtr& parent) {
  auto f = std::make_shared<Frame>();
  f->parent = parent;
  return f;
}

enum class Flow { Normal, Break, Continue };

Value make_callable(std::string name, std::function<Value(CallArguments&)> fn) {
  Value v;
  v.kind = Kind::Callable;
  v.callable = std::make_shared<CallableObject>(CallableObject{std::move(name), std::move(fn)});
  return v;
}

class Interpreter {
 public:
  Interpreter(const RenderOptions& options, std::vector<ByteSpan>* spans) : options_(options), spans_(spans) {
    out_ = &top_output_;
    install_globals();
  }

  std::string run(const Program& program, const nlohmann::ordered_json& context) {
    if (!context.is_object()) template_fail(0, "the render context must be a JSON object of template variables");
    auto root = std::make_shared<Frame>();
    for (const auto& [key, value] : context.items()) root->variables[key] = Value::from_json(value);
    try {
      exec_body(program.body, root);
    } catch (const TemplateRuntimeError& e) {
      throw TemplateError(line_, e.what());
    }
    return std::move(top_output_);
  }

 private:
  void install_globals() {
    globals_["raise_exception"] = make_callable("raise_exception", [this](CallArguments& args) -> Value {
      std::string message = args.positional.empty() ? std::string() : python_str(args.positional[0]);
      throw TemplateError(line_, "raise_exception: " + message);
    });
    globals_["strftime_now"] = make_callable("strftime_now", [this](CallArguments& args) -> Value {
      if (args.positional.empty() || !args.positional[0].is_string()) raise("strftime_now() needs a format string");
      auto now = options_.now.value_or(std::chrono::system_clock::now());
      std::time_t t = std::chrono::system_clock::to_time_t(now);
      std::tm local{};
      localtime_r(&t, &local);
      char buffer[512];
      size_t n = std::strftime(buffer, sizeof buffer, args.positional[0].text.c_str(), &local);
      return Value::from_string(std::string(buffer, n));
    });
    globals_["namespace"] = make_callable("namespace", [](CallArguments& args) -> Value {
      Value v;
      v.kind = Kind::Namespace;
      v.ns = std::make_shared<NamespaceObject>();
      for (const Value& p : args.positional) {
        if (p.kind != Kind::Dict) raise("namespace() positional arguments must be mappings");
        for (const auto& [k, item] : p.dict->entries) v.ns->set(python_str(k), item);
      }
      for (const auto& [k, item] : args.keywords) v.ns->set(k, item);
      return v;
    });
    globals_["dict"] = make_callable("dict", [](CallArguments& args) -> Value {
      Value d = Value::empty_dict();
      for (const Value& p : args.positional) {
        if (p.kind == Kind::Dict)
          for (const auto& [k, item] : p.dict->entries) d.dict->set(k, item);
        else
          for (const Value& pair : iterate(p)) {
            auto kv = iterate(pair);
            if (kv.size() != 2) raise("dict() sequence elements must be key/value pairs");
            d.dict->set(kv[0], kv[1]);
          }
      }
      for (const auto& [k, item] : args.keywords) d.dict->set(Value::from_string(k), item);
      return d;
    });
    globals_["range"] = make_callable("range", [](CallArguments& args) -> Value {
      auto int_arg = [&](size_t i) {
        const Value& v = args.positional[i];
        if (v.kind != Kind::Int && v.kind != Kind::Bool) raise("range() arguments must be integers, not '{}'", v.type_name());
        return v.kind == Kind::Bool ? static_cast<int64_t>(v.boolean) : v.integer;
      };
      int64_t start = 0, stop = 0, step = 1;
      if (args.positional.size() == 1) stop = int_arg(0);
      else if (args.positional.size() >= 2) start = int_arg(0), stop = int_arg(1);
      else raise("range expected at least 1 argument, got 0");
      if (args.positional.size() >= 3) step = int_arg(2);
      if (step == 0) raise("range() arg 3 must not be zero");
      std::vector<Value> items;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        // jinja2's sandbox refuses ranges over 100000 items.
        if (items.size() >= 100000) raise("range too big, maximum size for range is 100000");
        items.push_back(Value::from_int(i));
      }
      return Value::from_list(std::move(items));
    });
  }

  Value lookup(const std::string& name, const Frame& frame) const {
    if (const Value* v = frame.lookup(name)) return *v;
    auto it = globals_.find(name);
    if (it != globals_.end()) return it->second;
    return Value::undefined(fmt::format("'{}' is undefined", name));
  }

  // ---- statements

  Flow exec_body(const StmtList& body, const FramePtr& frame) {
    for (const auto& s : body) {
      Flow flow = exec(*s, frame);
      if (flow != Flow::Normal) return flow;
    }
    return Flow::Normal;
  }

  std::string capture(const StmtList& body, const FramePtr& frame) {
    std::string buffer;
    std::string* saved = out_;
    out_ = &buffer;
    try {
      exec_body(body, frame);
    } catch (...) {
      out_ = saved;
      throw;
    }
    out_ = saved;
    return buffer;
  }

  void assign(const Target& target, const Value& value, Frame& frame, int line) {
    if (!target.namespace_attribute.empty()) {
      Value object = lookup(target.names[0], frame);
      if (object.kind != Kind::Namespace || object.ns->is_loop)
        template_fail(line, "cannot assign attribute '{}' on '{}', which is not a namespace() object",
                      target.namespace_attribute, target.names[0]);
      object.ns->set(target.namespace_attribute, value);
      return;
    }
    if (!target.is_tuple) {
      frame.variables[target.names[0]] = value;
      return;
    }
    std::vector<Value> items = iterate(value);
    if (items.size() != target.names.size())
      raise("{} values to unpack (expected {}, got {})", items.size() < target.names.size() ? "not enough" : "too many",
            target.names.size(), items.size());
    for (size_t i = 0; i < items.size(); ++i) frame.variables[target.names[i]] = items[i];
  }

  Flow exec(const Stmt& s, const FramePtr& frame) {
    line_ = s.line;
    switch (s.kind) {
      case StmtKind::Text: *out_ += s.text; return Flow::Normal;
      case StmtKind::Print: {
        Value v = eval(*s.expr, *frame);
        *out_ += python_str(v);
        return Flow::Normal;
      }
      case StmtKind::If: {
        for (const auto& [condition, branch] : s.branches)
          if (eval(*condition, *frame).truthy()) return exec_body(branch, frame);
        return exec_body(s.else_body, frame);
      }
      case StmtKind::For: exec_for(s, frame); return Flow::Normal;
      case StmtKind::Set: assign(s.target, eval(*s.expr, *frame), *frame, s.line); return Flow::Normal;
      case StmtKind::SetBlock: {
        Value v = Value::from_string(capture(s.body, frame));
        v = apply_filter_chain(s.filters, v, *frame);
        assign(s.target, v, *frame, s.line);
        return Flow::Normal;
      }
      case StmtKind::Macro: {
        frame->variables[s.macro_name] = make_macro(s, frame);
        return Flow::Normal;
      }
      case StmtKind::CallBlock: {
        const Expr& call = *s.expr;
        Value callee = eval(*call.base, *frame);
        CallArguments args = eval_arguments(call, *frame);
        args.keywords.emplace_back("caller", make_caller(s, frame));
        line_ = s.line;
        *out_ += python_str(invoke(callee, args));
        return Flow::Normal;
      }
      case StmtKind::FilterBlock: {
        Value v = Value::from_string(capture(s.body, frame));
        *out_ += python_str(apply_filter_chain(s.filters, v, *frame));
        return Flow::Normal;
      }
      case StmtKind::Generation: {
        std::string body = capture(s.body, frame);
        // transformers measures the start as everything the top-level template has yielded so far,
        // which is the true offset whenever the block is not inside buffered output (set/macro).
        if (spans_) spans_->push_back({top_output_.size(), top_output_.size() + body.size()});
        *out_ += body;
        return Flow::Normal;
      }
      case StmtKind::Break: return Flow::Break;
      case StmtKind::Continue: return Flow::Continue;
      case StmtKind::With: {
        FramePtr inner = child_frame(frame);
        for (const auto& [target, expr] : s.with_assignments) assign(target, eval(*expr, *frame), *inner, s.line);
        return exec_body(s.body, inner);
      }
    }
    return Flow::Normal;
  }

  Value apply_filter_chain(const std::vector<ExprPtr>& filters, Value v, Frame& frame) {
    for (const auto& f : filters) {
      CallArguments args = eval_arguments(*f, frame);
      line_ = f->line;
      v = apply_filter(f->name, v, args);
    }
    return v;
  }

  void exec_for(const Stmt& s, const FramePtr& frame) {
    Value iterable = eval(*s.expr, *frame);
    if (iterable.is_none()) raise("'NoneType' object is not iterable");
    std::vector<Value> items = iterate(iterable);
    if (s.loop_filter) {
      std::vector<Value> kept;
      for (const Value& item : items) {
        FramePtr probe = child_frame(frame);
        assign(s.target, item, *probe, s.line);
        if (eval(*s.loop_filter, *probe).truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      exec_body(s.else_body, frame);
      return;
    }
    const int64_t length = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < length; ++i) {
      FramePtr iteration = child_frame(frame);
      assign(s.target, items[i], *iteration, s.line);
      Value loop;
      loop.kind = Kind::Namespace;
      loop.ns = std::make_shared<NamespaceObject>();
      loop.ns->is_loop = true;
      auto& ns = *loop.ns;
      ns.set("index0", Value::from_int(i));
      ns.set("index", Value::from_int(i + 1));
      ns.set("revindex", Value::from_int(length - i));
      ns.set("revindex0", Value::from_int(length - i - 1));
      ns.set("first", Value::from_bool(i == 0));
      ns.set("last", Value::from_bool(i == length - 1));
      ns.set("length", Value::from_int(length));
      ns.set("depth", Value::from_int(1));
      ns.set("depth0", Value::from_int(0));
      ns.set("previtem", i > 0 ? items[i - 1] : Value::undefined("there is no previous item"));
      ns.set("nextitem", i + 1 < length ? items[i + 1] : Value::undefined("there is no next item"));
      ns.set("cycle", make_callable("cycle", [i](CallArguments& args) -> Value {
               if (args.positional.empty()) raise("no items for cycling given");
               return args.positional[static_cast<size_t>(i) % args.positional.size()];
             }));
      iteration->variables["loop"] = loop;
      Flow flow = exec_body(s.body, iteration);
      if (flow == Flow::Break) break;
    }
  }

  Value make_macro(const Stmt& s, const FramePtr& defining_frame) {
    const Stmt* macro = &s;
    FramePtr keep = defining_frame;
    return make_callable(s.macro_name, [this, macro, keep](CallArguments& args) -> Value {
      FramePtr frame = child_frame(keep);
      const auto& params = macro->parameters;
      std::vector<Value> varargs;
      for (size_t i = 0; i < args.positional.size(); ++i) {
        if (i < params.size())
          frame->variables[params[i].name] = args.positional[i];
        else
          varargs.push_back(args.positional[i]);
      }
      Value kwargs = Value::empty_dict();
      for (const auto& [k, v] : args.keywords) {
        bool is_param = k == "caller";
        for (const auto& p : params) is_param = is_param || p.name == k;
        if (is_param)
          frame->variables[k] = v;
        else
          kwargs.dict->set(Value::from_string(k), v);
      }
      for (size_t i = args.positional.size(); i < params.size(); ++i) {
        if (frame->variables.count(params[i].name)) continue;
        frame->variables[params[i].name] =
            params[i].default_value ? eval(*params[i].default_value, *frame)
                                    : Value::undefined(fmt::format("parameter '{}' was not provided", params[i].name));
      }
      frame->variables["varargs"] = Value::from_list(std::move(varargs));
      frame->variables["kwargs"] = kwargs;
      int saved_line = line_;
      std::string output = capture(macro->body, frame);
      line_ = saved_line;
      return Value::from_string(std::move(output));
    });
  }

  Value make_caller(const Stmt& s, const FramePtr& frame) {
    const Stmt* block = &s;
    FramePtr keep = frame;
    return make_callable("caller", [this, block, keep](CallArguments& args) -> Value {
      FramePtr inner = child_frame(keep);
      for (size_t i = 0; i < block->parameters.size(); ++i) {
        const auto& p = block->parameters[i];
        if (i < args.positional.size())
          inner->variables[p.name] = args.positional[i];
        else if (p.default_value)
          inner->variables[p.name] = eval(*p.default_value, *inner);
      }
      for (const auto& [k, v] : args.keywords) inner->variables[k] = v;
      return Value::from_string(capture(block->body, inner));
    });
  }

  Value invoke(const Value& callee, CallArguments& args) {
    if (callee.kind == Kind::Callable) return callee.callable->call(args);
    if (callee.is_undefined()) raise_undefined(callee);
    raise("{} object is not callable", "'" + callee.type_name() + "'");
  }

  CallArguments eval_arguments(const Expr& e, Frame& frame) {
    CallArguments args;
    for (const auto& a : e.args) args.positional.push_back(eval(*a, frame));
    for (const auto& k : e.keywords) args.keywords.emplace_back(k.name, eval(*k.value, frame));
    if (e.star_args)
      for (const Value& v : iterate(eval(*e.star_args, frame))) args.positional.push_back(v);
    if (e.star_kwargs) {
      Value extra = eval(*e.star_kwargs, frame);
      if (extra.kind != Kind::Dict) raise("argument after ** must be a mapping, not '{}'", extra.type_name());
      for (const auto& [k, v] : extra.dict->entries) args.keywords.emplace_back(python_str(k), v);
    }
    return args;
  }

  // ---- expressions

  Value eval(const Expr& e, Frame& frame) {
    line_ = e.line;
    switch (e.kind) {
      case ExprKind::Constant: return e.constant;
      case ExprKind::Name: return lookup(e.name, frame);
      case ExprKind::Attribute: {
        Value base = eval(*e.base, frame);
        line_ = e.line;
        return get_attribute(base, e.name);
      }
      case ExprKind::Item: {
        Value base = eval(*e.base, frame);
        if (e.index->kind == ExprKind::Slice) {
          const Expr& slice = *e.index;
          Value start = slice.slice_start ? eval(*slice.slice_start, frame) : Value::none();
          Value stop = slice.slice_stop ? eval(*slice.slice_stop, frame) : Value::none();
          Value step = slice.slice_step ? eval(*slice.slice_step, frame) : Value::none();
          line_ = e.line;
          return get_slice(base, start, stop, step);
        }
        Value key = eval(*e.index, frame);
        line_ = e.line;
        return get_item(base, key);
      }
      case ExprKind::Slice: raise("a slice is only valid inside []");
      case ExprKind::Call: {
        Value callee = eval(*e.base, frame);
        CallArguments args = eval_arguments(e, frame);
        line_ = e.line;
        return invoke(callee, args);
      }
      case ExprKind::Filter: {
        Value base = eval(*e.base, frame);
        CallArguments args = eval_arguments(e, frame);
        line_ = e.line;
        return apply_filter(e.name, base, args);
      }
      case ExprKind::Test: {
        Value base = eval(*e.base, frame);
        CallArguments args = eval_arguments(e, frame);
        line_ = e.line;
        return Value::from_bool(apply_test(e.name, base, args) != e.negated);
      }
      case ExprKind::Negate: {
        Value v = eval(*e.base, frame);
        line_ = e.line;
        return negate(v);
      }
      case ExprKind::Plus: {
        Value v = eval(*e.base, frame);
        if (!v.is_number()) raise("bad operand type for unary +: '{}'", v.type_name());
        return v;
      }
      case ExprKind::Not: return Value::from_bool(!eval(*e.base, frame).truthy());
      case ExprKind::Binary: {
        Value left = eval(*e.base, frame);
        Value right = eval(*e.index, frame);
        line_ = e.line;
        return binary_operation(e.name, left, right);
      }
      case ExprKind::And: {
        Value left = eval(*e.base, frame);
        return left.truthy() ? eval(*e.index, frame) : left;
      }
      case ExprKind::Or: {
        Value left = eval(*e.base, frame);
        return left.truthy() ? left : eval(*e.index, frame);
      }
      case ExprKind::Compare: {
        Value left = eval(*e.base, frame);
        for (const auto& [op, operand] : e.comparisons) {
          Value right = eval(*operand, frame);
          line_ = e.line;
          if (!compare(op, left, right)) return Value::from_bool(false);
          left = std::move(right);
        }
        return Value::from_bool(true);
      }
      case ExprKind::Conditional: {
        if (eval(*e.condition, frame).truthy()) return eval(*e.base, frame);
        if (e.otherwise) return eval(*e.otherwise, frame);
        return Value::undefined("the inline if expression has no else branch and its condition was false");
      }
      case ExprKind::ListLiteral:
      case ExprKind::TupleLiteral: {
        std::vector<Value> items;
        for (const auto& a : e.args) items.push_back(eval(*a, frame));
        return Value::from_list(std::move(items), e.kind == ExprKind::TupleLiteral);
      }
      case ExprKind::DictLiteral: {
        Value d = Value::empty_dict();
        for (size_t i = 0; i < e.args.size(); ++i) {
          Value key = eval(*e.args[i], frame);
          d.dict->set(key, eval(*e.values[i], frame));
        }
        return d;
      }
    }
    raise("unsupported expression");
  }

  const RenderOptions& options_;
  std::vector<ByteSpan>* spans_;
  std::unordered_map<std::string, Value> globals_;
  std::string top_output_;
  std::string* out_;
  int line_ = 0;
};

}  // namespace

std::shared_ptr<const Program> compile_program(std::string source) {
  auto program = std::make_shared<Program>();
  program->body = parse_template(source);
  program->source = std::move(source);
  validate_body(program->body, program->has_generation_blocks);
  return program;
}

std::string run_program(const Program& program, const nlohmann::ordered_json& context, const RenderOptions& options,
                        std::vector<ByteSpan>* generation_spans) {
  Interpreter interpreter(options, generation_spans);
  return interpreter.run(program, context);
}

}  // namespace spindle::chat
