"""kvrelay's vLLM V1 KV connector.

Load it with
  --kv-transfer-config '{"kv_connector":"KvRelayConnector","kv_connector_module_path":"kvrelay_vllm",
                         "kv_role":"kv_both","kv_connector_extra_config":{"socket":"/run/kvrelay/kvrelay.sock"}}'
(docs/vllm.md). Written against vLLM's v1 connector interface of PINNED_VLLM_VERSION.
"""

PINNED_VLLM_VERSION = "0.11.2"

from .connector import KvRelayConnector  # noqa: E402

__all__ = ["KvRelayConnector", "PINNED_VLLM_VERSION"]
