"""vllm.distributed.kv_transfer.kv_connector.factory: how vLLM finds and builds a connector.

kv_connector names a registered connector or, with kv_connector_module_path, a class in that
module. v0.11.2 builds a class whose __init__ takes kv_cache_config with three arguments; one
without it is the deprecated two-argument signature: logged, and built with two.
STRICT_SIGNATURE makes the stand-in refuse that signature instead (what later releases do).
"""

import importlib
from typing import TYPE_CHECKING, Callable, Optional, cast

from vllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase, KVConnectorBaseType
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole, supports_hma
from vllm.logger import init_logger
from vllm.utils.func_utils import supports_kw

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)

STRICT_SIGNATURE = False


class KVConnectorFactory:
    _registry: dict[str, Callable[[], type[KVConnectorBase]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")

        def loader() -> type[KVConnectorBase]:
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader

    @classmethod
    def create_connector(cls, config: "VllmConfig", role: KVConnectorRole,
                         kv_cache_config: Optional["KVCacheConfig"] = None) -> KVConnectorBase:
        kv_transfer_config = config.kv_transfer_config
        if kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set to create a connector")
        connector_cls, compat_sig = cls._get_connector_class_with_compat(kv_transfer_config)
        hma_enabled = not config.scheduler_config.disable_hybrid_kv_cache_manager
        if hma_enabled and not supports_hma(connector_cls):
            raise ValueError(f"Connector {connector_cls.__name__} does not support HMA but HMA is enabled. "
                             "Please set `--disable-hybrid-kv-cache-manager`.")
        logger.info("Creating v1 connector with name: %s and engine_id: %s", connector_cls.__name__,
                    kv_transfer_config.engine_id)
        if compat_sig:
            if STRICT_SIGNATURE:
                raise TypeError(f"Connector {connector_cls.__name__} takes (vllm_config, role); "
                                "it must take (vllm_config, role, kv_cache_config)")
            return connector_cls(config, role)
        return connector_cls(config, role, kv_cache_config)

    @classmethod
    def _get_connector_class_with_compat(
            cls, kv_transfer_config: "KVTransferConfig") -> tuple[type[KVConnectorBaseType], bool]:
        connector_name = kv_transfer_config.kv_connector
        if connector_name is None:
            raise ValueError("Connector name is not set in KVTransferConfig")
        compat_sig = False
        if connector_name in cls._registry:
            connector_cls = cls._registry[connector_name]()
        else:
            module_path = kv_transfer_config.kv_connector_module_path
            if module_path is None:
                raise ValueError(f"Unsupported connector type: {connector_name}")
            module = importlib.import_module(module_path)
            try:
                connector_cls = getattr(module, connector_name)
            except AttributeError as error:
                raise AttributeError(f"Class {connector_name} not found in {module_path}") from error
            connector_cls = cast(type[KVConnectorBaseType], connector_cls)
            if not supports_kw(connector_cls, "kv_cache_config"):
                compat_sig = True
                logger.warning("Connector %s uses deprecated signature with 2 required arguments. "
                               "Please update to include kv_cache_config as the second argument.",
                               connector_cls.__name__)
        return connector_cls, compat_sig

    @classmethod
    def get_connector_class(cls, kv_transfer_config: "KVTransferConfig") -> type[KVConnectorBaseType]:
        connector_cls, _ = cls._get_connector_class_with_compat(kv_transfer_config)
        return connector_cls
