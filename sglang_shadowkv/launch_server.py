"""`python -m sglang_shadowkv.launch_server --model-path PATH --port N ...` (as in SGLang)."""

import sys

from sglang_shadowkv.entrypoints.launcher import main

if __name__ == "__main__":
    sys.exit(main())
