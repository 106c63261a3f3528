// Which bytes of a rendered conversation are supervised: each assistant turn's output, from the
// end of the prompt the model sees at inference (the generation prompt) to the end of the turn
// (end-of-turn marker and whatever the template emits with it, e.g. "<|im_end|>\n").
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

#include "data/chat/chat_template.h"

namespace spindle::chat {

enum class SpanMethod {
  GenerationBlocks,  // the template's {% generation %} blocks, as transformers' assistant mask
  ConversationDiff,  // derived by diffing renders (templates without generation blocks)
};

struct AssistantSpans {
  std::string text;              // the full rendering, identical to ChatTemplate::render
  std::vector<ByteSpan> spans;   // supervised byte ranges, ascending, non-overlapping
  // For ConversationDiff, the index in messages of each span's assistant message.
  std::vector<size_t> message_indices;
  SpanMethod method = SpanMethod::ConversationDiff;
};

// `context` is what render() takes (see transformers_context()). Throws spindle::Error naming
// the message when the spans cannot be derived exactly (a template that renders a turn
// differently once later turns exist in a way the diff cannot place, or that refuses to render
// a partial conversation); the fix is a template with {% generation %} blocks.
AssistantSpans render_with_assistant_spans(const ChatTemplate& chat_template, const nlohmann::ordered_json& context,
                                           const RenderOptions& options = {});

}  // namespace spindle::chat
