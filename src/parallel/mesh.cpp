#include "parallel/mesh.h"

#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"

namespace spindle::parallel {

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> result;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) result.push_back(d);
  return result;
}

std::string list(const std::vector<int>& values) { return fmt::format("{}", fmt::join(values, ", ")); }

// "--ulysses 1 --ring 4, --ulysses 2 --ring 2"
std::string valid_pairs(int sp, int q, int kv) {
  std::vector<std::string> pairs;
  for (int u : valid_ulysses_degrees(sp, q, kv)) pairs.push_back(fmt::format("--ulysses {} --ring {}", u, sp / u));
  return fmt::format("{}", fmt::join(pairs, ", "));
}

void check_positive(std::optional<int> value, const char* flag) {
  if (value && *value < 1)
    fail("{} {} is not a valid degree: degrees are positive integers (1 means no split along that dimension)",
         flag, *value);
}

void check_model(int world_size, int q, int kv) {
  if (world_size < 1) fail("the job has {} processes; it needs at least one", world_size);
  if (q < 1 || kv < 1 || q % kv != 0)
    fail("the model has {} query heads and {} KV heads; query heads must be a positive multiple of the KV heads "
         "(check num_attention_heads and num_key_value_heads in config.json)",
         q, kv);
}

// `given` says where sp came from: "--sp 3", or "--ulysses 3 (so sp = 3)" when it was inferred.
void check_sp_divides_world(int sp, int world_size, const std::string& given) {
  if (world_size % sp != 0)
    fail("{} does not divide the {} processes of this job (world = dp × sp); valid --sp: {} (or start a multiple "
         "of {} processes)",
         given, world_size, list(divisors(world_size)), sp);
}

void check_ulysses_heads(int ulysses, int sp, int q, int kv) {
  if (q % ulysses != 0)
    fail("--ulysses {} does not divide the {} query heads of this model (Ulysses splits heads across ranks); "
         "valid --ulysses for --sp {}: {}; put the rest of the sequence split on --ring",
         ulysses, q, sp, list(valid_ulysses_degrees(sp, q, kv)));
  if (kv % ulysses != 0 && ulysses % kv != 0)
    fail("--ulysses {} cannot share the {} KV heads of this model: they must split evenly (KV heads a multiple "
         "of the degree) or be replicated (degree a multiple of the KV heads); valid --ulysses for --sp {}: {}",
         ulysses, kv, sp, list(valid_ulysses_degrees(sp, q, kv)));
}

}  // namespace

std::vector<int> valid_ulysses_degrees(int sp, int q, int kv) {
  std::vector<int> result;
  for (int d : divisors(sp))
    if (q % d == 0 && (kv % d == 0 || d % kv == 0)) result.push_back(d);
  return result;
}

void validate(const MeshConfig& c, int world_size, int q, int kv) {
  check_positive(c.dp, "--dp");
  check_positive(c.sp, "--sp");
  check_positive(c.ulysses, "--ulysses");
  check_positive(c.ring, "--ring");
  check_model(world_size, q, kv);
  check_sp_divides_world(c.sp, world_size, fmt::format("--sp {}", c.sp));
  if (c.dp * c.sp != world_size)
    fail("--dp {} × --sp {} = {}, but this job has {} processes; with --sp {} use --dp {} (or leave --dp out)", c.dp,
         c.sp, c.dp * c.sp, world_size, c.sp, world_size / c.sp);
  if (c.ulysses * c.ring != c.sp)
    fail("--ulysses {} × --ring {} = {}, but --sp is {} (sp = ulysses × ring); valid for --sp {}: {}", c.ulysses,
         c.ring, c.ulysses * c.ring, c.sp, c.sp, valid_pairs(c.sp, q, kv));
  check_ulysses_heads(c.ulysses, c.sp, q, kv);
}

MeshConfig resolve_mesh(const MeshFlags& flags, int world_size, int q, int kv) {
  check_positive(flags.dp, "--dp");
  check_positive(flags.sp, "--sp");
  check_positive(flags.ulysses, "--ulysses");
  check_positive(flags.ring, "--ring");
  check_model(world_size, q, kv);

  MeshConfig c;
  if (flags.sp) {
    c.sp = *flags.sp;
  } else if (flags.ulysses || flags.ring) {
    c.sp = flags.ulysses.value_or(1) * flags.ring.value_or(1);
    std::string given = flags.ulysses && flags.ring
                            ? fmt::format("--ulysses {} × --ring {}", *flags.ulysses, *flags.ring)
                            : flags.ulysses ? fmt::format("--ulysses {}", *flags.ulysses)
                                            : fmt::format("--ring {}", *flags.ring);
    check_sp_divides_world(c.sp, world_size, fmt::format("{} (so sp = {})", given, c.sp));
  } else if (flags.dp) {
    if (world_size % *flags.dp != 0)
      fail("--dp {} does not divide the {} processes of this job (world = dp × sp); valid --dp: {}", *flags.dp,
           world_size, list(divisors(world_size)));
    c.sp = world_size / *flags.dp;
  }
  check_sp_divides_world(c.sp, world_size, fmt::format("--sp {}", c.sp));

  if (flags.ulysses) {
    c.ulysses = *flags.ulysses;
  } else if (flags.ring) {
    if (c.sp % *flags.ring != 0)
      fail("--ring {} does not divide --sp {} (sp = ulysses × ring); valid for --sp {}: {}", *flags.ring, c.sp, c.sp,
           valid_pairs(c.sp, q, kv));
    c.ulysses = c.sp / *flags.ring;
  } else {
    c.ulysses = valid_ulysses_degrees(c.sp, q, kv).back();  // 1 is always valid
  }
  if (flags.ring) {
    c.ring = *flags.ring;
  } else {
    if (c.sp % c.ulysses != 0)
      fail("--ulysses {} does not divide --sp {} (sp = ulysses × ring); valid --ulysses for --sp {}: {}", c.ulysses,
           c.sp, c.sp, list(valid_ulysses_degrees(c.sp, q, kv)));
    c.ring = c.sp / c.ulysses;
  }
  c.dp = flags.dp.value_or(world_size / c.sp);
  validate(c, world_size, q, kv);
  return c;
}

MeshCoordinates coordinates_of(const MeshConfig& c, int rank) {
  SPINDLE_CHECK(rank >= 0 && rank < c.world_size(), "rank {} outside a mesh of {}", rank, c.world_size());
  MeshCoordinates coordinates;
  coordinates.dp = rank / c.sp;
  int sp_rank = rank % c.sp;
  coordinates.ring = sp_rank / c.ulysses;
  coordinates.ulysses = sp_rank % c.ulysses;
  return coordinates;
}

int rank_of(const MeshConfig& c, const MeshCoordinates& m) { return m.dp * c.sp + m.ring * c.ulysses + m.ulysses; }

SequenceLayout sequence_layout(const MeshConfig& c) {
  if (c.sp == 1) return SequenceLayout::None;
  if (c.ring == 1) return SequenceLayout::Contiguous;
  if (c.ulysses == 1) return SequenceLayout::Zigzag;
  return SequenceLayout::Hybrid;
}

int64_t sequence_multiple(const MeshConfig& c) {
  switch (sequence_layout(c)) {
    case SequenceLayout::None: return 1;
    case SequenceLayout::Contiguous: return c.ulysses;
    case SequenceLayout::Zigzag: return 2 * int64_t{c.ring};
    case SequenceLayout::Hybrid: return 2 * int64_t{c.ring} * c.ulysses;
  }
  return 1;
}

int64_t padded_length(int64_t length, const MeshConfig& c) {
  int64_t multiple = sequence_multiple(c);
  return (length + multiple - 1) / multiple * multiple;
}

Mesh::Mesh(const MeshConfig& config, comm::Communicator& world) : config_(config), world_(world) {
  if (config.world_size() != world.size())
    fail("the mesh --dp {} × --sp {} needs {} processes but the job has {}", config.dp, config.sp,
         config.world_size(), world.size());
  coordinates_ = coordinates_of(config, world.rank());
  // Every rank makes the same four splits in the same order (each is collective over world).
  const std::array<GroupSplit, 4> splits = mesh_splits(config, world.rank());
  std::unique_ptr<comm::Communicator>* groups[] = {&dp_, &sp_, &ulysses_, &ring_};
  for (size_t i = 0; i < splits.size(); ++i) *groups[i] = world.split(splits[i].color, splits[i].key, splits[i].name);
}

std::array<GroupSplit, 4> mesh_splits(const MeshConfig& config, int world_rank) {
  const MeshCoordinates m = coordinates_of(config, world_rank);
  const int sp_rank = sp_rank_of(config, m);
  return {{{"dp", sp_rank, m.dp},
           {"sp", m.dp, sp_rank},
           {"ulysses", m.dp * config.ring + m.ring, m.ulysses},
           {"ring", m.dp * config.ulysses + m.ulysses, m.ring}}};
}

}  // namespace spindle::parallel
