#!/usr/bin/env bash
# The wheels a GPU machine without a package registry needs beside its torch, Triton and pytest, into .whl/
# (git-ignored, ~8 MB): Megatron-Core, a pure-Python DeepSpeed, pydantic with the pydantic-core it pins, and
# the small pure-Python dependencies. Carry .whl/ with the working tree; scripts/gpu_acceptance.sh installs
# them itself when its imports fail. Run on a machine with the registry: bash scripts/device_wheels.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py=.venv/bin/python
[ -x "$py" ] || py=python3
dest=.whl
mkdir -p "$dest"
# The device is CPython 3.12 on x86-64 Linux; the wheels are chosen for it, not for this machine.
target=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
        --platform any)
# pydantic with its dependencies resolved: it pins one pydantic-core, which a download without them can miss.
"$py" -m pip download -q -d "$dest" "${target[@]}" pydantic
"$py" -m pip download -q --no-deps -d "$dest" "${target[@]}" "megatron-core>=0.19,<0.20" hjson py-cpuinfo msgpack \
    pytest-xdist execnet
# DS_BUILD_OPS=0: no CUDA ops compiled into it (they build on first use where ever needed).
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps -w "$dest" "deepspeed>=0.19.4,<0.20"
ls -1 "$dest"
echo "$(du -sh "$dest" | cut -f1) in $dest: carry it (the device tool's carry: [\".whl\"])"
