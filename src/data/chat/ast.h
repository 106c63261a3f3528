// Syntax tree of a chat template. Every node keeps its template line for error messages.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data/chat/value.h"

namespace spindle::chat {

struct Expr;
struct Stmt;
using ExprPtr = std::unique_ptr<Expr>;
using StmtList = std::vector<std::unique_ptr<Stmt>>;

enum class ExprKind {
  Constant, Name, Attribute, Item, Slice, Call, Filter, Test, Negate, Plus, Not, Binary, And, Or, Compare,
  Conditional, ListLiteral, TupleLiteral, DictLiteral
};

struct Keyword {
  std::string name;
  ExprPtr value;
};

struct Expr {
  ExprKind kind;
  int line = 0;
  Value constant;                 // Constant
  std::string name;               // Name, Attribute, Filter/Test name, Binary operator
  ExprPtr base;                   // Attribute/Item/Call/Filter/Test/unary operand, Binary lhs
  ExprPtr index;                  // Item subscript, Binary rhs
  ExprPtr slice_start, slice_stop, slice_step;  // Slice (a node used as an Item index)
  std::vector<ExprPtr> args;      // Call/Filter/Test positional args, literal items, dict keys
  std::vector<ExprPtr> values;    // dict literal values
  std::vector<Keyword> keywords;  // Call/Filter/Test keyword args
  ExprPtr star_args, star_kwargs;  // f(*list, **dict)
  bool negated = false;           // `is not`
  bool has_base = true;           // a filter inside {% filter %} has no base expression
  // Compare: base is the first operand, then (operator, operand) pairs.
  std::vector<std::pair<std::string, ExprPtr>> comparisons;
  ExprPtr condition, otherwise;   // Conditional: base if condition else otherwise
};

enum class StmtKind { Text, Print, If, For, Set, SetBlock, Macro, CallBlock, FilterBlock, Generation, Break, Continue, With };

// Assignment target: a name, `ns.attr`, or a tuple of names for unpacking.
struct Target {
  std::vector<std::string> names;
  bool is_tuple = false;
  std::string namespace_attribute;  // set when the target is `names[0].attribute`
};

struct MacroParameter {
  std::string name;
  ExprPtr default_value;
};

struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;                                          // Text
  ExprPtr expr;                                              // Print, For iterable, Set value, CallBlock call
  std::vector<std::pair<ExprPtr, StmtList>> branches;        // If/elif
  StmtList body, else_body;                                  // For/If else, Macro/blocks body
  Target target;                                             // For/Set target
  ExprPtr loop_filter;                                       // `for x in y if cond`
  bool recursive = false;
  std::string macro_name;
  std::vector<MacroParameter> parameters;                    // Macro, CallBlock caller parameters
  std::vector<ExprPtr> filters;                              // SetBlock/FilterBlock filter chain
  std::vector<std::pair<Target, ExprPtr>> with_assignments;  // With
};

}  // namespace spindle::chat
