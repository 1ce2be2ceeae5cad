"""sglang-shadowkv: long-context serving with a ShadowKV compressed KV cache."""

from sglang_shadowkv.engine import Engine
from sglang_shadowkv.server_args import ServerArgs

__all__ = ["Engine", "ServerArgs"]
