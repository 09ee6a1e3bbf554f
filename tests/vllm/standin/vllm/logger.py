"""vllm.logger: init_logger returns a stdlib logger under the "vllm" hierarchy."""

import logging


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
