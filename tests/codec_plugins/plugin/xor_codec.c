/* An out-of-tree codec built against codec_abi.h alone: XORs every byte with a key from its
 * params. The PLUGIN_* macros build deliberately broken variants for the loader's refusal tests. */
#include <string.h>

#include "kvrelay/codec_plugins/codec_abi.h"

#ifndef PLUGIN_NAME
#define PLUGIN_NAME "xor"
#endif
#ifndef PLUGIN_ID
#define PLUGIN_ID 300u
#endif
#ifndef PLUGIN_ABI_VERSION
#define PLUGIN_ABI_VERSION KVRELAY_CODEC_ABI_VERSION
#endif
#ifndef PLUGIN_STRUCT_SIZE
#define PLUGIN_STRUCT_SIZE sizeof(kvrelay_codec_plugin)
#endif

static const unsigned char default_key = 0x5A;

static uint64_t layout_bytes(const kvrelay_codec_layout* layout) {
  uint64_t size;
  if (layout->dtype < 1 || layout->dtype > 3) return 0;
  size = layout->dtype == 1 ? 4 : 2;
  /* Small test layouts only: refuse anything whose product could overflow. */
  if (layout->layers > 1024 || layout->kv_heads > 1024 || layout->head_dim > 4096 || layout->tokens > (1u << 20)) {
    return 0;
  }
  return size * 2u * layout->layers * layout->kv_heads * layout->head_dim * layout->tokens;
}

static uint64_t xor_max_encoded_size(const kvrelay_codec_layout* layout, const void* params, size_t params_size) {
  if (params_size != 1 || params == NULL) return 0;
  return layout_bytes(layout);
}

static void apply(const void* input, void* output, size_t size, unsigned char key) {
  const unsigned char* in = (const unsigned char*)input;
  unsigned char* out = (unsigned char*)output;
  size_t i;
  for (i = 0; i < size; ++i) out[i] = (unsigned char)(in[i] ^ key);
}

static int xor_encode(const kvrelay_codec_layout* layout, const void* params, size_t params_size, const void* input,
                      size_t input_size, void* output, size_t output_capacity, size_t* output_size) {
  const uint64_t size = xor_max_encoded_size(layout, params, params_size);
  if (size != input_size || output_capacity < size) return KVRELAY_CODEC_E_INVALID_ARGUMENT;
  apply(input, output, input_size, *(const unsigned char*)params);
  *output_size = input_size;
  return KVRELAY_CODEC_OK;
}

static int xor_decode(const kvrelay_codec_layout* layout, const void* params, size_t params_size, const void* input,
                      size_t input_size, void* output, size_t output_size) {
  const uint64_t size = xor_max_encoded_size(layout, params, params_size);
  if (size != output_size) return KVRELAY_CODEC_E_INVALID_ARGUMENT;
  if (input_size != size) return KVRELAY_CODEC_E_LAYOUT_MISMATCH;
  apply(input, output, input_size, *(const unsigned char*)params);
  return KVRELAY_CODEC_OK;
}

static const char* xor_error_text(int code) { return code == 0 ? "ok" : "xor codec error"; }

static const kvrelay_codec_plugin plugin = {
    PLUGIN_ABI_VERSION, (uint32_t)PLUGIN_STRUCT_SIZE, PLUGIN_NAME, PLUGIN_ID,
    KVRELAY_CODEC_FLAG_LOSSLESS | KVRELAY_CODEC_FLAG_HOST_MEMORY, &default_key, 1,
    xor_max_encoded_size, xor_encode, xor_decode, xor_error_text};

#ifndef PLUGIN_NO_ENTRY
__attribute__((visibility("default"))) const kvrelay_codec_plugin* kvrelay_codec_plugin_entry(void) {
  return &plugin;
}
#else
__attribute__((visibility("default"))) const kvrelay_codec_plugin* some_other_symbol(void) { return &plugin; }
#endif
