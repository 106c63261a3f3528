#include "comm/communicator.h"

#include <algorithm>

#include "core/error.h"

namespace spindle::comm {

std::unique_ptr<Communicator> Communicator::new_group(const std::vector<int>& ranks, const std::string& name) {
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  if (sorted.empty() || sorted.front() < 0 || sorted.back() >= size() ||
      std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    fail("new_group('{}') on group '{}' of {} ranks: the rank list must be non-empty, distinct and within 0..{}",
         name, this->name(), size(), size() - 1);
  auto position = std::find(ranks.begin(), ranks.end(), rank());
  bool member = position != ranks.end();
  return split(member ? 0 : -1, member ? static_cast<int>(position - ranks.begin()) : 0, name);
}

namespace {

void check_same_dtype(const Communicator& group, const char* call, const Tensor& in, const Tensor& out) {
  if (!in.defined() || !out.defined())
    fail("{} on group '{}': both tensors must be allocated", call, group.name());
  if (in.dtype() != out.dtype())
    fail("{} on group '{}': input {} and output {} must have the same dtype", call, group.name(), in.describe(),
         out.describe());
}

// out has `factor` times as many rows as in, and the same trailing dims.
void check_rows_scale(const Communicator& group, const char* call, const Tensor& small, const Tensor& large,
                      const char* expectation) {
  bool trailing_match = small.rank() == large.rank() && small.rank() >= 1;
  for (int d = 1; trailing_match && d < small.rank(); ++d) trailing_match = small.dim(d) == large.dim(d);
  if (!trailing_match || large.dim(0) != small.dim(0) * group.size())
    fail("{} on group '{}' of {} ranks: {}; got {} and {}", call, group.name(), group.size(), expectation,
         small.describe(), large.describe());
}

}  // namespace

void check_all_gather_shapes(const Communicator& group, const Tensor& in, const Tensor& out) {
  check_same_dtype(group, "all_gather", in, out);
  check_rows_scale(group, "all_gather", in, out, "out must be [size·n, ...] for in [n, ...]");
}

void check_reduce_scatter_shapes(const Communicator& group, const Tensor& in, const Tensor& out) {
  check_same_dtype(group, "reduce_scatter_sum", in, out);
  check_rows_scale(group, "reduce_scatter_sum", out, in, "in must be [size·n, ...] for out [n, ...]");
}

void check_all_to_all_shapes(const Communicator& group, const Tensor& in, const Tensor& out) {
  check_same_dtype(group, "all_to_all", in, out);
  if (!(in.shape() == out.shape()) || in.rank() < 1 || in.dim(0) % group.size() != 0)
    fail("all_to_all on group '{}' of {} ranks: in and out must have one shape whose first dimension is a "
         "multiple of {}; got {} and {}",
         group.name(), group.size(), group.size(), in.describe(), out.describe());
}

void check_peer(const Communicator& group, int peer, const char* call) {
  if (peer < 0 || peer >= group.size())
    fail("{} on group '{}': peer {} is not a rank of this group (0..{})", call, group.name(), peer,
         group.size() - 1);
}

}  // namespace spindle::comm
