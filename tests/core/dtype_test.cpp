#include "kvrelay/core/dtype.h"

#include <catch2/catch.hpp>

#include <cstdint>

#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/model_fingerprint.h"

using kvrelay::DType;
using kvrelay::dtype_from_wire;
using kvrelay::dtype_name;
using kvrelay::dtype_size;
using kvrelay::parse_dtype;

TEST_CASE("dtype names, sizes and wire values of every dtype", "[core][dtype]") {
  struct Expected {
    DType dtype;
    std::uint8_t wire;
    const char* name;
    std::size_t size;
    bool bytes_only;
  };
  const Expected all[] = {{DType::kFloat32, 1, "fp32", 4, false},
                          {DType::kFloat16, 2, "fp16", 2, false},
                          {DType::kBFloat16, 3, "bf16", 2, false},
                          {DType::kFp8E4M3, 4, "fp8_e4m3", 1, true},
                          {DType::kFp8E5M2, 5, "fp8_e5m2", 1, true}};
  for (const auto& expected : all) {
    INFO(expected.name);
    CHECK(static_cast<std::uint8_t>(expected.dtype) == expected.wire);
    CHECK(dtype_from_wire(expected.wire) == expected.dtype);
    CHECK(dtype_name(expected.dtype) == expected.name);
    CHECK(parse_dtype(expected.name) == expected.dtype);
    CHECK(dtype_size(expected.dtype) == expected.size);
    CHECK(kvrelay::dtype_moves_as_bytes(expected.dtype) == expected.bytes_only);
  }
}

TEST_CASE("torch's dtype names parse, a bare fp8 does not", "[core][dtype]") {
  CHECK(parse_dtype("float8_e4m3fn") == DType::kFp8E4M3);
  CHECK(parse_dtype("float8_e5m2") == DType::kFp8E5M2);
  CHECK(parse_dtype("bfloat16") == DType::kBFloat16);
  CHECK_FALSE(parse_dtype("fp8"));
  CHECK_FALSE(parse_dtype("int8"));
}

TEST_CASE("unknown wire dtypes are refused", "[core][dtype]") {
  for (const int value : {0, 6, 7, 64, 255}) {
    INFO(value);
    CHECK_FALSE(dtype_from_wire(static_cast<std::uint8_t>(value)));
    const kvrelay::KvLayout layout{2, 2, 4, static_cast<DType>(value), 16};
    CHECK(layout.validate().error().code == kvrelay::ErrorCode::kInvalidArgument);
  }
}

TEST_CASE("an fp8 layout counts one byte per element", "[core][dtype]") {
  const kvrelay::KvLayout layout{32, 8, 128, DType::kFp8E4M3, 2048};
  CHECK(layout.total_bytes().value() == 32ULL * 2 * 2048 * 8 * 128);
  CHECK(layout.bytes_per_token().value() == 32ULL * 2 * 8 * 128);
  CHECK(layout.tensor_offset(1, true).value() == 3ULL * 2048 * 8 * 128);
}

TEST_CASE("fp8 and bf16 models have different fingerprints", "[core][dtype]") {
  const kvrelay::ModelFingerprint bf16{"llama", 32, 8, 128, DType::kBFloat16, "w"};
  kvrelay::ModelFingerprint e4m3 = bf16;
  e4m3.dtype = DType::kFp8E4M3;
  kvrelay::ModelFingerprint e5m2 = bf16;
  e5m2.dtype = DType::kFp8E5M2;
  CHECK(bf16.id() != e4m3.id());
  CHECK(e4m3.id() != e5m2.id());
}
