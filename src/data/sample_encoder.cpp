#include "data/sample_encoder.h"

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

[[noreturn]] void conversations_unavailable(SampleFormat format) {
  fail("{} samples are rendered with the model's chat template, and rendering conversations is not "
       "available in dataset preparation yet; convert the data to prompt/completion, text or "
       "pre-tokenized form (input_ids + labels) meanwhile",
       sample_format_name(format));
}

}  // namespace

SampleEncoder::SampleEncoder(const TextEncoder* text_encoder, EncodeOptions options)
    : text_encoder_(text_encoder), options_(std::move(options)) {
  if (options_.read.vocab_size == 0 && text_encoder_) options_.read.vocab_size = text_encoder_->vocab_size();
}

SampleFormat SampleEncoder::format_of(const nlohmann::json& sample) const {
  if (!sample.is_object()) bad_sample("expected a JSON object, found a JSON {}", sample.type_name());
  return options_.format == SampleFormat::kAuto ? detect_sample_format(sample) : options_.format;
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

Document SampleEncoder::encode(const nlohmann::json& sample) const {
  const SampleFormat format = format_of(sample);
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
      parse_alpaca(sample);  // bad content is reported as such before the missing renderer
      conversations_unavailable(format);
    case SampleFormat::kMessages:
      parse_conversation(sample);
      conversations_unavailable(format);
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
  const SampleFormat format = format_of(sample);
  if (format != SampleFormat::kPreference)
    fail("expected preference pairs (chosen/rejected) but this sample is {} data; pass --format to "
         "override detection",
         sample_format_name(format));
  const PreferencePair pair = parse_preference(sample);
  if (pair.conversational) conversations_unavailable(format);
  require_text_encoder(format);
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
