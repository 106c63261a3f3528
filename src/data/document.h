// The data contract between dataset readers, packing and the loss (docs/design.md §2.1, §2.4, §2.5).
#pragma once

#include <cstdint>
#include <vector>

namespace spindle {

constexpr int32_t kIgnoreIndex = -100;

// One tokenized training sample, in Hugging Face alignment: labels[i] is the token that position
// i−1 must predict (labels usually equal input_ids where supervised), kIgnoreIndex where not.
// loss_scale[i] weights the loss of predicting labels[i]; empty means 1 everywhere.
struct Document {
  std::vector<int32_t> input_ids;
  std::vector<int32_t> labels;
  std::vector<float> loss_scale;
};

// One row of packed documents, with targets already shifted on the full row ("shift before
// shard"): position i predicts targets[i], a token of its own document, or kIgnoreIndex. The last
// token of every document and all padding get kIgnoreIndex and weight 0.
struct PackedRow {
  std::vector<int32_t> input_ids;  // [L]
  std::vector<int32_t> positions;  // [L] position inside its own document (restarts at 0)
  std::vector<int32_t> doc_ids;    // [L] document index inside the row; −1 for padding
  std::vector<int32_t> targets;    // [L] token predicted at position i, or kIgnoreIndex
  std::vector<float> weights;      // [L] loss weight of targets[i] (loss_scale); 0 where ignored

  int64_t length() const { return static_cast<int64_t>(input_ids.size()); }
  // Supervised targets: the count every denominator is built from (loss_scale does not change it).
  int64_t num_items() const {
    int64_t n = 0;
    for (int32_t t : targets) n += t != kIgnoreIndex;
    return n;
  }
};

}  // namespace spindle
