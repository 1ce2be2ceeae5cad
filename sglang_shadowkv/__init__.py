"""sglang-shadowkv: long-context serving with a ShadowKV compressed KV cache.

`Engine` and `ServerArgs` are imported on first use: the server's processes import parts of this
package that do not need torch (the HTTP side, the detokenizer), and every spawned process pays
for what this file imports.
"""

__all__ = ["Engine", "ServerArgs"]


def __getattr__(name: str):
    if name == "Engine":
        from sglang_shadowkv.engine import Engine
        return Engine
    if name == "ServerArgs":
        from sglang_shadowkv.server_args import ServerArgs
        return ServerArgs
    raise AttributeError(f"module 'sglang_shadowkv' has no attribute {name!r}")
