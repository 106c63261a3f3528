// Opening and validating single files, above all the ways a file can be broken.
#include <gtest/gtest.h>

#include <cstring>

#include "io/safetensors_file.h"
#include "io_test_util.h"

using namespace spindle;
using namespace spindle::io;
using namespace spindle::io::testing;

namespace {

std::string open_error(const ScratchDir& dir, const std::string& bytes) {
  const std::string path = dir.file("t.safetensors");
  write_bytes(path, bytes);
  return error_of([&] { SafetensorsFile file(path); });
}

}  // namespace

TEST(SafetensorsRead, ParsesEntriesMetadataAndData) {
  ScratchDir dir;
  const std::string path = dir.file("ok.safetensors");
  // Header order differs from data order on purpose: names() follows the header.
  write_bytes(path, raw_safetensors(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[4,20]},)"
                                    R"("__metadata__":{"format":"pt","note":"x"},)"
                                    R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
                                    R"("flag":{"dtype":"BOOL","shape":[3],"data_offsets":[20,23]},)"
                                    R"("empty":{"dtype":"F16","shape":[0,5],"data_offsets":[23,23]},)"
                                    R"("scalar":{"dtype":"U8","shape":[],"data_offsets":[23,24]}})",
                                    24));
  SafetensorsFile file(path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"w", "b", "flag", "empty", "scalar"}));
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.metadata().at("note"), "x");
  EXPECT_EQ(file.find("missing"), nullptr);

  const TensorRecord* w = file.find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, DType::F32);
  EXPECT_EQ(w->shape, (Shape{2, 2}));
  EXPECT_EQ(w->bytes, 16u);
  EXPECT_EQ(w->file, path);
  EXPECT_EQ(static_cast<const unsigned char*>(w->data)[0], 4);  // data byte i holds i
  const TensorRecord* flag = file.find("flag");
  EXPECT_EQ(flag->dtype, DType::U8);
  EXPECT_EQ(flag->stored_dtype, "BOOL");
  EXPECT_EQ(file.find("empty")->shape, (Shape{0, 5}));
  EXPECT_EQ(file.find("scalar")->shape.numel(), 1);
}

TEST(SafetensorsRead, EmptyHeaderIsAValidFile) {
  ScratchDir dir;
  write_bytes(dir.file("e.safetensors"), raw_safetensors("{}      ", 0));
  SafetensorsFile file(dir.file("e.safetensors"));
  EXPECT_TRUE(file.names().empty());
}

TEST(SafetensorsRead, UnsupportedDtypeFailsOnlyWhenRequested) {
  ScratchDir dir;
  const std::string path = dir.file("f8.safetensors");
  write_bytes(path, raw_safetensors(R"({"scale":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                    R"("w":{"dtype":"F8_E4M3","shape":[2,3],"data_offsets":[4,10]},)"
                                    R"("odd":{"dtype":"Q4_K","shape":[7],"data_offsets":[10,13]}})",
                                    13));
  SafetensorsFile file(path);
  EXPECT_EQ(file.names().size(), 3u);
  EXPECT_NE(file.find("scale"), nullptr);
  EXPECT_TRUE(file.contains("w"));
  std::string message = error_of([&] { file.find("w"); });
  EXPECT_TRUE(contains(message, "'w'"));
  EXPECT_TRUE(contains(message, "F8_E4M3"));
  EXPECT_TRUE(contains(message, path));
  EXPECT_TRUE(contains(error_of([&] { file.find("odd"); }), "Q4_K"));
}

TEST(SafetensorsRead, KnownUnsupportedDtypeStillHasItsSizeChecked) {
  ScratchDir dir;
  std::string message = open_error(dir, raw_safetensors(R"({"w":{"dtype":"I16","shape":[3],"data_offsets":[0,3]}})", 3));
  EXPECT_TRUE(contains(message, "needs 6 bytes"));
}

TEST(SafetensorsRead, MissingFile) {
  std::string message = error_of([] { SafetensorsFile file("/nonexistent/spindle/x.safetensors"); });
  EXPECT_TRUE(contains(message, "cannot open"));
  EXPECT_TRUE(contains(message, "/nonexistent/spindle/x.safetensors"));
}

TEST(SafetensorsRead, TruncatedBeforeHeaderLength) {
  ScratchDir dir;
  std::string message = open_error(dir, std::string("\x10\x00\x00", 3));
  EXPECT_TRUE(contains(message, "truncated"));
  EXPECT_TRUE(contains(message, "3 bytes"));
  EXPECT_TRUE(contains(open_error(dir, ""), "truncated"));
}

TEST(SafetensorsRead, HeaderLengthPastEndOfFile) {
  ScratchDir dir;
  std::string bytes = raw_safetensors(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1);
  bytes.resize(20);  // cut inside the header
  std::string message = open_error(dir, bytes);
  EXPECT_TRUE(contains(message, "header length"));
  EXPECT_TRUE(contains(message, "only 12 bytes follow"));
}

TEST(SafetensorsRead, HeaderLengthAboveLimit) {
  ScratchDir dir;
  std::string bytes(8, '\0');
  uint64_t huge = 200'000'000;
  std::memcpy(bytes.data(), &huge, 8);
  bytes += "{}";
  std::string message = open_error(dir, bytes);
  EXPECT_TRUE(contains(message, "200000000"));
  EXPECT_TRUE(contains(message, "limit"));
}

TEST(SafetensorsRead, BadJson) {
  ScratchDir dir;
  EXPECT_TRUE(contains(open_error(dir, raw_safetensors(R"({"a":{"dtype":"U8",)", 0)), "not valid JSON"));
  EXPECT_TRUE(contains(open_error(dir, raw_safetensors("[1, 2]", 0)), "must be a JSON object"));
  EXPECT_TRUE(contains(open_error(dir, raw_safetensors("{\"a\xff\":{}}", 0)), "not valid JSON"));  // bad UTF-8
}

TEST(SafetensorsRead, MalformedEntries) {
  ScratchDir dir;
  EXPECT_TRUE(contains(open_error(dir, raw_safetensors(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", 1)), "tensor 'a' has a malformed header entry: 'dtype'"));
  EXPECT_TRUE(contains(open_error(dir, raw_safetensors(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1)), "non-negative"));
  EXPECT_TRUE(contains(open_error(dir, raw_safetensors(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", 1)), "'data_offsets'"));
  EXPECT_TRUE(contains(open_error(dir, raw_safetensors(R"({"a":{"dtype":"U8","shape":[1,1,1,1,1,1,1],"data_offsets":[0,1]}})", 1)), "7 dimensions"));
  EXPECT_TRUE(contains(open_error(dir, raw_safetensors(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}})", 1)), "end before they begin"));
  EXPECT_TRUE(contains(open_error(dir, raw_safetensors(R"({"__metadata__":{"k":1}})", 0)), "__metadata__ entry 'k' must be a string"));
}

TEST(SafetensorsRead, OffsetsPastEndOfData) {
  ScratchDir dir;
  std::string message =
      open_error(dir, raw_safetensors(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 10));
  EXPECT_TRUE(contains(message, "tensor 'a'"));
  EXPECT_TRUE(contains(message, "only 10 data bytes"));
  EXPECT_TRUE(contains(message, "truncated"));
}

TEST(SafetensorsRead, SizeDoesNotMatchShape) {
  ScratchDir dir;
  std::string message =
      open_error(dir, raw_safetensors(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 20));
  EXPECT_TRUE(contains(message, "tensor 'a' is F32[2, 3] which needs 24 bytes"));
  EXPECT_TRUE(contains(message, "span 20 bytes"));
  // A shape whose element count overflows 64 bits must not wrap around to a small size.
  message = open_error(dir, raw_safetensors(
      R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0));
  EXPECT_TRUE(contains(message, "64-bit"));
}

TEST(SafetensorsRead, HoleBetweenTensors) {
  ScratchDir dir;
  std::string message = open_error(dir, raw_safetensors(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                                        R"("b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
                                                        6));
  EXPECT_TRUE(contains(message, "[2, 4) belong to no tensor"));
  EXPECT_TRUE(contains(message, "'b'"));
  message = open_error(dir, raw_safetensors(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})", 4));
  EXPECT_TRUE(contains(message, "[0, 2) belong to no tensor"));
}

TEST(SafetensorsRead, TrailingBytesAfterLastTensor) {
  ScratchDir dir;
  std::string message =
      open_error(dir, raw_safetensors(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 5));
  EXPECT_TRUE(contains(message, "[2, 5) at the end of the file belong to no tensor"));
}

TEST(SafetensorsRead, OverlappingTensors) {
  ScratchDir dir;
  std::string message = open_error(dir, raw_safetensors(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                                                        R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                                                        6));
  EXPECT_TRUE(contains(message, "'a' and 'b' overlap"));
}

TEST(SafetensorsRead, DuplicateTensorName) {
  ScratchDir dir;
  std::string message = open_error(dir, raw_safetensors(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                                        R"("a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                                                        4));
  EXPECT_TRUE(contains(message, "tensor 'a' appears twice"));
  message = open_error(dir, raw_safetensors(R"({"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 2));
  EXPECT_TRUE(contains(message, "key 'dtype' appears twice"));
}

TEST(SafetensorsRead, DirectoryIsNotAFile) {
  ScratchDir dir;
  EXPECT_TRUE(contains(error_of([&] { SafetensorsFile file(dir.path().string()); }), "not a regular file"));
}
