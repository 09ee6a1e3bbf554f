"""Stand-in of vLLM v0.11.2's connector-facing interfaces (see tests/vllm/standin/README.md)."""

__version__ = "0.11.2+kvrelay.standin"
