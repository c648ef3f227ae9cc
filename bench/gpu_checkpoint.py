"""The full-size benchmark checkpoint on a GPU machine without internet (bench/gpu_run.sh).

A builtin:<name>-bench checkpoint (tools/tiny_arch/bench_dense.py: a real model's shapes, random
weights) is about 1 GB in bfloat16, far over the 64 MiB that travels to a lent GPU, but it is built
offline in seconds; only its tokenizer comes from builtin:smollm2-135m, whose build needs a wheel
that does not travel either. So SmolLM2's three tokenizer files (3.5 MB) travel instead, and the
checkpoint is built there into the model cache, where `builtin:<name>-bench` then finds it:

    python -m bench.gpu_checkpoint --save-tokenizer .whl/smollm2-tokenizer      # here
    python -m bench.gpu_checkpoint builtin:qwen2.5-0.5b-bench --dtype bfloat16 \\
        --tokenizer-from .whl/smollm2-tokenizer                                 # on the GPU box
    python -m bench.gpu_checkpoint builtin:qwen2.5-0.5b-bench --small DIR ...   # the dry run

`--small DIR` writes the same layout at a few layers and narrow widths into DIR (a local model
directory), for gpu_run.sh's CPU dry run. The last line printed is the model directory.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from common.builtin_models import builtin_model
from common.model_cache import ensure_built
from tools.tiny_arch import bench_dense

SMALL = bench_dense.SMALL


def shape_name(model: str) -> str:
    """builtin:qwen2.5-0.5b-bench -> qwen2.5-0.5b (a name of bench_dense.SHAPES)."""
    name = model.removeprefix("builtin:").removesuffix("-bench")
    if name not in bench_dense.SHAPES or builtin_model(model) is None:
        raise ValueError(f"{model!r} is not a dense bench builtin ({sorted(bench_dense.SHAPES)})")
    return name


def save_tokenizer(dest: Path) -> Path:
    """SmolLM2's tokenizer files into `dest`, from builtin:smollm2-135m (built here if need be)."""
    from engine.builtin_build import ensure_builtin

    source = ensure_builtin("builtin:smollm2-135m")
    dest.mkdir(parents=True, exist_ok=True)
    for name in bench_dense.TOKENIZER_FILES:
        shutil.copyfile(source / name, dest / name)
    return dest


def build(
    model: str, dtype: str, tokenizer_from: Path | None, overrides: dict[str, int] | None = None
) -> Path:
    """`model` built into the model cache (verified and kept if already there); `overrides`:
    a test's smaller layout."""
    name = shape_name(model)
    builtin = builtin_model(model)
    assert builtin is not None and builtin.per_dtype
    return ensure_built(
        builtin.model_dir(dtype),
        model,
        dtype,
        lambda path: bench_dense.build_dense_bench(
            path, name, dtype=dtype, overrides=overrides, tokenizer_source=tokenizer_from
        ),
    )


def build_small(model: str, dtype: str, tokenizer_from: Path | None, dest: Path) -> Path:
    return bench_dense.build_dense_bench(
        dest, shape_name(model), dtype=dtype, overrides=SMALL, tokenizer_source=tokenizer_from
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="builtin:qwen2.5-0.5b-bench")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--tokenizer-from", type=Path, help="a directory of SmolLM2's tokenizer")
    parser.add_argument("--small", type=Path, help="build the small layout into this directory")
    parser.add_argument("--save-tokenizer", type=Path, help="only copy SmolLM2's tokenizer here")
    args = parser.parse_args(argv)
    if args.save_tokenizer:
        path = save_tokenizer(args.save_tokenizer)
    elif args.small:
        path = build_small(args.model, args.dtype, args.tokenizer_from, args.small)
    else:
        path = build(args.model, args.dtype, args.tokenizer_from)
    print(path)


if __name__ == "__main__":
    main()
