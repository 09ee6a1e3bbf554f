/* C ABI of the kvrelay worker client (libkvrelay_client.so), for engines that cannot link C++
 * and for Python via ctypes. Handles are opaque; every call returns KVRELAY_OK (0) or one of
 * the error codes below (the same numbers as kvrelay::ErrorCode, checked at compile time in
 * c_api.cpp), and kvrelay_last_error() gives the message of the client's last failure. A handle
 * is used by one thread at a time. The library starts no thread in the caller's process unless
 * kvrelay_client_options asks for one.
 *
 * Compatibility: functions, codes and struct fields are only ever added; each addition names the
 * KVRELAY_CLIENT_ABI_VERSION that brought it. A struct that starts with struct_size is extended at
 * its end, and calls accept the sizes of every version that had it. */
#ifndef KVRELAY_SHM_TRANSPORT_KVRELAY_CLIENT_H_
#define KVRELAY_SHM_TRANSPORT_KVRELAY_CLIENT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVRELAY_CLIENT_ABI_VERSION 6

enum {
  KVRELAY_OK = 0,
  KVRELAY_E_INVALID_ARGUMENT = 1,
  KVRELAY_E_OVERFLOW = 2,
  KVRELAY_E_OUT_OF_RANGE = 3,
  KVRELAY_E_TRUNCATED = 4,
  KVRELAY_E_BAD_MAGIC = 5,
  KVRELAY_E_BAD_VERSION = 6,
  KVRELAY_E_UNKNOWN_CODEC = 7,
  KVRELAY_E_LAYOUT_MISMATCH = 8,
  KVRELAY_E_CHECKSUM_MISMATCH = 9,
  KVRELAY_E_CORRUPT = 10,
  KVRELAY_E_NOT_FOUND = 11,
  KVRELAY_E_ALREADY_EXISTS = 12,
  KVRELAY_E_PERMISSION_DENIED = 13,
  KVRELAY_E_RESOURCE_EXHAUSTED = 14,
  KVRELAY_E_TIMEOUT = 15,
  KVRELAY_E_IO = 16,
  KVRELAY_E_PROTOCOL = 17,
  KVRELAY_E_UNSUPPORTED = 18,
  KVRELAY_E_CANCELLED = 19,
  KVRELAY_E_INTERNAL = 20,
  KVRELAY_E_CHAIN_MISMATCH = 21
};

typedef struct kvrelay_client kvrelay_client;
typedef struct kvrelay_region kvrelay_region;
typedef struct kvrelay_entry kvrelay_entry;

typedef struct kvrelay_key {
  uint64_t model_id;     /* ModelFingerprint::id() */
  uint64_t context_hash; /* e.g. the last block hash of the context */
} kvrelay_key;

/* kvrelay_layout.dtype and kvrelay_model.dtype: the element type of the KV. The fp8 values (ABI
 * version 6) are an engine's 1-byte fp8 kv_cache_dtype, moved as tagged bytes: stored, served and
 * sent between sidecars raw or through a lossless codec, never converted (a lossy medium is never
 * chosen for them). A library or sidecar built before ABI 6 refuses them (KVRELAY_E_INVALID_ARGUMENT). */
enum {
  KVRELAY_DTYPE_FP32 = 1,     /* 4 bytes */
  KVRELAY_DTYPE_FP16 = 2,     /* 2 bytes */
  KVRELAY_DTYPE_BF16 = 3,     /* 2 bytes */
  KVRELAY_DTYPE_FP8_E4M3 = 4, /* 1 byte (ABI 6): torch.float8_e4m3fn, vLLM "fp8" / "fp8_e4m3" */
  KVRELAY_DTYPE_FP8_E5M2 = 5  /* 1 byte (ABI 6): torch.float8_e5m2, vLLM "fp8_e5m2" */
};
/* layers == 0 publishes opaque bytes; otherwise size must equal
 * layers * 2 * tokens * kv_heads * head_dim * dtype size (4, 2, 2, 1, 1). dtype: KVRELAY_DTYPE_*. */
typedef struct kvrelay_layout {
  uint32_t layers;
  uint32_t kv_heads;
  uint32_t head_dim;
  uint32_t dtype;
  uint64_t tokens;
} kvrelay_layout;

int kvrelay_abi_version(void);

/* kvrelay_client_connect_with_options with every option at its default. */
int kvrelay_client_connect(const char* socket_path, kvrelay_client** out);

/* kvrelay_client_options.memory_strategy (ABI version 3), the sidecar's limits.memory_strategy. */
enum {
  KVRELAY_MEMORY_PORTABLE = 0, /* plain memory; the library starts no thread (the default) */
  KVRELAY_MEMORY_PREFAULT = 1  /* one background thread per mapped arena touches each of its pages once,
                                  for hosts that build page tables lazily */
};
/* Zero-initialise, set struct_size, then the fields to change (ABI version 3). */
typedef struct kvrelay_client_options {
  uint32_t struct_size;     /* sizeof(kvrelay_client_options), or KVRELAY_CLIENT_OPTIONS_SIZE_V3 */
  uint32_t memory_strategy; /* KVRELAY_MEMORY_PORTABLE or KVRELAY_MEMORY_PREFAULT */
  /* ABI 6: how long the client waits for any one reply of the sidecar, in milliseconds, the
   * connect handshake's included (0: the default, 60 s). A sidecar that stops answering (stopped,
   * not dead) then costs a call this long: it returns KVRELAY_E_TIMEOUT and the client is closed
   * for further calls (every later call fails with KVRELAY_E_IO; reconnect), as after a resolve
   * timeout. kvrelay_resolve_request.timeout_ms and kvrelay_claim's timeout_ms, when not 0,
   * replace it for their call. */
  uint32_t reply_timeout_ms;
} kvrelay_client_options;
/* struct_size of the version-3 struct (struct_size and memory_strategy only), still accepted. */
#define KVRELAY_CLIENT_OPTIONS_SIZE_V3 8u
/* options NULL: the defaults. KVRELAY_E_INVALID_ARGUMENT for an unknown struct_size or value.
 * KVRELAY_E_TIMEOUT: the sidecar did not answer the handshake within reply_timeout_ms. */
int kvrelay_client_connect_with_options(const char* socket_path, const kvrelay_client_options* options,
                                        kvrelay_client** out);
void kvrelay_client_close(kvrelay_client* client);
/* Message of the last failed call on this client (valid until the next call), or "". */
const char* kvrelay_last_error(const kvrelay_client* client);

/* Two-phase publish: write into kvrelay_region_data(), then commit (or abort). Both consume
 * the region handle whatever they return. */
int kvrelay_region_alloc(kvrelay_client* client, uint64_t size, kvrelay_region** out);
void* kvrelay_region_data(kvrelay_region* region);
uint64_t kvrelay_region_size(const kvrelay_region* region);
int kvrelay_region_commit(kvrelay_client* client, kvrelay_region* region, const kvrelay_key* key,
                          const kvrelay_layout* layout);
int kvrelay_region_abort(kvrelay_client* client, kvrelay_region* region);

/* Copies `size` bytes into a fresh region and commits them. */
int kvrelay_publish(kvrelay_client* client, const kvrelay_key* key, const kvrelay_layout* layout, const void* data,
                    uint64_t size);

/* How faithful published KV is to what its source worker computed (ABI version 2). A worker that
 * imported a lossy prefix (a resolve served with kv_int8, kv_int4, ...) publishes the KV it then
 * computed as lossy from token 0: the sidecar never files it as exact, nor serves it to a request
 * for exact KV. */
#define KVRELAY_FIDELITY_CODEC_BYTES 64
typedef struct kvrelay_fidelity {
  uint32_t struct_size;  /* sizeof(kvrelay_fidelity): calls refuse sizes they do not know */
  uint32_t lossy;        /* 0: every token is exact; 1: tokens from exact_tokens on are lossy */
  uint64_t exact_tokens; /* leading exact tokens when lossy */
  char lossy_codec[KVRELAY_FIDELITY_CODEC_BYTES]; /* NUL-terminated codec spec when lossy ("int4") */
} kvrelay_fidelity;
/* kvrelay_publish with the request's kv_transfer_params.kvrelay JSON (NULL or "" when none, so the
 * sidecar can push the KV ahead on its route) and the KV's fidelity (NULL: exact).
 * KVRELAY_E_UNSUPPORTED: lossy KV and a sidecar too old to record it; nothing is published. */
int kvrelay_publish_context(kvrelay_client* client, const kvrelay_key* key, const kvrelay_layout* layout,
                            const void* data, uint64_t size, const char* params_json, const kvrelay_fidelity* fidelity);
/* The token ids a published entry's key is the block-hash chain of (ABI version 4): whole blocks of
 * block_tokens ids, hashed from root (KVRELAY_ROOT_BLOCK_HASH, or the request's
 * kv_transfer_params.kvrelay.chain_root), whose last block hash is the key's context_hash. The
 * sidecar checks the key against them, and only KV published with them is ever sent to a peer. */
#define KVRELAY_ROOT_BLOCK_HASH 0x6b7672656c6179ULL
typedef struct kvrelay_chain {
  uint32_t struct_size;   /* sizeof(kvrelay_chain): calls refuse sizes they do not know */
  uint32_t block_tokens;  /* tokens per block (the worker's block size) */
  uint64_t root;          /* hash(-1) of the chain */
  const uint32_t* tokens; /* count token ids, read during the call only */
  uint64_t count;         /* == layout->tokens, a whole number of blocks */
} kvrelay_chain;
/* kvrelay_publish_context with the entry's chain (NULL: none, as kvrelay_publish_context).
 * KVRELAY_E_CHAIN_MISMATCH: the ids do not hash to the key, or their count is not the layout's
 * tokens; nothing is published. A sidecar older than data-plane version 5 gets the KV without
 * the ids (it keeps such KV on its node). */
int kvrelay_publish_chain(kvrelay_client* client, const kvrelay_key* key, const kvrelay_layout* layout,
                          const void* data, uint64_t size, const char* params_json, const kvrelay_fidelity* fidelity,
                          const kvrelay_chain* chain);
/* KVRELAY_E_NOT_FOUND on a miss. The entry stays valid, and its bytes unchanged, until released:
   a memfd sealed against writes mapped read-only, or a block of the sidecar's arena held under a
   lease (never write through kvrelay_entry_data). */
int kvrelay_lookup(kvrelay_client* client, const kvrelay_key* key, kvrelay_entry** out);
const void* kvrelay_entry_data(const kvrelay_entry* entry);
uint64_t kvrelay_entry_size(const kvrelay_entry* entry);
void kvrelay_entry_layout(const kvrelay_entry* entry, kvrelay_layout* out);
void kvrelay_entry_release(kvrelay_entry* entry);
/* Gives the sidecar back the arena blocks of released entries now (otherwise that happens with
   the client's next request, or when it closes). */
int kvrelay_release_leases(kvrelay_client* client);

/* ABI 5: a model's fingerprint id, as the sidecar's policy computes it for agents[].model. */
typedef struct kvrelay_model {
  uint32_t struct_size; /* sizeof(kvrelay_model) */
  uint32_t layers;
  uint32_t kv_heads; /* the whole model's KV heads */
  uint32_t head_dim;
  uint32_t dtype;           /* KVRELAY_DTYPE_*, as kvrelay_layout.dtype */
  uint32_t tp_rank;         /* this process's tensor-parallel rank */
  uint32_t tp_size;         /* 0 or 1: not sharded */
  uint32_t reserved;        /* 0 */
  const char* architecture; /* "llama" */
  const char* weights;      /* agents[].model.weights */
} kvrelay_model;
/* tp_size <= 1: ModelFingerprint{architecture, layers, kv_heads, head_dim, dtype, weights}.id().
   tp_size > 1: the id of one rank's shard: kv_heads / tp_size heads (1 when tp_size > kv_heads,
   as vLLM replicates heads), weights + "#tp<rank>/<size>". KVRELAY_E_INVALID_ARGUMENT for a rank
   out of range, kv_heads % tp_size != 0 (when tp_size <= kv_heads), a NULL string, a bad dtype. */
int kvrelay_model_id(const kvrelay_model* model, uint64_t* out);
/* *out = the number of KV heads of this rank's shard (same rules). */
int kvrelay_model_shard_heads(const kvrelay_model* model, uint32_t* out);

/* ABI 5: resolve, the sidecar's decision for one request (data-plane version 6 for RESERVE). */
#define KVRELAY_RESOLVE_RESERVE 1u
typedef struct kvrelay_resolve_request {
  uint32_t struct_size;  /* sizeof(kvrelay_resolve_request) */
  uint32_t block_tokens; /* kvrelay block size, tokens */
  uint64_t model_id;
  uint64_t root;          /* chain root: KVRELAY_ROOT_BLOCK_HASH or kv_transfer_params.kvrelay.chain_root */
  const uint32_t* tokens; /* the whole prompt's token ids (read during the call only) */
  uint64_t count;
  const char* params_json; /* kv_transfer_params.kvrelay as JSON text; NULL or "" */
  uint32_t flags;          /* KVRELAY_RESOLVE_RESERVE: keep the answer in the sidecar, map nothing */
  uint32_t timeout_ms;     /* reply deadline for this call; 0: the client's default */
} kvrelay_resolve_request;
#define KVRELAY_MEDIUM_BYTES 32
typedef struct kvrelay_resolved {
  uint32_t struct_size; /* sizeof(kvrelay_resolved), set by the caller */
  uint32_t reserved;
  uint64_t tokens;                   /* leading prompt tokens covered (whole blocks) */
  uint64_t reservation;              /* the reservation id (RESERVE), else 0 */
  char medium[KVRELAY_MEDIUM_BYTES]; /* NUL-terminated: "kv_raw", "kv_int8", ... */
  kvrelay_fidelity fidelity;         /* of those tokens (fidelity.struct_size set by the library) */
} kvrelay_resolved;
/* The library hashes the prompt's whole blocks from root (core/block_hash.h hash_blocks) and asks
   the sidecar. Without RESERVE, *entry gets the mapped entry (as kvrelay_lookup); with it, entry
   may be NULL and nothing is mapped. KVRELAY_E_NOT_FOUND on a miss (kvrelay_last_error says why).
   KVRELAY_E_TIMEOUT when timeout_ms passed: the client is then closed for further calls (every
   later call fails with KVRELAY_E_IO; reconnect). */
int kvrelay_resolve(kvrelay_client* client, const kvrelay_resolve_request* request, kvrelay_resolved* out,
                    kvrelay_entry** entry);
/* The entry a reservation holds (any client of the same sidecar; once). NOT_FOUND: expired or unknown.
 *out (may be NULL) gets the meta. timeout_ms as in kvrelay_resolve_request. */
int kvrelay_claim(kvrelay_client* client, uint64_t reservation, uint32_t timeout_ms, kvrelay_resolved* out,
                  kvrelay_entry** entry);
/* Drops a reservation that will not be claimed (a finished or preempted request); an unknown id
   is KVRELAY_OK. */
int kvrelay_release_reservation(kvrelay_client* client, uint64_t reservation);

/* ABI 5: the context of a publish; the library derives the key and the chain from the ids. */
typedef struct kvrelay_publish_request {
  uint32_t struct_size; /* sizeof(kvrelay_publish_request) */
  uint32_t block_tokens;
  uint64_t model_id;
  uint64_t root;
  const uint32_t* tokens; /* the ids of the KV's tokens: layout->tokens of them, whole blocks */
  uint64_t count;
  uint64_t prompt_tokens;           /* the request's prompt length: count <= prompt_tokens (a prompt's KV) */
  const char* params_json;          /* NULL or "" */
  const kvrelay_fidelity* fidelity; /* provenance of an imported prefix; NULL: exact */
} kvrelay_publish_request;
/* Commits a region written in place (kvrelay_region_alloc + kvrelay_region_data) under the last
   block's hash, with the chain of ids (as kvrelay_publish_chain). Consumes the region.
   KVRELAY_E_INVALID_ARGUMENT: count 0, not whole blocks, not layout->tokens, or over prompt_tokens. */
int kvrelay_region_commit_request(kvrelay_client* client, kvrelay_region* region,
                                  const kvrelay_publish_request* request, const kvrelay_layout* layout);

/* ABI 5: one prefill the engine ran, for the sidecar's cost model (PrefillReport). */
typedef struct kvrelay_prefill_report {
  uint32_t struct_size; /* sizeof(kvrelay_prefill_report) */
  uint32_t reserved;    /* 0 */
  uint64_t model_id;
  uint64_t computed_tokens; /* tokens this prefill computed (<= context_tokens) */
  uint64_t context_tokens;  /* the prompt's length */
  double seconds;           /* wall time of the prefill */
  const char* params_json;  /* NULL or "" */
} kvrelay_prefill_report;
int kvrelay_report_prefill(kvrelay_client* client, const kvrelay_prefill_report* report);

/* Small message round trip over the shared-memory ring; *answer_size gets the answer length. */
int kvrelay_small_call(kvrelay_client* client, const void* message, size_t size, void* answer, size_t capacity,
                       size_t* answer_size);

#ifdef __cplusplus
}
#endif

#endif /* KVRELAY_SHM_TRANSPORT_KVRELAY_CLIENT_H_ */
