#include "data/sample_encoder.h"

#include "data/chat/chat_template.h"
#include "data/pretokenized.h"

namespace spindle {

namespace {

void append(Document& doc, const std::vector<int32_t>& ids, bool supervised) {
  doc.input_ids.insert(doc.input_ids.end(), ids.begin(), ids.end());
  if (supervised)
    doc.labels.insert(doc.labels.end(), ids.begin(), ids.end());
  else
    doc.labels.insert(doc.labels.end(), ids.size(), kIgnoreIndex);
}

bool has_tools(const nlohmann::ordered_json& variables) {
  auto it = variables.find("tools");
  return it != variables.end() && !it->is_null();
}

// The training document of a rendered conversation: assistant turns from `first_trained` on are
// supervised with their message's loss_scale (0 leaves them unsupervised); loss_scale stays empty
// when every supervised weight is 1.
Document conversation_document(const ChatEncoding& encoding, const std::vector<ChatMessage>& messages,
                               size_t first_trained) {
  for (size_t i = 0; i < messages.size(); ++i)
    if (messages[i].role != "assistant" && messages[i].loss_scale && *messages[i].loss_scale > 0)
      bad_sample("message {} ({}) has loss_scale {}, but only assistant turns are supervised (the spans the chat "
                 "template gives them); set it on assistant messages only",
                 i, messages[i].role, *messages[i].loss_scale);
  // Tokens of {% generation %} blocks that are not one per assistant message cannot be tied to a
  // message; they take the assistant messages' loss_scale when all agree.
  std::optional<float> shared_scale;
  bool scales_agree = true;
  for (size_t i = first_trained; i < messages.size(); ++i) {
    if (messages[i].role != "assistant") continue;
    const float scale = messages[i].effective_loss_scale();
    if (shared_scale && *shared_scale != scale) scales_agree = false;
    shared_scale = scale;
  }

  Document doc;
  const size_t n = encoding.ids.size();
  doc.input_ids = encoding.ids;
  doc.labels.assign(n, kIgnoreIndex);
  doc.loss_scale.assign(n, 0.0f);
  bool weighted = false;
  for (size_t k = 0; k < n; ++k) {
    const int32_t turn = encoding.turn_of_token[k];
    if (turn == kPromptToken) continue;
    float scale;
    if (turn == kUnattributedTurn) {
      if (first_trained > 0 || !scales_agree)
        bad_sample("the chat template's {{% generation %}} blocks do not correspond one to one to the assistant "
                   "messages, so {} cannot be told apart; give the assistant messages one loss_scale",
                   first_trained > 0 ? "the answer's tokens and the history's" : "the messages' loss_scale");
      scale = shared_scale.value_or(1.0f);
    } else {
      if (static_cast<size_t>(turn) < first_trained) continue;
      scale = messages[turn].effective_loss_scale();
    }
    if (scale == 0) continue;
    doc.labels[k] = doc.input_ids[k];
    doc.loss_scale[k] = scale;
    weighted |= scale != 1.0f;
  }
  if (!weighted) doc.loss_scale.clear();
  return doc;
}

}  // namespace

nlohmann::ordered_json SampleEncoder::parse_sample(std::string_view line) {
  nlohmann::ordered_json sample;
  try {
    sample = nlohmann::ordered_json::parse(line.begin(), line.end());
  } catch (const nlohmann::json::exception&) {
    parse_jsonl_line(line);  // throws BadSample with the parser's description of the problem
    throw;
  }
  if (!sample.is_object()) parse_jsonl_line(line);  // throws BadSample naming the JSON type found
  return sample;
}

SampleEncoder::SampleEncoder(const TextEncoder* text_encoder, EncodeOptions options)
    : text_encoder_(text_encoder), options_(std::move(options)) {
  if (options_.read.vocab_size == 0 && text_encoder_) options_.read.vocab_size = text_encoder_->vocab_size();
}

SampleFormat SampleEncoder::format_of(const nlohmann::json& sample) const {
  if (!sample.is_object()) bad_sample("expected a JSON object, found a JSON {}", sample.type_name());
  return options_.format == SampleFormat::kAuto ? detect_sample_format(sample) : options_.format;
}

SampleFormat SampleEncoder::format_of(const nlohmann::ordered_json& sample) const {
  if (!sample.is_object()) bad_sample("expected a JSON object, found a JSON {}", sample.type_name());
  return options_.format == SampleFormat::kAuto ? detect_sample_format(nlohmann::json(sample)) : options_.format;
}

const TextEncoder& SampleEncoder::require_text_encoder(SampleFormat format) const {
  if (!text_encoder_)
    fail("{} samples need a tokenizer; pass --tokenizer with the model folder (tokenizer.json)",
         sample_format_name(format));
  return *text_encoder_;
}

std::vector<int32_t> SampleEncoder::encode_text(std::string_view text, bool add_special_tokens) const {
  return text_encoder_->encode(text, add_special_tokens);
}

ConversationEncoding SampleEncoder::encode_messages(const nlohmann::ordered_json& variables,
                                                   const std::vector<ChatMessage>& messages, size_t first_trained_message,
                                                   bool add_generation_prompt) const {
  const TextEncoder& text_encoder = require_text_encoder(SampleFormat::kMessages);
  const chat::ModelChatTemplate& model = text_encoder.chat_template(has_tools(variables));
  nlohmann::ordered_json context = chat::transformers_context(variables, model.special_tokens);
  context["add_generation_prompt"] = add_generation_prompt;
  ConversationEncoding result;
  try {
    result.chat = encode_chat(
        model.chat_template, context,
        [&](std::string_view text, std::vector<int32_t>& ids, std::vector<chat::ByteSpan>& offsets) {
          text_encoder.encode_with_offsets(text, ids, offsets);
        },
        options_.chat_render);
  } catch (const chat::TemplateError& e) {
    bad_sample("{} (in {})", e.what(), model.origin);
  } catch (const BadSample&) {
    throw;
  } catch (const Error& e) {
    // Spans that cannot be derived for this conversation, text the tokenizer refuses: this sample's problem.
    throw BadSample(e.what());
  }
  if (result.chat.ids.empty()) bad_sample("the conversation renders to no tokens");
  result.document = conversation_document(result.chat, messages, first_trained_message);
  return result;
}

ConversationEncoding SampleEncoder::encode_conversation(const nlohmann::ordered_json& sample,
                                                        bool add_generation_prompt) const {
  const SampleFormat format = format_of(sample);
  if (format != SampleFormat::kMessages && format != SampleFormat::kAlpaca)
    fail("expected a conversation (messages, ShareGPT conversations or Alpaca) but this sample is {} data",
         sample_format_name(format));
  require_text_encoder(format);
  const nlohmann::json plain(sample);
  const Conversation conversation = format == SampleFormat::kAlpaca ? parse_alpaca(plain) : parse_conversation(plain);
  return encode_messages(chat_template_variables(sample, format, conversation), conversation.messages, 0,
                         add_generation_prompt);
}

Document SampleEncoder::encode(const nlohmann::json& sample) const {
  if (!sample.is_object()) bad_sample("expected a JSON object, found a JSON {}", sample.type_name());
  return encode(nlohmann::ordered_json(sample));
}

Document SampleEncoder::encode(const nlohmann::ordered_json& ordered_sample) const {
  const SampleFormat format = format_of(ordered_sample);
  const nlohmann::json sample(ordered_sample);
  Document doc;
  switch (format) {
    case SampleFormat::kPretokenized:
      return parse_pretokenized(sample, options_.read);
    case SampleFormat::kText: {
      const std::string text = parse_text(sample);
      require_text_encoder(format);
      append(doc, encode_text(text, true), true);
      break;
    }
    case SampleFormat::kPromptCompletion: {
      const PromptCompletion pc = parse_prompt_completion(sample);
      require_text_encoder(format);
      append(doc, encode_text(pc.prompt, true), false);
      append(doc, encode_text(pc.completion, false), true);
      break;
    }
    case SampleFormat::kAlpaca:
    case SampleFormat::kMessages:
      return encode_conversation(ordered_sample).document;
    case SampleFormat::kPreference:
      fail("this sample is a preference pair (chosen/rejected); prepare it for DPO, or pass "
           "--format to read it as another format");
    case SampleFormat::kAuto:
      break;
  }
  const auto eos = text_encoder_->eos_token_id();
  if (options_.append_eos && eos && (doc.input_ids.empty() || doc.input_ids.back() != *eos)) {
    doc.input_ids.push_back(*eos);
    doc.labels.push_back(*eos);
  }
  if (doc.input_ids.empty()) bad_sample("the text encodes to no tokens");
  return doc;
}

PreferenceDocuments SampleEncoder::encode_preference(const nlohmann::json& sample) const {
  if (!sample.is_object()) bad_sample("expected a JSON object, found a JSON {}", sample.type_name());
  return encode_preference(nlohmann::ordered_json(sample));
}

PreferenceDocuments SampleEncoder::encode_preference(const nlohmann::ordered_json& ordered_sample) const {
  const SampleFormat format = format_of(ordered_sample);
  if (format != SampleFormat::kPreference)
    fail("expected preference pairs (chosen/rejected) but this sample is {} data; pass --format to "
         "override detection",
         sample_format_name(format));
  const PreferencePair pair = parse_preference(nlohmann::json(ordered_sample));
  require_text_encoder(format);
  if (pair.conversational) {
    // Each side continues the shared history; only the side's own assistant turns are supervised.
    auto side = [&](const std::vector<ChatMessage>& answer) {
      Conversation conversation;
      conversation.messages = pair.prompt.messages;
      conversation.messages.insert(conversation.messages.end(), answer.begin(), answer.end());
      const nlohmann::ordered_json variables =
          chat_template_variables(ordered_sample, SampleFormat::kPreference, conversation);
      return encode_messages(variables, conversation.messages, pair.prompt.messages.size(), false).document;
    };
    return PreferenceDocuments{side(pair.chosen), side(pair.rejected)};
  }
  const std::vector<int32_t> prompt = encode_text(pair.prompt_text, true);
  const auto eos = text_encoder_->eos_token_id();
  auto side = [&](const std::string& answer) {
    Document doc;
    append(doc, prompt, false);
    append(doc, encode_text(answer, false), true);
    if (options_.append_eos && eos && doc.input_ids.back() != *eos) append(doc, {*eos}, true);
    return doc;
  };
  return PreferenceDocuments{side(pair.chosen_text), side(pair.rejected_text)};
}

}  // namespace spindle
