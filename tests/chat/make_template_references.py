#!/usr/bin/env python3
"""Writes testdata/chat_templates/references.json: how transformers 5.17 renders the chat templates
of the new model families (testdata/chat_templates/*.jinja) for a set of conversations, so that
tests/chat/family_templates_test.cpp checks spindle's renderer byte for byte without Python.

The renderer is transformers' own (transformers.utils.chat_template_utils.render_jinja_template,
the code apply_chat_template runs), given the variables apply_chat_template passes: the special
tokens of the family's tokenizer, messages, tools, documents, add_generation_prompt and any extra
keyword arguments. strftime_now() sees the fixed date of tests/chat/chat_test_support.h.

usage: make_template_references.py [--templates-from /path/to/chat_templates/templates]
  --templates-from  copy the templates from the corpus folder first (they are committed)
needs: transformers==5.17.0, jinja2 (pip)
"""
import argparse
import datetime as datetime_module
import json
import os
import shutil

from transformers.utils import chat_template_utils

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(ROOT, "testdata", "chat_templates")
FIXED_NOW = datetime_module.datetime(2025, 7, 10, 12, 0)  # kFixedDate in chat_test_support.h

# Committed name -> corpus file it was copied from.
TEMPLATES = {
    "gemma2.jinja": "google-gemma-2-2b-it.jinja",
    "gemma3.jinja": "trl-gemma3.jinja",
    "gpt_oss.jinja": "openai-gpt-oss-120b.jinja",
    "glm4_5.jinja": "trl-glm4moe.jinja",
    "mistral_v0_1.jinja": "hfjs-TheBloke_Mistral-7B-Instruct-v0.1-GPTQ.jinja",
    "mistral_v0_3.jinja": "hfjs-mistralai_Mistral-7B-Instruct-v0.3_JSON_Schema_.jinja",
    "mistral_nemo.jinja": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "mistral_small_3_2.jinja": "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "phi3_5.jinja": "microsoft-Phi-3.5-mini-instruct.jinja",
}

# The special tokens each family's tokenizer_config.json names (apply_chat_template passes them).
SPECIAL_TOKENS = {
    "gemma2.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
    "gemma3.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
    "gpt_oss.jinja": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
    "glm4_5.jinja": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "mistral_v0_1.jinja": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "mistral_v0_3.jinja": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "mistral_nemo.jinja": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "mistral_small_3_2.jinja": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "phi3_5.jinja": {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>", "pad_token": "<|endoftext|>"},
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "description": "Forecast days"}},
        "required": ["city"]}}}

TOOL_CALL = {"id": "call12345", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}

CONVERSATIONS = {
    "single": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
    "prompt": {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "add_generation_prompt": True},
    "multi": {"messages": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "  2 + 2 = 4.\n"},
        {"role": "user", "content": "Und auf Deutsch? Straße — “quotes” 😀 'single' \"double\""},
        {"role": "assistant", "content": "Zwei plus zwei ist vier."}]},
    "system": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."}]},
    "system_prompt": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"}], "add_generation_prompt": True},
    "tools": {"tools": [WEATHER_TOOL], "messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
         "content": "{\"temperature\": 22.5, \"unit\": \"celsius\"}"},
        {"role": "assistant", "content": "It is 22.5 °C in Paris."}]},
    "tools_prompt": {"tools": [WEATHER_TOOL], "add_generation_prompt": True,
                     "messages": [{"role": "user", "content": "Weather in Paris?"}]},
    "thinking": {"messages": [
        {"role": "user", "content": "Is 17 prime?"},
        {"role": "assistant", "content": "Yes, 17 is prime.", "thinking": "Check divisors up to 4.",
         "reasoning_content": "Check divisors up to 4."},
        {"role": "user", "content": "And 21?"},
        {"role": "assistant", "content": "No, 21 = 3 × 7.", "thinking": "21 = 3 * 7.",
         "reasoning_content": "21 = 3 * 7."}]},
    "think_tags": {"messages": [
        {"role": "user", "content": "Is 9 prime?"},
        {"role": "assistant", "content": "<think>\n9 = 3 * 3.\n</think>\n\nNo."}]},
    "nothink_prompt": {"enable_thinking": False, "add_generation_prompt": True,
                       "messages": [{"role": "user", "content": "Hi"}]},
    "developer_high": {"reasoning_effort": "high", "messages": [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Bonjour."}]},
    "content_parts": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "text", "text": " this."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]},
    "roles_not_alternating": {"messages": [
        {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
}


class FixedDatetime(datetime_module.datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_NOW


def render(template, context):
    kwargs = dict(context)
    messages = kwargs.pop("messages")
    tools = kwargs.pop("tools")
    documents = kwargs.pop("documents")
    add_generation_prompt = kwargs.pop("add_generation_prompt")
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[messages], tools=tools, documents=documents, chat_template=template,
        add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--templates-from")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    if args.templates_from:
        for name, source in TEMPLATES.items():
            shutil.copyfile(os.path.join(args.templates_from, source), os.path.join(OUT, name))
    chat_template_utils.datetime = FixedDatetime  # what strftime_now() reads
    cases = []
    for name in TEMPLATES:
        with open(os.path.join(OUT, name), encoding="utf-8") as f:
            template = f.read()
        for conversation, sample in CONVERSATIONS.items():
            # apply_chat_template: special tokens, then the sample's keys; tools and documents are
            # always passed, add_generation_prompt defaults to false.
            context = dict(SPECIAL_TOKENS[name])
            context.update({"tools": None, "documents": None, "add_generation_prompt": False})
            context.update(json.loads(json.dumps(sample)))
            case = {"template": name, "conversation": conversation, "context": context}
            try:
                case["text"] = render(template, json.loads(json.dumps(context)))
            except Exception as error:  # spindle must raise where transformers raises
                case["error"] = f"{type(error).__name__}: {error}"
            cases.append(case)
    with open(os.path.join(OUT, "references.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
        f.write("\n")
    rendered = sum("text" in c for c in cases)
    print(f"{len(cases)} cases: {rendered} rendered, {len(cases) - rendered} raise")


if __name__ == "__main__":
    main()
