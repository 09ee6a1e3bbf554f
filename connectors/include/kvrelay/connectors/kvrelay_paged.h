/* C ABI of paged KV copy (exported by libkvrelay_client.so): gathers one sequence's KV out of an
 * engine's per-layer paged cache tensor (vLLM's) into kvrelay's region layout, per layer K then V,
 * each [tokens, kv_heads, head_dim] contiguous, and scatters it back. Single-threaded; starts no
 * thread. Calls return KVRELAY_OK (0) or a KVRELAY_E_* code of kvrelay_client.h (the numbers of
 * kvrelay::ErrorCode); kvrelay_paged_last_error() gives the message.
 *
 * Compatibility: functions and layouts are only added, each naming the KVRELAY_PAGED_ABI_VERSION
 * that brought it; kvrelay_paged_tensor grows at its end (struct_size). */
#ifndef KVRELAY_CONNECTORS_KVRELAY_PAGED_H_
#define KVRELAY_CONNECTORS_KVRELAY_PAGED_H_

#include <stdint.h>

#include "kvrelay/shm_transport/kvrelay_client.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVRELAY_PAGED_ABI_VERSION 1

/* kvrelay_paged_tensor.layout: the order of the tensor's five dimensions. */
enum {
  KVRELAY_PAGED_FLASH_ATTN = 1, /* (2, num_blocks, block_size, kv_heads, head_dim) */
  KVRELAY_PAGED_FLASHINFER = 2, /* (num_blocks, 2, block_size, kv_heads, head_dim) */
  KVRELAY_PAGED_CPU = 3         /* (2, num_blocks, kv_heads, block_size, head_dim) */
};

typedef struct kvrelay_paged_tensor {
  uint32_t struct_size; /* sizeof(kvrelay_paged_tensor) */
  uint32_t layout;      /* KVRELAY_PAGED_* */
  uint32_t elem_size;   /* bytes per element: 4 fp32, 2 fp16/bf16, 1 fp8 (moved as tagged bytes, never converted) */
  uint32_t reserved;    /* 0 */
  void* data;           /* the layer's cache tensor (host memory) */
  int64_t shape[5];     /* as the layout names them */
  int64_t strides[5];   /* in elements, as tensor.stride() gives them; never assumed */
} kvrelay_paged_tensor;

/* Copies tokens [first_token, first_token + tokens) of one sequence out of the paged cache into
   k_dst and v_dst, each [tokens, kv_heads, head_dim] contiguous. block_ids[i] is the cache block
   of the sequence's tokens [i*block_size, (i+1)*block_size); the block list must cover
   first_token + tokens. Errors (INVALID_ARGUMENT, OUT_OF_RANGE for a block id >= num_blocks or
   negative or too few block ids, OVERFLOW) are found before any byte moves: dst is untouched. */
int kvrelay_paged_gather(const kvrelay_paged_tensor* cache, const int32_t* block_ids, uint64_t num_block_ids,
                         uint64_t first_token, uint64_t tokens, void* k_dst, void* v_dst);
/* The reverse: k_src/v_src into the cache's blocks; on error the cache is untouched. */
int kvrelay_paged_scatter(const kvrelay_paged_tensor* cache, const int32_t* block_ids, uint64_t num_block_ids,
                          uint64_t first_token, uint64_t tokens, const void* k_src, const void* v_src);
/* Message of the calling thread's last failed paged call (thread-local), or "". */
const char* kvrelay_paged_last_error(void);
int kvrelay_paged_abi_version(void);

#ifdef __cplusplus
}
#endif

#endif /* KVRELAY_CONNECTORS_KVRELAY_PAGED_H_ */
