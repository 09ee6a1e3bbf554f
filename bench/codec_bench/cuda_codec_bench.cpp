// cuda_codec_bench: throughput of the CUDA codecs on device memory, next to a device-to-device
// cudaMemcpy of the same KV measured in the same run (the HBM limit such a pass can reach), and
// a byte-for-byte check of every GPU output against the CPU codec at the benchmark's shape.
// Prints one JSON object; exits 77 without a device.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/builtin_params.h"
#include "kvrelay/codec_plugins/byte_planes.h"
#include "kvrelay/codec_plugins/metrics.h"

#if defined(KVRELAY_HAVE_CUDA)
#include <cuda_runtime.h>

#include "kvrelay/codec_plugins/cuda_codecs.h"
#endif

using namespace kvrelay;
using namespace kvrelay::codec;

#if defined(KVRELAY_HAVE_CUDA)
namespace {

struct DeviceBytes {
  void* pointer = nullptr;
  explicit DeviceBytes(std::size_t size) {
    if (cudaMalloc(&pointer, size == 0 ? 1 : size) != cudaSuccess) pointer = nullptr;
  }
  ~DeviceBytes() { cudaFree(pointer); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
};

// Seconds of one call, timed with CUDA events: best and median of `repeats` after one warm-up.
struct Timing {
  double best = 0;
  double median = 0;
};

template <class Body>
Timing time_device(int repeats, Body&& body) {
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  body();
  cudaDeviceSynchronize();
  std::vector<double> seconds;
  for (int i = 0; i < repeats; ++i) {
    cudaEventRecord(start);
    body();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float milliseconds = 0;
    cudaEventElapsedTime(&milliseconds, start, stop);
    seconds.push_back(milliseconds / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(seconds.begin(), seconds.end());
  return {seconds.front(), seconds[seconds.size() / 2]};
}

double gbps(std::size_t bytes, double seconds) {
  return static_cast<double>(bytes) / seconds / 1e9;
}

std::vector<std::uint8_t> to_host(const void* device, std::size_t size) {
  std::vector<std::uint8_t> host(size);
  cudaMemcpy(host.data(), device, size, cudaMemcpyDeviceToHost);
  return host;
}

}  // namespace
#endif

int main(int argc, char** argv) {
  CLI::App app{"Throughput of the CUDA codecs next to a device-to-device copy; prints JSON"};
  std::uint32_t layers = 32;
  std::uint32_t heads = 8;
  std::uint32_t dim = 128;
  std::uint32_t tokens = 4096;
  std::string dtype_name = "bf16";
  int repeats = 20;
  app.add_option("--layers", layers, "layers")->check(CLI::Range(1U, 1024U));
  app.add_option("--kv-heads", heads, "KV heads")->check(CLI::Range(1U, 1024U));
  app.add_option("--head-dim", dim, "head dimension")->check(CLI::Range(1U, 4096U));
  app.add_option("--tokens", tokens, "tokens")->check(CLI::Range(1U, 1U << 22));
  app.add_option("--dtype", dtype_name, "f32, f16 or bf16")->check(CLI::IsMember({"f32", "f16", "bf16"}));
  app.add_option("--repeats", repeats, "timed repeats per measurement")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);
#if !defined(KVRELAY_HAVE_CUDA)
  std::puts(R"({"skipped": "built without CUDA"})");
  return 77;
#else
  if (cuda::device_count() == 0) {
    std::puts(R"({"skipped": "no CUDA device"})");
    return 77;
  }
  const DType dtype = dtype_name == "f32" ? DType::kFloat32 : dtype_name == "f16" ? DType::kFloat16 : DType::kBFloat16;
  const KvLayout layout{layers, heads, dim, dtype, tokens};
  const auto kv = synthetic_kv(layout, 7).value();
  cudaDeviceProp properties{};
  cudaGetDeviceProperties(&properties, 0);

  DeviceBytes device_kv(kv.size());
  DeviceBytes device_copy(kv.size());
  DeviceBytes device_out(kv.size());
  if (device_kv.pointer == nullptr || device_copy.pointer == nullptr || device_out.pointer == nullptr) {
    std::fprintf(stderr, "cudaMalloc of %zu bytes failed\n", kv.size());
    return 1;
  }
  cudaMemcpy(device_kv.pointer, kv.data(), kv.size(), cudaMemcpyHostToDevice);

  // The limit: a device-to-device copy reads and writes every byte once.
  const Timing copy = time_device(
      repeats, [&] { cudaMemcpy(device_copy.pointer, device_kv.pointer, kv.size(), cudaMemcpyDeviceToDevice); });
  const double copy_gbps = gbps(2 * kv.size(), copy.best);

  nlohmann::json result;
  result["bench"] = "cuda_codec_bench";
  result["device"] = properties.name;
  result["multiprocessors"] = properties.multiProcessorCount;
  result["layout"] = layout.describe();
  result["kv_bytes"] = kv.size();
  result["repeats"] = repeats;
  result["d2d_copy"] = {{"seconds_best", copy.best},
                        {"seconds_median", copy.median},
                        {"gbps_read_plus_write", copy_gbps},
                        {"note", "cudaMemcpy device to device of the KV: the HBM limit of one pass"}};

  bool all_equal = true;
  // Each row: GB/s counting bytes read plus written, its fraction of the copy's, and the KV rate.
  auto report = [&](const Timing& timing, std::size_t read_bytes, std::size_t written_bytes) {
    const double moved = gbps(read_bytes + written_bytes, timing.best);
    return nlohmann::json{{"seconds_best", timing.best},
                          {"seconds_median", timing.median},
                          {"kv_gbps", gbps(kv.size(), timing.best)},
                          {"gbps_read_plus_write", moved},
                          {"fraction_of_d2d_copy", moved / copy_gbps}};
  };

  struct Case {
    const char* name;
    cuda::Quantizer quantizer;
    const kvrelay_codec_plugin* cpu;
    std::uint32_t group;
  };
  const Case cases[] = {{"fp8", cuda::Quantizer::kFp8, fp8_codec(), 32},
                        {"int8", cuda::Quantizer::kInt8, int8_codec(), 64},
                        {"int4", cuda::Quantizer::kInt4, int4_codec(), 32}};
  for (const Case& c : cases) {
    BuiltinParams params;
    params.group_size = c.group;
    const auto wire = params.serialize();
    const std::size_t payload_size = cuda::quant_payload_size(c.quantizer, layout, params).value();
    const kvrelay_codec_layout c_layout{layout.layers, layout.kv_heads, layout.head_dim,
                                        static_cast<std::uint32_t>(layout.dtype), layout.tokens};
    std::vector<std::uint8_t> cpu_payload(c.cpu->max_encoded_size(&c_layout, wire.data(), wire.size()));
    std::size_t written = 0;
    const auto cpu_start = std::chrono::steady_clock::now();
    const bool cpu_ok = c.cpu->encode(&c_layout, wire.data(), wire.size(), kv.data(), kv.size(), cpu_payload.data(),
                                      cpu_payload.size(), &written) == 0;
    const double cpu_encode_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - cpu_start).count();
    cpu_payload.resize(written);
    std::vector<std::uint8_t> cpu_decoded(kv.size());
    const bool cpu_decode_ok = c.cpu->decode(&c_layout, wire.data(), wire.size(), cpu_payload.data(), written,
                                             cpu_decoded.data(), cpu_decoded.size()) == 0;

    bool calls_ok = true;
    const Timing encode = time_device(repeats, [&] {
      calls_ok &= bool(cuda::quant_encode(c.quantizer, layout, params, device_kv.pointer, device_out.pointer));
    });
    const bool encode_equal =
        cpu_ok && payload_size == written && to_host(device_out.pointer, payload_size) == cpu_payload;
    cudaMemcpy(device_out.pointer, cpu_payload.data(), written, cudaMemcpyHostToDevice);
    const Timing decode = time_device(repeats, [&] {
      calls_ok &= bool(cuda::quant_decode(c.quantizer, layout, params, device_out.pointer, device_copy.pointer));
    });
    const bool decode_equal = cpu_decode_ok && to_host(device_copy.pointer, kv.size()) == cpu_decoded;
    all_equal &= calls_ok && encode_equal && decode_equal;
    result["codecs"][c.name] = {{"group", c.group},
                                {"payload_bytes", payload_size},
                                {"encode", report(encode, kv.size(), payload_size)},
                                {"decode", report(decode, payload_size, kv.size())},
                                {"cpu_encode_seconds_one_core", cpu_encode_seconds},
                                {"gpu_encode_speedup_over_one_core", cpu_encode_seconds / encode.best},
                                {"encode_equals_cpu_bytes", encode_equal},
                                {"decode_equals_cpu_bytes", decode_equal},
                                {"calls_ok", calls_ok}};
  }

  // Byte planes (the lossless codec's GPU stage).
  const std::size_t element_size = dtype_size(dtype);
  const std::size_t elements = kv.size() / element_size;
  std::vector<std::uint8_t> cpu_planes(kv.size());
  split_byte_planes(kv.data(), elements, element_size, cpu_planes.data());
  bool planes_ok = true;
  const Timing split = time_device(repeats, [&] {
    planes_ok &= bool(cuda::split_byte_planes(device_kv.pointer, elements, element_size, device_out.pointer));
  });
  const bool split_equal = to_host(device_out.pointer, kv.size()) == cpu_planes;
  const Timing merge = time_device(repeats, [&] {
    planes_ok &= bool(cuda::merge_byte_planes(device_out.pointer, elements, element_size, device_copy.pointer));
  });
  const bool merge_equal = to_host(device_copy.pointer, kv.size()) == kv;
  all_equal &= planes_ok && split_equal && merge_equal;
  result["byte_planes"] = {{"split", report(split, kv.size(), kv.size())},
                           {"merge", report(merge, kv.size(), kv.size())},
                           {"split_equals_cpu_bytes", split_equal},
                           {"merge_restores_input", merge_equal}};
  result["all_outputs_equal_cpu"] = all_equal;
  std::printf("%s\n", result.dump(2).c_str());
  return all_equal ? 0 : 1;
#endif
}
