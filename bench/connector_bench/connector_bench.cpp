// connector_bench: the vLLM connector's export (gather every layer's paged cache into one region
// in KvLayout order) and import (scatter it back), next to a memcpy of the same bytes in the same
// run, interleaved repeat by repeat; one JSON line per paged layout with paired medians.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvrelay/connectors/paged_copy.h"

namespace {

using kvrelay::connectors::PagedLayout;
using kvrelay::connectors::PagedTensorView;

struct Shape {
  std::uint64_t layers = 32;
  std::uint64_t kv_heads = 8;
  std::uint64_t head_dim = 128;
  std::uint64_t elem = 2;  // bf16
  std::uint64_t tokens = 2048;
  std::uint64_t block_size = 16;
  double cache_factor = 1.25;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

template <class Body>
double time_ms(Body&& body) {
  const auto start = std::chrono::steady_clock::now();
  body();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// One layer's cache, contiguous in the layout's dimension order, as vLLM allocates it.
PagedTensorView layer_view(PagedLayout layout, const Shape& shape, std::uint64_t num_blocks, std::byte* data) {
  PagedTensorView view;
  view.layout = layout;
  view.elem_size = static_cast<std::uint32_t>(shape.elem);
  view.data = data;
  const auto blocks = static_cast<std::int64_t>(num_blocks);
  const auto slots = static_cast<std::int64_t>(shape.block_size);
  const auto heads = static_cast<std::int64_t>(shape.kv_heads);
  const auto dims = static_cast<std::int64_t>(shape.head_dim);
  switch (layout) {
    case PagedLayout::kFlashAttn:
      view.shape = {2, blocks, slots, heads, dims};
      break;
    case PagedLayout::kFlashInfer:
      view.shape = {blocks, 2, slots, heads, dims};
      break;
    case PagedLayout::kCpu:
      view.shape = {2, blocks, heads, slots, dims};
      break;
  }
  std::int64_t running = 1;
  for (std::size_t axis = 5; axis-- > 0;) {
    view.strides[axis] = running;
    running *= view.shape[axis];
  }
  return view;
}

const char* layout_name(PagedLayout layout) {
  return layout == PagedLayout::kFlashAttn ? "flash_attn" : layout == PagedLayout::kFlashInfer ? "flashinfer" : "cpu";
}

int run_layout(PagedLayout layout, const Shape& shape, int repeats) {
  const std::uint64_t row = shape.kv_heads * shape.head_dim * shape.elem;
  const std::uint64_t tensor_bytes = shape.tokens * row;
  const std::uint64_t region_bytes = shape.layers * 2 * tensor_bytes;
  const std::uint64_t needed_blocks = (shape.tokens + shape.block_size - 1) / shape.block_size;
  const auto num_blocks = static_cast<std::uint64_t>(static_cast<double>(needed_blocks) * shape.cache_factor);
  const std::uint64_t layer_bytes = 2 * num_blocks * shape.block_size * row;

  // The sequence's blocks in a shuffled order, as a long-running engine's allocator leaves them.
  std::vector<std::int32_t> all_blocks(num_blocks);
  std::iota(all_blocks.begin(), all_blocks.end(), 0);
  std::mt19937 random(26);
  std::shuffle(all_blocks.begin(), all_blocks.end(), random);
  const std::vector<std::int32_t> block_ids(all_blocks.begin(),
                                            all_blocks.begin() + static_cast<std::ptrdiff_t>(needed_blocks));

  // Every buffer is touched before timing, so no run pays for page faults.
  std::vector<std::byte> caches(shape.layers * layer_bytes, std::byte{0x5A});
  std::vector<std::byte> region(region_bytes, std::byte{0x11});
  std::vector<std::byte> source(region_bytes, std::byte{0x22});
  std::vector<PagedTensorView> views;
  for (std::uint64_t layer = 0; layer < shape.layers; ++layer) {
    views.push_back(layer_view(layout, shape, num_blocks, caches.data() + layer * layer_bytes));
  }
  const kvrelay::connectors::PagedSpan span{block_ids, 0, shape.tokens};

  bool failed = false;
  const auto export_all = [&] {
    for (std::uint64_t layer = 0; layer < shape.layers; ++layer) {
      std::byte* k = region.data() + 2 * layer * tensor_bytes;
      failed |= !kvrelay::connectors::gather_paged(views[layer], span, k, k + tensor_bytes);
    }
  };
  const auto import_all = [&] {
    for (std::uint64_t layer = 0; layer < shape.layers; ++layer) {
      const std::byte* k = region.data() + 2 * layer * tensor_bytes;
      failed |= !kvrelay::connectors::scatter_paged(views[layer], span, k, k + tensor_bytes);
    }
  };
  export_all();  // warm-up: one pass of each, then interleaved timed repeats
  import_all();
  std::vector<double> memcpy_ms, export_ms, import_ms, export_ratio, import_ratio;
  for (int repeat = 0; repeat < repeats; ++repeat) {
    memcpy_ms.push_back(time_ms([&] { std::memcpy(region.data(), source.data(), region.size()); }));
    export_ms.push_back(time_ms(export_all));
    import_ms.push_back(time_ms(import_all));
    export_ratio.push_back(memcpy_ms.back() / export_ms.back());
    import_ratio.push_back(memcpy_ms.back() / import_ms.back());
  }
  if (failed) {
    std::fprintf(stderr, "connector_bench: a paged copy failed\n");
    return 1;
  }
  const nlohmann::json out = {{"bench", "connector_bench"},
                              {"layout", layout_name(layout)},
                              {"bytes", region_bytes},
                              {"layers", shape.layers},
                              {"kv_heads", shape.kv_heads},
                              {"head_dim", shape.head_dim},
                              {"elem_size", shape.elem},
                              {"tokens", shape.tokens},
                              {"block_size", shape.block_size},
                              {"cache_blocks", num_blocks},
                              {"repeats", repeats},
                              {"export_ms", median(export_ms)},
                              {"import_ms", median(import_ms)},
                              {"memcpy_ms", median(memcpy_ms)},
                              {"export_vs_memcpy", median(export_ratio)},
                              {"import_vs_memcpy", median(import_ratio)}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"connector_bench: paged KV export/import next to memcpy on one core (JSON lines)"};
  Shape shape;
  int repeats = 7;
  std::vector<std::string> layouts{"flash_attn", "cpu"};
  app.add_option("--layers", shape.layers, "model layers");
  app.add_option("--kv-heads", shape.kv_heads, "KV heads");
  app.add_option("--head-dim", shape.head_dim, "head size");
  app.add_option("--elem-size", shape.elem, "bytes per element (2: bf16)")->check(CLI::IsMember({1, 2, 4}));
  app.add_option("--tokens", shape.tokens, "sequence length")->check(CLI::PositiveNumber);
  app.add_option("--block-size", shape.block_size, "engine block size in tokens")->check(CLI::PositiveNumber);
  app.add_option("--cache-factor", shape.cache_factor, "cache blocks per block the sequence needs (>= 1)")
      ->check(CLI::Range(1.0, 16.0));
  app.add_option("--repeats", repeats, "interleaved timed repeats")->check(CLI::PositiveNumber);
  app.add_option("--layouts", layouts, "flash_attn, flashinfer, cpu")
      ->check(CLI::IsMember({"flash_attn", "flashinfer", "cpu"}));
  CLI11_PARSE(app, argc, argv);
  for (const std::string& name : layouts) {
    const PagedLayout layout = name == "flash_attn"   ? PagedLayout::kFlashAttn
                               : name == "flashinfer" ? PagedLayout::kFlashInfer
                                                      : PagedLayout::kCpu;
    if (const int code = run_layout(layout, shape, repeats); code != 0) return code;
  }
  return 0;
}
