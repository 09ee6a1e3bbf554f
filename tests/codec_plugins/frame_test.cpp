#include "kvrelay/codec_plugins/frame.h"

#include <xxhash.h>

#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/registry.h"

#include "counting_int8.h"

using namespace kvrelay;
using namespace kvrelay::codec;

namespace {

// Recomputes the trailing checksum so a test can reach the checks behind it.
void reseal(std::vector<std::uint8_t>& frame) {
  const std::size_t body = frame.size() - kFrameTrailerSize;
  const std::uint64_t checksum = XXH3_64bits(frame.data(), body);
  std::memcpy(frame.data() + body, &checksum, 8);
}

template <class Int>
void poke(std::vector<std::uint8_t>& frame, std::size_t offset, Int value) {
  std::memcpy(frame.data() + offset, &value, sizeof(Int));
}

ErrorCode decode_error(const CodecRegistry& registry, const std::vector<std::uint8_t>& frame, std::size_t output_size) {
  std::vector<std::uint8_t> output(output_size, 0xEE);
  auto result = decode_frame(registry, frame, output);
  return result ? ErrorCode::kOk : result.error().code;
}

struct Sample {
  CodecRegistry registry = CodecRegistry::with_builtins();
  KvLayout layout{1, 2, 4, DType::kFloat16, 3};
  std::vector<std::uint8_t> kv = synthetic_kv(layout, 5).value();
  std::size_t size() const { return kv.size(); }
};

}  // namespace

TEST_CASE("frame header carries every field at its documented offset", "[codec][frame]") {
  Sample s;
  const auto frame = encode_frame(*s.registry.find("raw"), s.layout, s.kv).value();
  REQUIRE(frame.size() == kFrameHeaderSize + s.size() + kFrameTrailerSize);
  CHECK(std::memcmp(frame.data(), "KVRF", 4) == 0);
  CHECK(frame[4] == 1);
  CHECK(frame[5] == 0);
  CHECK(frame[6] == 0);
  CHECK(frame[7] == 2);  // fp16
  CHECK(frame[8] == 1);  // raw codec id
  CHECK(frame[12] == 1);
  CHECK(frame[16] == 2);
  CHECK(frame[20] == 4);
  CHECK(frame[24] == 3);
  CHECK(frame[32] == 0);  // raw: no params
  CHECK(frame[36] == s.size());
  CHECK(frame[44] == s.size());
  CHECK(std::memcmp(frame.data() + kFrameHeaderSize, s.kv.data(), s.size()) == 0);
  auto header = inspect_frame(frame);
  REQUIRE(header);
  CHECK(header.value().layout == s.layout);
}

TEST_CASE("frames hashed while they are encoded carry the checksum of their bytes", "[codec][frame]") {
  // raw copies and hashes 256 KiB pieces, the quantizers one tensor section at a time: a layout
  // of several pieces and tensors, and an empty one.
  const CodecRegistry registry = CodecRegistry::with_builtins();
  for (const KvLayout& layout : {KvLayout{2, 4, 64, DType::kFloat32, 300}, KvLayout{3, 2, 36, DType::kBFloat16, 170},
                                 KvLayout{1, 1, 8, DType::kFloat16, 0}}) {
    const auto kv = synthetic_kv(layout, 3).value();
    for (const char* name : {"raw", "fp8", "int8", "int4", "int4+zstd", "lossless"}) {
      INFO(name << " " << layout.describe());
      const auto spec = resolve_codec(registry, name).value();
      EncodeOptions options;
      options.zstd_stage = spec.zstd_stage;
      const auto frame = encode_frame(*spec.codec, layout, kv, options).value();
      const std::size_t body = frame.size() - kFrameTrailerSize;
      std::uint64_t checksum = 0;
      std::memcpy(&checksum, frame.data() + body, 8);
      CHECK(checksum == XXH3_64bits(frame.data(), body));
      std::vector<std::uint8_t> output(kv.size());
      CHECK(decode_frame(registry, frame, output));
    }
  }
}

TEST_CASE("flipping any single bit of a valid frame is always detected", "[codec][frame]") {
  Sample s;
  for (const char* name : {"raw", "int4", "lossless"}) {
    const auto frame = encode_frame(*s.registry.find(name), s.layout, s.kv).value();
    for (std::size_t bit = 0; bit < frame.size() * 8; ++bit) {
      auto corrupted = frame;
      corrupted[bit / 8] ^= static_cast<std::uint8_t>(1U << (bit % 8));
      INFO(name << " bit " << bit);
      REQUIRE(decode_error(s.registry, corrupted, s.size()) != ErrorCode::kOk);
    }
  }
}

TEST_CASE("every malformed field maps to its own error code", "[codec][frame]") {
  Sample s;
  const auto good = encode_frame(*s.registry.find("int8"), s.layout, s.kv).value();
  REQUIRE(decode_error(s.registry, good, s.size()) == ErrorCode::kOk);

  SECTION("truncated anywhere") {
    for (std::size_t length = 0; length < good.size(); ++length) {
      const std::vector<std::uint8_t> cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(length));
      INFO("length " << length);
      REQUIRE(decode_error(s.registry, cut, s.size()) == ErrorCode::kTruncated);
    }
  }
  SECTION("bad magic") {
    auto frame = good;
    frame[0] = 'X';
    CHECK(decode_error(s.registry, frame, s.size()) == ErrorCode::kBadMagic);
  }
  SECTION("bad version") {
    auto frame = good;
    poke<std::uint16_t>(frame, 4, 2);
    CHECK(decode_error(s.registry, frame, s.size()) == ErrorCode::kBadVersion);
  }
  SECTION("checksum") {
    auto frame = good;
    frame[kFrameHeaderSize + 30] ^= 1;
    CHECK(decode_error(s.registry, frame, s.size()) == ErrorCode::kChecksumMismatch);
  }
  SECTION("unknown codec") {
    auto frame = good;
    poke<std::uint32_t>(frame, 8, 999);
    reseal(frame);
    CHECK(decode_error(s.registry, frame, s.size()) == ErrorCode::kUnknownCodec);
  }
  SECTION("layout sizes that overflow") {
    auto frame = good;
    poke<std::uint32_t>(frame, 12, 1024);
    poke<std::uint32_t>(frame, 16, 1024);
    poke<std::uint32_t>(frame, 20, 4096);
    poke<std::uint64_t>(frame, 24, std::uint64_t{1} << 40);
    reseal(frame);
    CHECK(decode_error(s.registry, frame, s.size()) == ErrorCode::kOverflow);
  }
  SECTION("layout that disagrees with the payload length") {
    auto frame = good;
    poke<std::uint64_t>(frame, 24, 300);  // more tokens than the payload holds
    reseal(frame);
    CHECK(decode_error(s.registry, frame, s.size()) == ErrorCode::kLayoutMismatch);
  }
  SECTION("output buffer that disagrees with the layout") {
    CHECK(decode_error(s.registry, good, s.size() + 2) == ErrorCode::kLayoutMismatch);
  }
  SECTION("invalid layout fields") {
    auto frame = good;
    frame[7] = 9;  // dtype
    reseal(frame);
    CHECK(decode_error(s.registry, frame, s.size()) == ErrorCode::kLayoutMismatch);
    frame = good;
    poke<std::uint32_t>(frame, 16, 0);  // kv_heads
    reseal(frame);
    CHECK(decode_error(s.registry, frame, s.size()) == ErrorCode::kLayoutMismatch);
  }
  SECTION("trailing bytes and unknown flags are corrupt") {
    auto frame = good;
    frame.push_back(0);
    CHECK(decode_error(s.registry, frame, s.size()) == ErrorCode::kCorrupt);
    frame = good;
    frame[6] = 0x80;
    reseal(frame);
    CHECK(decode_error(s.registry, frame, s.size()) == ErrorCode::kCorrupt);
  }
  SECTION("codec payload shorter than its layout needs") {
    // A consistent, sealed frame whose int8 payload lacks its last byte.
    auto frame = good;
    frame.erase(frame.end() - static_cast<std::ptrdiff_t>(kFrameTrailerSize) - 1);
    const std::uint64_t payload = frame.size() - kFrameHeaderSize - 20 - kFrameTrailerSize;
    poke<std::uint64_t>(frame, 36, payload);
    poke<std::uint64_t>(frame, 44, payload);
    reseal(frame);
    CHECK(decode_error(s.registry, frame, s.size()) == ErrorCode::kTruncated);
  }
  SECTION("bad codec params") {
    auto frame = good;
    poke<std::uint32_t>(frame, kFrameHeaderSize + 8, 3);  // odd group size
    reseal(frame);
    CHECK(decode_error(s.registry, frame, s.size()) == ErrorCode::kLayoutMismatch);
  }
}

TEST_CASE("decode writes nothing outside its output and allocating decode caps the size", "[codec][frame]") {
  Sample s;
  const auto frame = encode_frame(*s.registry.find("raw"), s.layout, s.kv).value();
  auto decoded = decode_frame(s.registry, frame, s.size());
  REQUIRE(decoded);
  CHECK(decoded.value() == s.kv);
  auto refused = decode_frame(s.registry, frame, s.size() - 1);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::kResourceExhausted);
}

TEST_CASE("zstd stage frames round-trip and reject a lying inner length", "[codec][frame]") {
  Sample s;
  s.layout = KvLayout{2, 2, 16, DType::kBFloat16, 200};
  s.kv = synthetic_kv(s.layout, 9).value();
  EncodeOptions options;
  options.zstd_stage = true;
  const auto frame = encode_frame(*s.registry.find("int4"), s.layout, s.kv, options).value();
  const auto plain = encode_frame(*s.registry.find("int4"), s.layout, s.kv).value();
  CHECK(frame[6] == kFrameFlagZstdStage);
  std::vector<std::uint8_t> staged(s.size());
  std::vector<std::uint8_t> direct(s.size());
  REQUIRE(decode_frame(s.registry, frame, staged));
  REQUIRE(decode_frame(s.registry, plain, direct));
  CHECK(staged == direct);

  auto lying = frame;
  std::uint64_t inner;
  std::memcpy(&inner, lying.data() + 36, 8);
  poke<std::uint64_t>(lying, 36, inner - 1);
  reseal(lying);
  CHECK(decode_error(s.registry, lying, s.size()) == ErrorCode::kCorrupt);
}

TEST_CASE("decode_frame_view: a raw frame's KV is a view into the frame, other codecs decode", "[codec][frame]") {
  Sample s;
  WarmBufferPool buffers(2, 1 << 20);
  const auto raw_frame = encode_frame(*s.registry.find("raw"), s.layout, s.kv).value();
  auto raw = decode_frame_view(s.registry, raw_frame, s.size(), buffers);
  REQUIRE(raw);
  CHECK(raw.value().header.layout == s.layout);
  CHECK(raw.value().kv.data() == raw_frame.data() + kFrameHeaderSize);  // no copy
  CHECK(raw.value().storage.size() == 0);
  CHECK(std::vector<std::uint8_t>(raw.value().kv.begin(), raw.value().kv.end()) == s.kv);

  for (const char* name : {"lossless", "int8"}) {
    const auto frame = encode_frame(*s.registry.find(name), s.layout, s.kv).value();
    std::vector<std::uint8_t> expected(s.size());
    REQUIRE(decode_frame(s.registry, frame, expected));
    auto decoded = decode_frame_view(s.registry, frame, s.size(), buffers);
    REQUIRE(decoded);
    CHECK(decoded.value().storage.size() == s.size());
    CHECK(std::vector<std::uint8_t>(decoded.value().kv.begin(), decoded.value().kv.end()) == expected);
  }
}

TEST_CASE("decode_frame_view refuses what decode_frame refuses", "[codec][frame]") {
  Sample s;
  WarmBufferPool buffers(2, 1 << 20);
  auto frame = encode_frame(*s.registry.find("raw"), s.layout, s.kv).value();
  auto view_error = [&](const std::vector<std::uint8_t>& bytes, std::uint64_t max_bytes) {
    auto result = decode_frame_view(s.registry, bytes, max_bytes, buffers);
    return result ? ErrorCode::kOk : result.error().code;
  };
  CHECK(view_error(frame, s.size() - 1) == ErrorCode::kResourceExhausted);
  auto flipped = frame;
  flipped[kFrameHeaderSize] ^= 1;  // payload bit: only the checksum sees it
  CHECK(view_error(flipped, s.size()) == ErrorCode::kChecksumMismatch);
  auto unknown = frame;
  poke<std::uint32_t>(unknown, 8, 9999);
  reseal(unknown);
  CHECK(view_error(unknown, s.size()) == ErrorCode::kUnknownCodec);
  // A raw frame whose payload is shorter than its layout (and so is the frame): truncated.
  auto short_payload = frame;
  short_payload.erase(short_payload.begin() + kFrameHeaderSize,
                      short_payload.begin() + static_cast<std::ptrdiff_t>(kFrameHeaderSize + 2));
  poke<std::uint64_t>(short_payload, 36, s.size() - 2);
  poke<std::uint64_t>(short_payload, 44, s.size() - 2);
  reseal(short_payload);
  CHECK(view_error(short_payload, s.size()) == ErrorCode::kTruncated);
  CHECK(decode_error(s.registry, short_payload, s.size()) != ErrorCode::kOk);
}

TEST_CASE("another implementation of a codec writes and reads the same frames", "[codec][frame]") {
  const auto registry = CodecRegistry::with_builtins();
  const Codec& int8 = *registry.find("int8");
  const kvrelay_codec_plugin counted = test::counting_int8();
  const KvLayout layout{2, 4, 32, DType::kFloat16, 150};
  const auto kv = synthetic_kv(layout, 4).value();
  for (const bool zstd : {false, true}) {
    INFO("zstd stage " << zstd);
    EncodeOptions plain;
    plain.zstd_stage = zstd;
    EncodeOptions other = plain;
    other.implementation = &counted;
    test::counting_int8_calls = 0;
    const auto expected = encode_frame(int8, layout, kv, plain).value();
    CHECK(test::counting_int8_calls == 0);
    CHECK(encode_frame(int8, layout, kv, other).value() == expected);
    CHECK(test::counting_int8_calls == 1);
    std::vector<std::uint8_t> mine(kv.size());
    std::vector<std::uint8_t> theirs(kv.size());
    REQUIRE(decode_frame(registry, expected, mine));
    REQUIRE(decode_frame(registry, expected, theirs, &counted));
    CHECK(test::counting_int8_calls == 2);
    CHECK(theirs == mine);
  }
  // An implementation of another codec is refused, naming both.
  EncodeOptions wrong;
  wrong.implementation = int4_codec();
  const auto refused = encode_frame(int8, layout, kv, wrong);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::kInvalidArgument);
  CHECK(refused.error().message.find("int4") != std::string::npos);
  const auto frame = encode_frame(int8, layout, kv).value();
  std::vector<std::uint8_t> output(kv.size());
  const auto mismatched = decode_frame(registry, frame, output, int4_codec());
  REQUIRE_FALSE(mismatched);
  CHECK(mismatched.error().code == ErrorCode::kInvalidArgument);
}
