/* kvrelay codec plugin ABI, version 1.
 *
 * Plain C on purpose: a plugin is a shared object built by anyone, with any compiler, against
 * this header alone. It exports one symbol, KVRELAY_CODEC_ENTRY_SYMBOL, returning a pointer to a
 * static kvrelay_codec_plugin that stays valid until the object is unloaded. The built-in codecs
 * are described by the very same struct, registered statically.
 *
 * Rules for implementers:
 *  - Functions must not throw, longjmp or abort; every failure is a non-zero return code.
 *  - decode must validate the payload completely and write nothing it cannot vouch for; the
 *    caller discards the output on any non-zero return.
 *  - Tensors are little-endian, per layer K then V, each [tokens, kv_heads, head_dim].
 *  - Appending fields at the end of kvrelay_codec_plugin is compatible (struct_size grows);
 *    anything else bumps KVRELAY_CODEC_ABI_VERSION.
 */
#ifndef KVRELAY_CODEC_PLUGINS_CODEC_ABI_H_
#define KVRELAY_CODEC_PLUGINS_CODEC_ABI_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVRELAY_CODEC_ABI_VERSION 1u
#define KVRELAY_CODEC_ENTRY_SYMBOL "kvrelay_codec_plugin_entry"

/* Flags. */
#define KVRELAY_CODEC_FLAG_LOSSLESS 0x1u        /* decode(encode(x)) == x bit for bit */
#define KVRELAY_CODEC_FLAG_HOST_MEMORY 0x2u     /* buffers may be host memory */
#define KVRELAY_CODEC_FLAG_CUDA_DEVICE 0x4u     /* buffers may be CUDA device memory */
#define KVRELAY_CODEC_FLAG_POSITION_SPARSE 0x8u /* drops positions; receiver must opt in */

/* Element types: same values as the frame format's dtype byte. */
#define KVRELAY_CODEC_DTYPE_F32 1u
#define KVRELAY_CODEC_DTYPE_F16 2u
#define KVRELAY_CODEC_DTYPE_BF16 3u
/* 1-byte fp8 KV (an engine's fp8 kv_cache_dtype), moved as bytes: kvrelay hands these only to
 * lossless codecs (KVRELAY_CODEC_FLAG_LOSSLESS); a lossy codec is refused before it is called.
 * A codec must refuse every dtype it does not know (KVRELAY_CODEC_E_INVALID_ARGUMENT). */
#define KVRELAY_CODEC_DTYPE_FP8_E4M3 4u
#define KVRELAY_CODEC_DTYPE_FP8_E5M2 5u

/* Return codes: 0 is success; the rest are kvrelay's ErrorCode values. */
#define KVRELAY_CODEC_OK 0
#define KVRELAY_CODEC_E_INVALID_ARGUMENT 1
#define KVRELAY_CODEC_E_OVERFLOW 2
#define KVRELAY_CODEC_E_TRUNCATED 4
#define KVRELAY_CODEC_E_LAYOUT_MISMATCH 8
#define KVRELAY_CODEC_E_CORRUPT 10
#define KVRELAY_CODEC_E_RESOURCE_EXHAUSTED 14
#define KVRELAY_CODEC_E_UNSUPPORTED 18
#define KVRELAY_CODEC_E_INTERNAL 20

/* Codec ids 1..255 are reserved for built-ins; plugins pick ids >= 256. */
#define KVRELAY_CODEC_FIRST_PLUGIN_ID 256u

typedef struct kvrelay_codec_layout {
  uint32_t layers;
  uint32_t kv_heads;
  uint32_t head_dim;
  uint32_t dtype; /* KVRELAY_CODEC_DTYPE_* */
  uint64_t tokens;
} kvrelay_codec_layout;

typedef struct kvrelay_codec_plugin {
  uint32_t abi_version; /* KVRELAY_CODEC_ABI_VERSION */
  uint32_t struct_size; /* sizeof(kvrelay_codec_plugin) as the plugin was compiled */
  const char* name;     /* unique, [a-z0-9_-], at most 31 characters */
  uint32_t codec_id;    /* carried in every frame; unique */
  uint32_t flags;       /* KVRELAY_CODEC_FLAG_* */

  /* Parameters used when the caller supplies none; opaque to kvrelay, stored in every frame
   * and handed back to decode unchanged. May be NULL with size 0. */
  const void* default_params;
  uint32_t default_params_size;

  /* Upper bound of encode's output for this layout; 0 when the layout or params are invalid. */
  uint64_t (*max_encoded_size)(const kvrelay_codec_layout* layout, const void* params, size_t params_size);

  /* Encodes `input` (exactly the layout's size) into `output`; stores the size written. */
  int (*encode)(const kvrelay_codec_layout* layout, const void* params, size_t params_size, const void* input,
                size_t input_size, void* output, size_t output_capacity, size_t* output_size);

  /* Decodes `input` into `output` (exactly the layout's size). */
  int (*decode)(const kvrelay_codec_layout* layout, const void* params, size_t params_size, const void* input,
                size_t input_size, void* output, size_t output_size);

  /* Static text for a return code; never NULL. */
  const char* (*error_text)(int code);
} kvrelay_codec_plugin;

typedef const kvrelay_codec_plugin* (*kvrelay_codec_entry_fn)(void);

/* The one symbol a plugin exports (declared here so plugins get the exact signature). */
const kvrelay_codec_plugin* kvrelay_codec_plugin_entry(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVRELAY_CODEC_PLUGINS_CODEC_ABI_H_ */
