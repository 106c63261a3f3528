#include "data/chat/parser.h"

#include <set>

#include "data/chat/template_fail.h"
#include "data/chat/lexer.h"

namespace spindle::chat {
namespace {

ExprPtr make_expr(ExprKind kind, int line) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->line = line;
  return e;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  StmtList parse_all() {
    StmtList body = parse_statements({});
    if (current().type != TokenType::End) template_fail(current().line, "unexpected end of block");
    return body;
  }

 private:
  const Token& current() const { return tokens_[pos_]; }
  const Token& peek(size_t ahead = 1) const { return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)]; }
  Token next() { return tokens_[pos_ < tokens_.size() - 1 ? pos_++ : pos_]; }
  bool is_op(const char* op) const { return current().type == TokenType::Operator && current().text == op; }
  bool is_name(const char* name) const { return current().type == TokenType::Name && current().text == name; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    ++pos_;
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    ++pos_;
    return true;
  }
  std::string describe(const Token& t) const {
    switch (t.type) {
      case TokenType::End: return "end of template";
      case TokenType::BlockEnd: return "end of statement block ('%}')";
      case TokenType::VariableEnd: return "end of print statement ('}}')";
      case TokenType::Data: return "template data";
      default: return "'" + t.text + "'";
    }
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) template_fail(current().line, "expected '{}', got {}", op, describe(current()));
  }
  std::string expect_name() {
    if (current().type != TokenType::Name)
      template_fail(current().line, "expected a name, got {}", describe(current()));
    return next().text;
  }
  void expect_block_end() {
    if (current().type != TokenType::BlockEnd)
      template_fail(current().line, "expected end of statement block ('%}}'), got {}", describe(current()));
    ++pos_;
  }

  // Parses statements until a block tag whose keyword is in `end_keywords` (left unconsumed,
  // positioned at the keyword).
  StmtList parse_statements(const std::set<std::string>& end_keywords) {
    StmtList body;
    while (true) {
      const Token& t = current();
      if (t.type == TokenType::End) {
        if (!end_keywords.empty()) {
          std::string expected;
          for (const auto& k : end_keywords) expected += (expected.empty() ? "'" : " or '") + k + "'";
          template_fail(t.line, "unexpected end of template; jinja was looking for {}", expected);
        }
        return body;
      }
      if (t.type == TokenType::Data) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Text;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        ++pos_;
      } else if (t.type == TokenType::VariableBegin) {
        ++pos_;
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Print;
        s->line = t.line;
        s->expr = parse_tuple(true);
        if (current().type != TokenType::VariableEnd)
          template_fail(current().line, "expected end of print statement ('}}}}'), got {}", describe(current()));
        ++pos_;
        body.push_back(std::move(s));
      } else if (t.type == TokenType::BlockBegin) {
        const Token& keyword = peek();
        if (keyword.type == TokenType::Name && end_keywords.count(keyword.text)) {
          ++pos_;
          return body;
        }
        ++pos_;
        body.push_back(parse_statement());
      } else {
        template_fail(t.line, "unexpected {}", describe(t));
      }
    }
  }

  // After parse_statements stopped at an end keyword: consume `keyword %}`.
  void finish_block(const char* keyword) {
    if (!skip_name(keyword)) template_fail(current().line, "expected '{}'", keyword);
    expect_block_end();
  }

  std::unique_ptr<Stmt> parse_statement() {
    const Token& t = current();
    if (t.type != TokenType::Name) template_fail(t.line, "tag name expected, got {}", describe(t));
    int line = t.line;
    std::string keyword = next().text;
    auto s = std::make_unique<Stmt>();
    s->line = line;
    if (keyword == "if") {
      s->kind = StmtKind::If;
      ExprPtr condition = parse_tuple(false);
      expect_block_end();
      while (true) {
        StmtList branch = parse_statements({"elif", "else", "endif"});
        s->branches.emplace_back(std::move(condition), std::move(branch));
        std::string which = next().text;
        if (which == "elif") {
          condition = parse_tuple(false);
          expect_block_end();
          continue;
        }
        expect_block_end();
        if (which == "else") {
          s->else_body = parse_statements({"endif"});
          finish_block("endif");
        }
        break;
      }
    } else if (keyword == "for") {
      s->kind = StmtKind::For;
      s->target = parse_assign_target(true);
      if (!skip_name("in")) template_fail(current().line, "expected 'in' in for loop, got {}", describe(current()));
      s->expr = parse_tuple(false, /*stop_at_if=*/true);
      if (skip_name("if")) s->loop_filter = parse_tuple(false);
      if (skip_name("recursive")) s->recursive = true;
      expect_block_end();
      s->body = parse_statements({"endfor", "else"});
      if (next().text == "else") {
        expect_block_end();
        s->else_body = parse_statements({"endfor"});
        finish_block("endfor");
      } else {
        expect_block_end();
      }
      if (s->recursive)
        template_fail(line, "recursive for loops are not supported by spindle's renderer; unroll the recursion "
             "with a macro");
    } else if (keyword == "set") {
      s->target = parse_assign_target(false);
      if (skip_op("=")) {
        s->kind = StmtKind::Set;
        s->expr = parse_tuple(true);
        expect_block_end();
      } else {
        s->kind = StmtKind::SetBlock;
        while (skip_op("|")) s->filters.push_back(parse_filter(nullptr));
        expect_block_end();
        s->body = parse_statements({"endset"});
        finish_block("endset");
      }
    } else if (keyword == "macro") {
      s->kind = StmtKind::Macro;
      s->macro_name = expect_name();
      parse_signature(s->parameters);
      expect_block_end();
      s->body = parse_statements({"endmacro"});
      finish_block("endmacro");
    } else if (keyword == "call") {
      s->kind = StmtKind::CallBlock;
      if (is_op("(")) parse_signature(s->parameters);
      s->expr = parse_expression(true);
      if (s->expr->kind != ExprKind::Call) template_fail(line, "expected a call after {{% call %}}");
      expect_block_end();
      s->body = parse_statements({"endcall"});
      finish_block("endcall");
    } else if (keyword == "filter") {
      s->kind = StmtKind::FilterBlock;
      do s->filters.push_back(parse_filter(nullptr));
      while (skip_op("|"));
      expect_block_end();
      s->body = parse_statements({"endfilter"});
      finish_block("endfilter");
    } else if (keyword == "generation") {
      s->kind = StmtKind::Generation;
      expect_block_end();
      s->body = parse_statements({"endgeneration"});
      finish_block("endgeneration");
    } else if (keyword == "break" || keyword == "continue") {
      s->kind = keyword == "break" ? StmtKind::Break : StmtKind::Continue;
      expect_block_end();
    } else if (keyword == "with") {
      s->kind = StmtKind::With;
      while (current().type != TokenType::BlockEnd) {
        if (!s->with_assignments.empty()) expect_op(",");
        Target target = parse_assign_target(false);
        expect_op("=");
        s->with_assignments.emplace_back(std::move(target), parse_expression(true));
      }
      expect_block_end();
      s->body = parse_statements({"endwith"});
      finish_block("endwith");
    } else {
      static const std::set<std::string> known_unsupported = {"include", "extends", "block", "import", "from", "do", "autoescape", "trans"};
      if (known_unsupported.count(keyword))
        template_fail(line, "the '{}' tag is not supported by spindle's chat template renderer (chat templates "
             "are single self-contained templates); inline what it refers to",
                    keyword);
      template_fail(line, "unknown tag '{}'; jinja2 (as transformers configures it) would reject it too", keyword);
    }
    return s;
  }

  void parse_signature(std::vector<MacroParameter>& parameters) {
    expect_op("(");
    while (!skip_op(")")) {
      if (!parameters.empty()) expect_op(",");
      if (skip_op(")")) break;
      MacroParameter p;
      p.name = expect_name();
      if (skip_op("=")) p.default_value = parse_expression(true);
      parameters.push_back(std::move(p));
    }
  }

  Target parse_assign_target(bool allow_tuple) {
    Target target;
    std::string first = expect_name();
    if (!allow_tuple && skip_op(".")) {
      target.names.push_back(first);
      target.namespace_attribute = expect_name();
      return target;
    }
    target.names.push_back(first);
    if (allow_tuple || is_op(",")) {
      while (skip_op(",")) {
        target.is_tuple = true;
        if (current().type != TokenType::Name) break;
        target.names.push_back(expect_name());
      }
    }
    return target;
  }

  // parse_tuple: a comma-separated expression list becomes a tuple (as in `{{ a, b }}`).
  ExprPtr parse_tuple(bool with_condexpr, bool stop_at_if = false) {
    int line = current().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        is_tuple = true;
      }
      if (is_tuple_end(stop_at_if)) break;
      items.push_back(with_condexpr ? parse_expression(true) : parse_or());
    }
    if (!is_tuple) {
      if (items.empty()) template_fail(line, "expected an expression, got {}", describe(current()));
      return std::move(items[0]);
    }
    auto e = make_expr(ExprKind::TupleLiteral, line);
    e->args = std::move(items);
    return e;
  }

  bool is_tuple_end(bool stop_at_if) const {
    const Token& t = current();
    if (t.type == TokenType::VariableEnd || t.type == TokenType::BlockEnd || t.type == TokenType::End) return true;
    if (t.type == TokenType::Operator && (t.text == ")" || t.text == "]" || t.text == "}")) return true;
    if (stop_at_if && t.type == TokenType::Name && (t.text == "if" || t.text == "recursive")) return true;
    return false;
  }

  ExprPtr parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }

  ExprPtr parse_condexpr() {
    int line = current().line;
    ExprPtr expr = parse_or();
    while (skip_name("if")) {
      auto e = make_expr(ExprKind::Conditional, line);
      e->condition = parse_or();
      if (skip_name("else")) e->otherwise = parse_condexpr();
      e->base = std::move(expr);
      expr = std::move(e);
    }
    return expr;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      auto e = make_expr(ExprKind::Or, next().line);
      e->base = std::move(left);
      e->index = parse_and();
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      auto e = make_expr(ExprKind::And, next().line);
      e->base = std::move(left);
      e->index = parse_not();
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      auto e = make_expr(ExprKind::Not, next().line);
      e->base = parse_not();
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    int line = current().line;
    ExprPtr expr = parse_math1();
    std::vector<std::pair<std::string, ExprPtr>> ops;
    while (true) {
      const Token& t = current();
      if (t.type == TokenType::Operator && (t.text == "==" || t.text == "!=" || t.text == "<" || t.text == ">" ||
                                            t.text == "<=" || t.text == ">=")) {
        std::string op = next().text;
        ops.emplace_back(op, parse_math1());
      } else if (is_name("in")) {
        ++pos_;
        ops.emplace_back("in", parse_math1());
      } else if (is_name("not") && peek().type == TokenType::Name && peek().text == "in") {
        pos_ += 2;
        ops.emplace_back("notin", parse_math1());
      } else {
        break;
      }
    }
    if (ops.empty()) return expr;
    auto e = make_expr(ExprKind::Compare, line);
    e->base = std::move(expr);
    e->comparisons = std::move(ops);
    return e;
  }

  ExprPtr binary(const std::string& op, ExprPtr left, ExprPtr right, int line) {
    auto e = make_expr(ExprKind::Binary, line);
    e->name = op;
    e->base = std::move(left);
    e->index = std::move(right);
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      Token op = next();
      left = binary(op.text, std::move(left), parse_concat(), op.line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (is_op("~")) {
      Token op = next();
      left = binary("~", std::move(left), parse_math2(), op.line);
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      Token op = next();
      left = binary(op.text, std::move(left), parse_pow(), op.line);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      Token op = next();
      left = binary("**", std::move(left), parse_unary(true), op.line);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    int line = current().line;
    ExprPtr node;
    if (skip_op("-")) {
      node = make_expr(ExprKind::Negate, line);
      node->base = parse_unary(false);
    } else if (skip_op("+")) {
      node = make_expr(ExprKind::Plus, line);
      node->base = parse_unary(false);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = current();
    int line = t.line;
    if (t.type == TokenType::Name) {
      std::string name = next().text;
      auto e = make_expr(ExprKind::Constant, line);
      if (name == "true" || name == "True") e->constant = Value::from_bool(true);
      else if (name == "false" || name == "False") e->constant = Value::from_bool(false);
      else if (name == "none" || name == "None") e->constant = Value::none();
      else {
        e->kind = ExprKind::Name;
        e->name = name;
      }
      return e;
    }
    if (t.type == TokenType::String) {
      std::string text;
      while (current().type == TokenType::String) text += next().text;
      auto e = make_expr(ExprKind::Constant, line);
      e->constant = Value::from_string(std::move(text));
      return e;
    }
    if (t.type == TokenType::Integer || t.type == TokenType::Float) {
      Token number = next();
      auto e = make_expr(ExprKind::Constant, line);
      if (number.type == TokenType::Integer) {
        try {
          e->constant = Value::from_int(std::stoll(number.text));
        } catch (const std::out_of_range&) {
          template_fail(line, "integer literal {} does not fit in 64 bits", number.text);
        }
      } else {
        e->constant = Value::from_float(std::stod(number.text));
      }
      return e;
    }
    if (skip_op("(")) {
      ExprPtr inner = parse_tuple(true);
      expect_op(")");
      return inner;
    }
    if (skip_op("[")) {
      auto e = make_expr(ExprKind::ListLiteral, line);
      while (!is_op("]")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("]")) break;
        e->args.push_back(parse_expression(true));
      }
      expect_op("]");
      return e;
    }
    if (skip_op("{")) {
      auto e = make_expr(ExprKind::DictLiteral, line);
      while (!is_op("}")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("}")) break;
        e->args.push_back(parse_expression(true));
        expect_op(":");
        e->values.push_back(parse_expression(true));
      }
      expect_op("}");
      return e;
    }
    template_fail(line, "unexpected {} where an expression was expected", describe(t));
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".")) {
        int line = next().line;
        auto e = make_expr(ExprKind::Attribute, line);
        if (current().type == TokenType::Integer) {
          e->kind = ExprKind::Item;
          auto index = make_expr(ExprKind::Constant, line);
          index->constant = Value::from_int(std::stoll(next().text));
          e->index = std::move(index);
        } else {
          e->name = expect_name();
        }
        e->base = std::move(node);
        node = std::move(e);
      } else if (is_op("[")) {
        int line = next().line;
        auto e = make_expr(ExprKind::Item, line);
        e->base = std::move(node);
        e->index = parse_subscript_index();
        expect_op("]");
        node = std::move(e);
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript_index() {
    int line = current().line;
    ExprPtr start;
    if (!is_op(":")) {
      start = parse_expression(true);
      if (!is_op(":")) {
        if (is_op(",")) template_fail(line, "tuple subscripts are not supported");
        return start;
      }
    }
    auto slice = make_expr(ExprKind::Slice, line);
    slice->slice_start = std::move(start);
    expect_op(":");
    if (!is_op("]") && !is_op(":")) slice->slice_stop = parse_expression(true);
    if (skip_op(":"))
      if (!is_op("]")) slice->slice_step = parse_expression(true);
    return slice;
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (skip_op("*")) {
        e.star_args = parse_expression(true);
        continue;
      }
      if (skip_op("**")) {
        e.star_kwargs = parse_expression(true);
        continue;
      }
      if (current().type == TokenType::Name && peek().type == TokenType::Operator && peek().text == "=") {
        std::string name = next().text;
        ++pos_;
        e.keywords.push_back({name, parse_expression(true)});
      } else {
        if (!e.keywords.empty())
          template_fail(current().line, "positional argument after keyword argument");
        e.args.push_back(parse_expression(true));
      }
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto e = make_expr(ExprKind::Call, current().line);
    e->base = std::move(callee);
    parse_call_args(*e);
    return e;
  }

  ExprPtr parse_filter(ExprPtr base) {
    int line = current().line;
    auto e = make_expr(ExprKind::Filter, line);
    e->name = expect_name();
    while (skip_op(".")) e->name += "." + expect_name();
    if (is_op("(")) parse_call_args(*e);
    e->has_base = base != nullptr;
    e->base = std::move(base);
    return e;
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (skip_op("|")) {
        node = parse_filter(std::move(node));
      } else if (is_name("is")) {
        int line = next().line;
        auto e = make_expr(ExprKind::Test, line);
        e->negated = skip_name("not");
        e->name = expect_name();
        while (skip_op(".")) e->name += "." + expect_name();
        const Token& t = current();
        if (is_op("(")) {
          parse_call_args(*e);
        } else if ((t.type == TokenType::Name || t.type == TokenType::String || t.type == TokenType::Integer ||
                    t.type == TokenType::Float || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) template_fail(t.line, "you cannot chain multiple tests with is");
          e->args.push_back(parse_postfix(parse_primary()));
        }
        e->base = std::move(node);
        node = std::move(e);
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
};

}  // namespace

StmtList parse_template(const std::string& source) { return Parser(tokenize(source)).parse_all(); }

}  // namespace spindle::chat
