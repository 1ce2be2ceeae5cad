"""ShadowKV: compression at prefill, chunk selection and gather at decode (torch + kernels/ only)."""

from .config import ShadowKVConfig

__all__ = ["ShadowKVConfig"]
