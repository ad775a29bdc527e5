"""kvpilot: an agent-aware LLM serving engine built around its KV-cache manager."""

__version__ = "0.1.0"
