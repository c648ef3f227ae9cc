"""Build a builtin model into the cache (once per machine), or return the verified cache.

    python -m engine.builtin_build builtin:smollm2-135m [--dtype bfloat16]

`orchestrator up` runs this in a child process before starting a cluster on a builtin (the
orchestrator never imports torch); engine workers and `LLM("builtin:...")` call ensure_builtin,
which waits on the build lock when another process is building the same model.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from common.builtin_models import BUILTIN_MODELS, builtin_model
from common.model_cache import ensure_built


def ensure_builtin(name: str, dtype: str = "float32") -> Path:
    builtin = builtin_model(name)
    if builtin is None:
        raise ValueError(f"{name!r} is not a builtin model")
    stored_dtype = dtype if builtin.per_dtype else "float32"
    module, _, function = builtin.builder.partition(":")
    build = getattr(importlib.import_module(module), function)
    return ensure_built(
        builtin.model_dir(dtype), name, stored_dtype, lambda path: build(path, dtype=stored_dtype)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a builtin model into the cache.")
    parser.add_argument("model", help=f"one of {', '.join(BUILTIN_MODELS)}")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = ensure_builtin(args.model, args.dtype)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model} ready in {path} ({time.perf_counter() - start:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
