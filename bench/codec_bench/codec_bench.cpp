// codec_bench: single-core encode/decode throughput and quality of every codec, next to memcpy
// measured on the same buffer sizes in the same run. Prints one JSON object.

#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "kvrelay/audit/statistics.h"
#include "kvrelay/codec_plugins/cpu_path.h"
#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/codec_plugins/tensor_file.h"

#include "common/spread_json.h"

using namespace kvrelay;
using namespace kvrelay::codec;

namespace {

using Clock = std::chrono::steady_clock;

// Best (shortest) of `repeats` runs, in CPU time of this thread and in wall time. On a shared
// machine the CPU time leaves out the time other processes held the core, which otherwise
// penalizes a long encode more than a short memcpy; both are reported.
struct Timing {
  double cpu = 1e30;
  double wall = 1e30;
};

double thread_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

template <class Body>
Timing best_seconds(int repeats, Body&& body) {
  Timing best;
  for (int i = 0; i < repeats; ++i) {
    const auto start = Clock::now();
    const double cpu_start = thread_cpu_seconds();
    body();
    best.cpu = std::min(best.cpu, thread_cpu_seconds() - cpu_start);
    best.wall = std::min(best.wall, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return best;
}

std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

// Other load on the machine skews every figure; the run records it.
std::string load_average() {
  std::ifstream loadavg("/proc/loadavg");
  std::string line;
  std::getline(loadavg, line);
  return line;
}

constexpr std::size_t kDramSampleBytes = std::size_t{32} << 20;

double gbps(std::size_t bytes, double seconds) {
  return static_cast<double>(bytes) / seconds / 1e9;
}

// Each run of `body` right after a memcpy of the same bytes, both in thread CPU time: the pair's
// two sides see the same moment of the host. On this project's VM a 64 MiB memcpy swings from
// run to run (back to back: a median near 15 GB/s, bests up to 22) far more than the codec
// loops, which are bound by instructions, so a best encode over a best memcpy compares the
// memcpy's rare peak with the codec's usual rate.
struct Paired {
  std::vector<double> ratios;       // memcpy time / body time: the body's rate as a fraction of memcpy's
  std::vector<double> memcpy_gbps;  // each pair's memcpy
};

template <class Body>
Paired paired_vs_memcpy(int pairs, std::vector<std::uint8_t>& scratch, const std::vector<std::uint8_t>& from,
                        Body&& body) {
  Paired paired;
  for (int pair = 0; pair < pairs; ++pair) {
    double start = thread_cpu_seconds();
    std::memcpy(scratch.data(), from.data(), from.size());
    const double copy_seconds = thread_cpu_seconds() - start;
    start = thread_cpu_seconds();
    body();
    paired.ratios.push_back(copy_seconds / (thread_cpu_seconds() - start));
    paired.memcpy_gbps.push_back(static_cast<double>(from.size()) / copy_seconds / 1e9);
  }
  return paired;
}

nlohmann::json spread(const Paired& paired) {
  auto out = bench::spread_json(paired.ratios);
  out["memcpy_median_gbps"] = audit::median(paired.memcpy_gbps);
  return out;
}

struct Sample {
  std::string name;
  KvLayout layout;
  std::vector<std::uint8_t> kv;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"codec_bench: one-core codec throughput and quality (JSON)"};
  std::uint64_t tokens = 2048;
  std::string shape = "8,8,128";
  int repeats = 3;
  int pairs = 9;
  std::string codecs = "raw,lossless,fp8,int8,int4,int4+zstd,sparse";
  std::string kv_file;
  std::string kv_layout;
  std::uint64_t kv_tokens = 0;
  std::string kv_name;
  std::vector<std::string> kv_convert;
  std::string cpu_path = "auto";
  app.add_option("--tokens", tokens, "Tokens of the synthetic samples");
  app.add_option("--shape", shape, "Synthetic sample L,H,D");
  app.add_option("--repeats", repeats, "Timed repetitions (best is kept)");
  app.add_option("--pairs", pairs, "memcpy/codec pairs behind each *_vs_memcpy_paired figure")
      ->check(CLI::Range(1, 1000));
  app.add_option("--codecs", codecs, "Comma-separated codecs");
  app.add_option("--kv", kv_file, "Extra sample: raw KV file (e.g. from the reference worker)");
  app.add_option("--kv-layout", kv_layout, "Its layout L,H,D,DTYPE");
  app.add_option("--kv-tokens", kv_tokens, "Its token count");
  app.add_option("--kv-name", kv_name, "Its name in the output (default: the file path)");
  app.add_option("--kv-convert", kv_convert, "fp32 --kv only: also run it converted to these dtypes (fp16, bf16)")
      ->delimiter(',');
  app.add_option("--cpu-path", cpu_path, "Codec loops: auto (fastest this CPU runs), baseline (SSE2), avx2 or avx512");
  CLI11_PARSE(app, argc, argv);

  if (cpu_path != "auto") {
    const auto path = parse_cpu_path(cpu_path);
    if (!path || !force_cpu_path(*path)) {
      std::fprintf(stderr, "cpu path '%s' unknown or not supported here\n", cpu_path.c_str());
      return 2;
    }
  }

  // One core, as the goals are stated per core.
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(static_cast<unsigned>(sched_getcpu()), &one);
  sched_setaffinity(0, sizeof one, &one);

  std::vector<Sample> samples;
  for (const char* dtype : {"fp32", "fp16", "bf16"}) {
    auto layout = parse_layout_spec(shape + "," + dtype, tokens);
    if (!layout) {
      std::fprintf(stderr, "%s\n", layout.error().to_string().c_str());
      return 2;
    }
    samples.push_back(
        {std::string("synthetic-outliers-") + dtype, layout.value(), synthetic_kv(layout.value(), 42).value()});
  }
  if (!kv_file.empty()) {
    auto layout = parse_layout_spec(kv_layout, kv_tokens);
    auto kv = read_binary_file(kv_file, std::uint64_t{16} << 30);
    if (!layout || !kv || kv.value().size() != layout.value().total_bytes().value()) {
      std::fprintf(stderr, "bad --kv sample\n");
      return 2;
    }
    const std::string name = kv_name.empty() ? kv_file : kv_name;
    for (const auto& dtype_text : kv_convert) {
      const auto dtype = parse_layout_spec("1,1,1," + dtype_text, 1);
      if (!dtype || layout.value().dtype != DType::kFloat32) {
        std::fprintf(stderr, "--kv-convert needs an fp32 --kv and fp16 or bf16, got '%s'\n", dtype_text.c_str());
        return 2;
      }
      std::vector<float> values(kv.value().size() / 4);
      std::memcpy(values.data(), kv.value().data(), kv.value().size());
      KvLayout converted = layout.value();
      converted.dtype = dtype.value().dtype;
      samples.push_back({name + "-" + dtype_text, converted, convert_from_f32(values, converted.dtype)});
    }
    samples.push_back({name + (kv_convert.empty() ? "" : "-fp32"), layout.value(), std::move(kv.value())});
  }

  const auto registry = CodecRegistry::with_builtins();
  nlohmann::json out;
  out["machine"] = {
      {"cpu", cpu_model()},
      {"cores_used", 1},
      {"online_cpus", sysconf(_SC_NPROCESSORS_ONLN)},
      {"cpu_path", cpu_path_name(active_cpu_path())},
      {"timing",
       "best of --repeats; *_gbps and *_vs_memcpy in thread CPU time, *_wall_gbps in wall time; "
       "*_vs_memcpy_paired: quartiles over --pairs runs, each against a memcpy of the sample just before it"},
      {"loadavg_at_start", load_average()}};
  out["samples"] = nlohmann::json::array();
  out["codecs"] = nlohmann::json::array();
  double memcpy_best = 0;
  for (const auto& sample : samples) {
    const std::size_t bytes = sample.kv.size();
    std::vector<std::uint8_t> copy(bytes);
    std::memcpy(copy.data(), sample.kv.data(), bytes);  // fault the pages in before timing
    const Timing copy_time = best_seconds(repeats + 2, [&] { std::memcpy(copy.data(), sample.kv.data(), bytes); });
    const double memcpy_gbps = gbps(bytes, copy_time.cpu);
    // Small samples copy within the caches: the headline memcpy figure is that of the large ones.
    if (bytes >= kDramSampleBytes) memcpy_best = std::max(memcpy_best, memcpy_gbps);
    out["samples"].push_back({{"name", sample.name},
                              {"layout", sample.layout.describe()},
                              {"bytes", bytes},
                              {"memcpy_gbps", memcpy_gbps},
                              {"memcpy_wall_gbps", gbps(bytes, copy_time.wall)}});
    const auto queries = sample_queries(sample.layout, sample.kv, 4, sample.layout.kv_heads, 7).value();
    std::size_t start = 0;
    while (start <= codecs.size()) {
      const std::size_t comma = std::min(codecs.find(',', start), codecs.size());
      const std::string name = codecs.substr(start, comma - start);
      start = comma + 1;
      auto spec = resolve_codec(registry, name);
      if (!spec) {
        std::fprintf(stderr, "%s\n", spec.error().to_string().c_str());
        return 2;
      }
      EncodeOptions options;
      options.zstd_stage = spec.value().zstd_stage;
      // Buffers are reused across repetitions, as the daemon reuses its arenas.
      std::vector<std::uint8_t> frame(max_frame_size(*spec.value().codec, sample.layout, options).value());
      // One untimed call of each first: the frame's pages are faulted in (this VM pays ~4 ms per
      // MiB on first touch) and the codec's thread-local buffers exist, so even --repeats 1
      // times the codec, not the kernel's page faults.
      const auto encode_once = [&] {
        return encode_frame_into(*spec.value().codec, sample.layout, sample.kv, options, frame).value();
      };
      std::size_t frame_size = encode_once();
      const Timing encode_s = best_seconds(repeats, [&] { frame_size = encode_once(); });
      const auto encode_paired = paired_vs_memcpy(pairs, copy, sample.kv, [&] { frame_size = encode_once(); });
      frame.resize(frame_size);
      const auto decode_once = [&] {
        if (!decode_frame(registry, frame, copy)) std::abort();
      };
      decode_once();
      const Timing decode_s = best_seconds(repeats, decode_once);
      // The decode's output and its memcpy partner's destination are one buffer, as in the bests.
      const auto decode_paired = paired_vs_memcpy(pairs, copy, sample.kv, decode_once);
      const auto quality = evaluate(registry, spec.value(), sample.layout, sample.kv, queries).value();
      out["codecs"].push_back({{"name", name},
                               {"sample", sample.name},
                               {"dtype", dtype_name(sample.layout.dtype)},
                               {"tokens", sample.layout.tokens},
                               {"encode_gbps", gbps(bytes, encode_s.cpu)},
                               {"decode_gbps", gbps(bytes, decode_s.cpu)},
                               {"encode_vs_memcpy", gbps(bytes, encode_s.cpu) / memcpy_gbps},
                               {"decode_vs_memcpy", gbps(bytes, decode_s.cpu) / memcpy_gbps},
                               {"encode_vs_memcpy_paired", spread(encode_paired)},
                               {"decode_vs_memcpy_paired", spread(decode_paired)},
                               {"encode_wall_gbps", gbps(bytes, encode_s.wall)},
                               {"decode_wall_gbps", gbps(bytes, decode_s.wall)},
                               {"ratio", static_cast<double>(bytes) / static_cast<double>(frame.size())},
                               {"rel_l2_k", quality.keys.rel_l2},
                               {"rel_l2_v", quality.values.rel_l2},
                               {"attn_rel_err", quality.attn_rel_err}});
    }
  }
  out["memcpy_gbps"] = memcpy_best;
  out["machine"]["loadavg_at_end"] = load_average();
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
