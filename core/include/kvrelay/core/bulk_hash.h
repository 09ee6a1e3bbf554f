#pragma once

// XXH3 for bulk data (frames, chunks, KV payloads). The packaged libxxhash's XXH3_64bits is its
// portable SSE2 build; where the library exports its CPU-dispatching entry (AVX2 / AVX-512, same
// hash values, ~2.3x faster), xxh_x86dispatch.h turns every XXH3_64bits call below into it.
// KVRELAY_HAVE_XXH3_DISPATCH comes with kvrelay::dep::xxhash (cmake/KvrelayDependencies.cmake).

#include <xxhash.h>
#if defined(KVRELAY_HAVE_XXH3_DISPATCH)
#include <xxh_x86dispatch.h>
#endif
