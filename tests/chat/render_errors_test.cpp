// Error messages name the template line and say what was wrong; jinja2 semantics that decide
// bytes but are easy to get wrong are pinned here with their Python results.
#include <gtest/gtest.h>

#include "data/chat/chat_template.h"

namespace spindle::chat {
namespace {

using nlohmann::ordered_json;

std::string render(const std::string& source, ordered_json context = ordered_json::object()) {
  return ChatTemplate::parse(source).render(context);
}

TemplateError render_error(const std::string& source, ordered_json context = ordered_json::object()) {
  try {
    render(source, context);
  } catch (const TemplateError& e) {
    return e;
  }
  ADD_FAILURE() << "expected a TemplateError from: " << source;
  return TemplateError(0, "");
}

TEST(ChatTemplateErrors, RaiseExceptionCarriesMessageAndLine) {
  auto e = render_error("line one\n{% if messages|length > 1 %}\n{{ raise_exception('Only one message allowed') }}\n{% endif %}",
                        {{"messages", {1, 2}}});
  EXPECT_EQ(e.line(), 3);
  EXPECT_EQ(std::string(e.what()), "chat template line 3: raise_exception: Only one message allowed");
}

TEST(ChatTemplateErrors, UnsupportedSyntaxNamesLineAndConstruct) {
  try {
    ChatTemplate::parse("a\nb\n{% include 'other.jinja' %}");
    FAIL();
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.line(), 3);
    EXPECT_NE(e.reason().find("'include' tag is not supported"), std::string::npos) << e.what();
  }
  try {
    ChatTemplate::parse("{{ x }}\n{{ x | frobnicate }}");
    FAIL();
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.line(), 2);
    EXPECT_NE(e.reason().find("no filter named 'frobnicate'"), std::string::npos) << e.what();
  }
  try {
    ChatTemplate::parse("{% for m in messages %}\n{{ m }}\n");
    FAIL();
  } catch (const TemplateError& e) {
    EXPECT_NE(e.reason().find("'endfor'"), std::string::npos) << e.what();
  }
}

TEST(ChatTemplateErrors, UndefinedOperationsFailLikePython) {
  auto e = render_error("ok\n{{ 'a' + none }}");
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.reason(), "can only concatenate str (not \"NoneType\") to str");
  EXPECT_EQ(render_error("{{ missing.attr }}").reason(), "'missing' is undefined");
  EXPECT_EQ(render_error("{% set l = [1] %}{{ l.append(2) }}").reason().rfind("access to attribute 'append' of 'list' object is unsafe", 0), 0u);
  EXPECT_EQ(render_error("{{ [1]|map('upper')|tojson }}").reason().rfind("Object of type generator", 0), 0u);
  // Python renders these without error.
  EXPECT_EQ(render("{{ none.attr }}|{{ {}['k'] }}|{{ 'a' ~ none ~ 1 ~ missing }}"), "||aNone1");
}

TEST(ChatTemplateSemantics, WhitespaceControlMatchesJinja) {
  EXPECT_EQ(render("{% if true %}\nX\n{% endif %}\nY"), "X\nY");
  EXPECT_EQ(render("  {% if true %}X{% endif %}\n  {{ 'v' }}"), "X  v");
  EXPECT_EQ(render("{% if true +%}\nX{% endif %}"), "\nX");
  EXPECT_EQ(render("a\u3000 {{- 'b' -}} \u3000\u00a0c"), "abc");
  EXPECT_EQ(render("a\n"), "a");
  EXPECT_EQ(render("a\n\n"), "a\n");
  EXPECT_EQ(render("a\r\nb"), "a\nb");
}

TEST(ChatTemplateSemantics, PythonPrintingAndJson) {
  EXPECT_EQ(render("{{ d }}", {{"d", ordered_json::parse(R"({"b": 1, "a": "x", "c": [1.0, null, true]})")}}),
            "{'b': 1, 'a': 'x', 'c': [1.0, None, True]}");
  EXPECT_EQ(render("{{ d|tojson }}", {{"d", ordered_json::parse(R"({"b": 1, "a": "é<>&'\"", "f": 1.0})")}}),
            R"({"b": 1, "a": "é<>&'\"", "f": 1.0})");
  EXPECT_EQ(render("{{ d|tojson(indent=2) }}", {{"d", ordered_json::parse(R"({"a": [1, {}]})")}}),
            "{\n  \"a\": [\n    1,\n    {}\n  ]\n}");
  EXPECT_EQ(render("{{ 3/2 }} {{ 4/2 }} {{ 7//2 }} {{ -7//2 }} {{ 1e20 }} {{ 0.00001 }} {{ 0.1+0.2 }}"),
            "1.5 2.0 3 -4 1e+20 1e-05 0.30000000000000004");
  EXPECT_EQ(render("{{ \"it's\" }}|{{ [\"it's\", 'a\\nb', '\\u200b'] }}"), "it's|[\"it's\", 'a\\nb', '\\u200b']");
  EXPECT_EQ(render("{{ 'héllo😀'|length }} {{ 'abc'[::-1] }} {{ 'straße'|upper }} {{ \"o'neil\"|title }} {{ \"o'neil\".title() }}"),
            "6 cba STRASSE O'neil O'Neil");
}

TEST(ChatTemplateSemantics, ScopingOfSetInLoopsAndNamespaces) {
  EXPECT_EQ(render("{% for i in [1,2] %}{% if i == 1 %}{% set x='one' %}{% endif %}[{{ x }}]{% endfor %}"), "[one][]");
  EXPECT_EQ(render("{% set x='outer' %}{% for i in [1] %}{{ x }}|{% set x='inner' %}{{ x }}|{% endfor %}{{ x }}"),
            "outer|inner|outer");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for i in [1,2,3] if i != 2 %}{% set ns.n = ns.n + i %}"
                   "{{ loop.index }}/{{ loop.length }}{% endfor %}={{ ns.n }}"),
            "1/22/2=4");
  // dict.items resolves to the method, as Python attribute lookup does (Command-R+ relies on it).
  EXPECT_EQ(render("{{ d.items is defined }} {{ d.items.type is iterable }}", {{"d", {{"items", "x"}}}}), "True True");
}

}  // namespace
}  // namespace spindle::chat
