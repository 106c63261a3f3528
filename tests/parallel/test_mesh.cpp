#include <gtest/gtest.h>

#include "backend/backend.h"
#include "comm/cpu_communicator.h"
#include "comm/multiprocess.h"
#include "core/error.h"
#include "parallel/mesh.h"

namespace spindle::parallel {
namespace {

using spindle::testing::expect_all_succeeded;
using spindle::testing::require;
using spindle::testing::run_ranks;

std::string resolve_error(const MeshFlags& flags, int world, int q, int kv) {
  try {
    resolve_mesh(flags, world, q, kv);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

std::string validate_error(const MeshConfig& config, int world, int q, int kv) {
  try {
    validate(config, world, q, kv);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

MeshConfig mesh(int dp, int sp, int ulysses, int ring) { return MeshConfig{dp, sp, ulysses, ring}; }

TEST(MeshResolve, Defaults) {
  // No flags: no sequence split, every process a data-parallel replica.
  EXPECT_EQ(resolve_mesh({}, 4, 12, 2), mesh(4, 1, 1, 1));
  // --sp alone: Ulysses takes the largest degree the heads allow, ring the rest.
  EXPECT_EQ(resolve_mesh({.sp = 4}, 8, 12, 2), mesh(2, 4, 4, 1));   // 2 KV heads replicated ×2
  EXPECT_EQ(resolve_mesh({.sp = 8}, 8, 12, 4), mesh(1, 8, 4, 2));   // 8 ∤ 12
  EXPECT_EQ(resolve_mesh({.sp = 6}, 6, 12, 4), mesh(1, 6, 2, 3));   // 3 and 6 cannot share 4 KV heads
  EXPECT_EQ(resolve_mesh({.sp = 4}, 4, 7, 7), mesh(1, 4, 1, 4));    // 7 heads: ring only
  // --ring fixes ulysses, --ulysses fixes ring, and either alone sets sp.
  EXPECT_EQ(resolve_mesh({.sp = 8, .ring = 4}, 8, 16, 8), mesh(1, 8, 2, 4));
  EXPECT_EQ(resolve_mesh({.sp = 8, .ulysses = 2}, 8, 16, 8), mesh(1, 8, 2, 4));
  EXPECT_EQ(resolve_mesh({.ring = 2}, 4, 16, 8), mesh(2, 2, 1, 2));
  EXPECT_EQ(resolve_mesh({.ulysses = 2, .ring = 2}, 8, 16, 8), mesh(2, 4, 2, 2));
  // --dp alone: sp takes the rest of the world.
  EXPECT_EQ(resolve_mesh({.dp = 2}, 8, 16, 8), mesh(2, 4, 4, 1));
  EXPECT_EQ(resolve_mesh({.dp = 1, .sp = 2, .ulysses = 1, .ring = 2}, 2, 16, 8), mesh(1, 2, 1, 2));
}

TEST(MeshResolve, ValidUlyssesDegreesAndReplication) {
  EXPECT_EQ(valid_ulysses_degrees(8, 32, 8), (std::vector<int>{1, 2, 4, 8}));
  EXPECT_EQ(valid_ulysses_degrees(8, 12, 2), (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(valid_ulysses_degrees(6, 12, 4), (std::vector<int>{1, 2}));
  EXPECT_TRUE(kv_heads_replicated(mesh(1, 4, 4, 1), 2));
  EXPECT_FALSE(kv_heads_replicated(mesh(1, 4, 4, 1), 4));
}

TEST(MeshErrors, EachMessageNamesTheFlagsAndTheValidChoices) {
  EXPECT_EQ(resolve_error({.sp = 0}, 4, 12, 4),
            "--sp 0 is not a valid degree: degrees are positive integers (1 means no split along that dimension)");
  EXPECT_EQ(resolve_error({.ring = -2}, 4, 12, 4),
            "--ring -2 is not a valid degree: degrees are positive integers (1 means no split along that dimension)");
  EXPECT_EQ(resolve_error({.sp = 3}, 4, 12, 4),
            "--sp 3 does not divide the 4 processes of this job (world = dp × sp); valid --sp: 1, 2, 4 (or start a "
            "multiple of 3 processes)");
  EXPECT_EQ(resolve_error({.ulysses = 3}, 4, 12, 4),
            "--ulysses 3 (so sp = 3) does not divide the 4 processes of this job (world = dp × sp); valid --sp: 1, 2, "
            "4 (or start a multiple of 3 processes)");
  EXPECT_EQ(resolve_error({.ulysses = 2, .ring = 3}, 4, 12, 4),
            "--ulysses 2 × --ring 3 (so sp = 6) does not divide the 4 processes of this job (world = dp × sp); valid "
            "--sp: 1, 2, 4 (or start a multiple of 6 processes)");
  EXPECT_EQ(resolve_error({.dp = 3}, 4, 12, 4),
            "--dp 3 does not divide the 4 processes of this job (world = dp × sp); valid --dp: 1, 2, 4");
  EXPECT_EQ(resolve_error({.dp = 2, .sp = 4}, 4, 12, 4),
            "--dp 2 × --sp 4 = 8, but this job has 4 processes; with --sp 4 use --dp 1 (or leave --dp out)");
  EXPECT_EQ(resolve_error({.sp = 4, .ulysses = 2, .ring = 4}, 4, 12, 4),
            "--ulysses 2 × --ring 4 = 8, but --sp is 4 (sp = ulysses × ring); valid for --sp 4: --ulysses 1 --ring 4, "
            "--ulysses 2 --ring 2, --ulysses 4 --ring 1");
  EXPECT_EQ(resolve_error({.sp = 4, .ring = 3}, 4, 12, 4),
            "--ring 3 does not divide --sp 4 (sp = ulysses × ring); valid for --sp 4: --ulysses 1 --ring 4, --ulysses "
            "2 --ring 2, --ulysses 4 --ring 1");
  EXPECT_EQ(resolve_error({.sp = 6, .ulysses = 4}, 6, 12, 4),
            "--ulysses 4 does not divide --sp 6 (sp = ulysses × ring); valid --ulysses for --sp 6: 1, 2");
  EXPECT_EQ(resolve_error({.sp = 8, .ulysses = 8}, 8, 12, 4),
            "--ulysses 8 does not divide the 12 query heads of this model (Ulysses splits heads across ranks); valid "
            "--ulysses for --sp 8: 1, 2, 4; put the rest of the sequence split on --ring");
  EXPECT_EQ(resolve_error({.sp = 6, .ulysses = 3}, 6, 12, 4),
            "--ulysses 3 cannot share the 4 KV heads of this model: they must split evenly (KV heads a multiple of "
            "the degree) or be replicated (degree a multiple of the KV heads); valid --ulysses for --sp 6: 1, 2");
  EXPECT_EQ(resolve_error({}, 4, 12, 5),
            "the model has 12 query heads and 5 KV heads; query heads must be a positive multiple of the KV heads "
            "(check num_attention_heads and num_key_value_heads in config.json)");
  EXPECT_EQ(resolve_error({}, 0, 12, 4), "the job has 0 processes; it needs at least one");
  // validate() on complete configs gives the same messages.
  EXPECT_EQ(validate_error(mesh(1, 2, 2, 1), 4, 12, 4),
            "--dp 1 × --sp 2 = 2, but this job has 4 processes; with --sp 2 use --dp 2 (or leave --dp out)");
  EXPECT_EQ(validate_error(mesh(1, 4, 0, 4), 4, 12, 4),
            "--ulysses 0 is not a valid degree: degrees are positive integers (1 means no split along that "
            "dimension)");
  EXPECT_EQ(validate_error(mesh(1, 4, 2, 2), 4, 12, 4), "no error");
}

TEST(MeshLayout, RankCoordinatesPutUlyssesInnermost) {
  MeshConfig c = mesh(2, 4, 2, 2);
  std::vector<MeshCoordinates> expected{{0, 0, 0}, {0, 0, 1}, {0, 1, 0}, {0, 1, 1},
                                        {1, 0, 0}, {1, 0, 1}, {1, 1, 0}, {1, 1, 1}};
  for (int rank = 0; rank < 8; ++rank) {
    EXPECT_EQ(coordinates_of(c, rank), expected[rank]) << rank;
    EXPECT_EQ(rank_of(c, expected[rank]), rank);
    EXPECT_EQ(sp_rank_of(c, expected[rank]), rank % 4);
  }
}

TEST(MeshLayout, SequenceMultiples) {
  EXPECT_EQ(sequence_layout(mesh(4, 1, 1, 1)), SequenceLayout::None);
  EXPECT_EQ(sequence_multiple(mesh(4, 1, 1, 1)), 1);
  EXPECT_EQ(sequence_layout(mesh(1, 4, 4, 1)), SequenceLayout::Contiguous);
  EXPECT_EQ(sequence_multiple(mesh(1, 4, 4, 1)), 4);
  EXPECT_EQ(sequence_layout(mesh(1, 4, 1, 4)), SequenceLayout::Zigzag);
  EXPECT_EQ(sequence_multiple(mesh(1, 4, 1, 4)), 8);
  EXPECT_EQ(sequence_layout(mesh(1, 8, 2, 4)), SequenceLayout::Hybrid);
  EXPECT_EQ(sequence_multiple(mesh(1, 8, 2, 4)), 16);
  EXPECT_EQ(padded_length(100, mesh(1, 8, 2, 4)), 112);
  EXPECT_EQ(padded_length(112, mesh(1, 8, 2, 4)), 112);
  EXPECT_EQ(padded_length(1, mesh(1, 4, 4, 1)), 4);
  EXPECT_EQ(padded_length(0, mesh(1, 4, 4, 1)), 0);
}

// The world ranks of a group's members, in group-rank order.
std::vector<int32_t> members(comm::Communicator& group, int world_rank) {
  auto backend = make_cpu_backend(1);
  Tensor mine = backend->empty(Shape{1}, DType::I32);
  int32_t value = world_rank;
  backend->copy_from_host(backend->default_stream(), &value, mine);
  Tensor all = backend->empty(Shape{group.size()}, DType::I32);
  group.all_gather(Stream{}, mine, all);
  std::vector<int32_t> result(group.size());
  backend->copy_to_host(backend->default_stream(), all, result.data());
  return result;
}

class MeshGroups : public ::testing::TestWithParam<MeshConfig> {};

TEST_P(MeshGroups, EachGroupHoldsTheRanksItsCoordinatesSay) {
  const MeshConfig config = GetParam();
  expect_all_succeeded(run_ranks(config.world_size(), [config](const ProcessGroupInfo& info) {
    auto world = comm::connect_cpu_world(info, comm::CommOptions{std::chrono::seconds(30)});
    Mesh m(config, *world);
    const auto me = m.coordinates();
    require(me == coordinates_of(config, info.rank), "coordinates");
    auto expect_group = [&](comm::Communicator& group, const char* name, int rank_in_group,
                            auto&& member_coordinates, int size) {
      std::vector<int32_t> want;
      for (int i = 0; i < size; ++i) want.push_back(rank_of(config, member_coordinates(i)));
      require(group.size() == size && group.rank() == rank_in_group, "{} group: rank {} of {}", name, group.rank(),
              group.size());
      require(members(group, info.rank) == want, "{} group members of rank {}", name, info.rank);
      require(group.name() == std::string("world/") + name, "{} name {}", name, group.name());
    };
    expect_group(m.dp(), "dp", me.dp, [&](int i) { return MeshCoordinates{i, me.ring, me.ulysses}; }, config.dp);
    expect_group(m.sp(), "sp", m.sp_rank(),
                 [&](int i) { return MeshCoordinates{me.dp, i / config.ulysses, i % config.ulysses}; }, config.sp);
    expect_group(m.ulysses(), "ulysses", me.ulysses, [&](int i) { return MeshCoordinates{me.dp, me.ring, i}; },
                 config.ulysses);
    expect_group(m.ring(), "ring", me.ring, [&](int i) { return MeshCoordinates{me.dp, i, me.ulysses}; }, config.ring);
  }));
}

INSTANTIATE_TEST_SUITE_P(FourProcesses, MeshGroups,
                         ::testing::Values(mesh(4, 1, 1, 1), mesh(1, 4, 4, 1), mesh(1, 4, 1, 4), mesh(1, 4, 2, 2),
                                           mesh(2, 2, 2, 1), mesh(2, 2, 1, 2)),
                         [](const auto& info) {
                           const MeshConfig& c = info.param;
                           return fmt::format("dp{}_u{}_r{}", c.dp, c.ulysses, c.ring);
                         });

TEST(MeshGroups, WorldOfTheWrongSizeIsRejected) {
  auto world = comm::connect_cpu_world(ProcessGroupInfo{});
  try {
    Mesh m(mesh(1, 2, 2, 1), *world);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "the mesh --dp 1 × --sp 2 needs 2 processes but the job has 1");
  }
}

}  // namespace
}  // namespace spindle::parallel
