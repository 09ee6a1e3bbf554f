#pragma once

#include <string>

namespace kvrelay::decision::testing {

// A policy seen from node-a: planner and coder here, reviewer on a remote node, helper on a
// same-host peer, summarizer on a different model.
inline std::string two_node_policy() {
  return R"({
    "schema_version": 1,
    "node": {"id": "node-a"},
    "listen": {"http": "127.0.0.1:0"},
    "peers": [{"id": "node-b", "address": "127.0.0.1:7071"},
              {"id": "node-c", "address": "127.0.0.1:7072", "same_host": true}],
    "agents": [
      {"id": "planner", "upstream": "http://127.0.0.1:9000", "role_priority": 5,
       "model": {"architecture": "llama", "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "fp16", "weights": "w8b"}},
      {"id": "coder", "upstream": "http://127.0.0.1:9001",
       "model": {"architecture": "llama", "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "fp16", "weights": "w8b"}},
      {"id": "reviewer", "upstream": "http://127.0.0.1:9002", "node": "node-b",
       "model": {"architecture": "llama", "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "fp16", "weights": "w8b"}},
      {"id": "helper", "upstream": "http://127.0.0.1:9003", "node": "node-c",
       "model": {"architecture": "llama", "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "fp16", "weights": "w8b"}},
      {"id": "summarizer", "upstream": "http://127.0.0.1:9004",
       "model": {"architecture": "llama", "layers": 16, "kv_heads": 8, "head_dim": 64, "dtype": "fp16", "weights": "w1b"}}
    ],
    "routes": [
      {"id": "plan-code", "from": "planner", "to": "coder"},
      {"id": "plan-review", "from": "planner", "to": "reviewer", "allowed_media": ["tokens", "kv_raw", "kv_int8"]},
      {"id": "plan-help", "from": "planner", "to": "helper"},
      {"id": "plan-sum", "from": "planner", "to": "summarizer"}
    ]
  })";
}

}  // namespace kvrelay::decision::testing
