# packfsdp on NVIDIA GPUs: the official PyTorch CUDA runtime image + packfsdp (+ flash-attn, opt-in).
#   docker build -t packfsdp .                              # no flash-attn: model.attention=auto picks torch_varlen
#   docker build --build-arg FLASH_ATTN=1 -t packfsdp .     # compiles flash-attn (long: docs/distributed.md#docker-gpu)
#   docker run --gpus all --rm --ipc=host -v "$PWD/outputs:/opt/packfsdp/outputs" -v /data:/data packfsdp \
#       --nproc_per_node 2 -m trainer.train recipe=gpt2_dailydialog data.path=/data/dailydialog
# The images' torch must be in pyproject's range (>= 2.10: varlen_attn), else `pip install .` replaces it (and
# a flash-attn built against the old one breaks). tests/unit/test_dockerfile.py checks this file.
ARG TORCH_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9
ARG FLASH_ATTN=0

# ---------------------------------------------------------------------------------------- flash-attn, opt-in
# The package index has flash-attn only as an sdist: installing it compiles its CUDA kernels (every head dim,
# fp16 and bf16, forward and backward, for each GPU architecture) with nvcc, which needs the devel image.
FROM ${TORCH_IMAGE}-devel AS flash-attn-1
ARG FLASH_ATTN_VERSION=2.8.3
# Parallel nvcc jobs: each takes several GB of RAM (flash-attn's README: lower it below 96 GB of RAM).
ARG MAX_JOBS=4
# GPU architectures to compile for: 90 = H100/H200 (sm90); "80;90" adds A100 (each one compiled apart: longer).
ARG FLASH_ATTN_CUDA_ARCHS=90
ARG TORCH_CUDA_ARCH_LIST=9.0
ENV MAX_JOBS=${MAX_JOBS} \
    FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS} \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    FLASH_ATTENTION_FORCE_BUILD=TRUE \
    PIP_NO_CACHE_DIR=1
# --no-build-isolation: compile against this image's torch (the final image has the same one);
# FLASH_ATTENTION_FORCE_BUILD: no attempt to download a prebuilt wheel from GitHub.
RUN pip install ninja packaging wheel \
    && pip wheel --no-build-isolation --no-deps -w /wheels "flash-attn==${FLASH_ATTN_VERSION}"

# Without flash-attn: no wheel, and the devel image is never pulled (BuildKit builds only the stage used).
FROM ${TORCH_IMAGE}-runtime AS flash-attn-0
RUN mkdir /wheels

FROM flash-attn-${FLASH_ATTN} AS flash-attn-wheels

# ------------------------------------------------------------------------------------------------ the image
FROM ${TORCH_IMAGE}-runtime
# A C compiler: Triton builds its kernel launchers with it at run time (parallel.compile=true).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
    PACKFSDP_CACHE=/cache/packfsdp

WORKDIR /opt/packfsdp
COPY --from=flash-attn-wheels /wheels /wheels
RUN set -e; for wheel in /wheels/*.whl; do if [ -e "$wheel" ]; then pip install "$wheel"; fi; done; rm -rf /wheels
COPY pyproject.toml setup.py README.md ./
COPY trainer ./trainer
COPY configs ./configs
COPY recipes ./recipes
COPY launch ./launch
# Not `.[flash]`: that extra would make pip compile flash-attn from the sdist here. `chitchat`: the main job's
# corpus (data.source=chitchat, an 8 MB wheel), so recipe=cpu_chitchat runs offline in the image too.
RUN pip install ".[chitchat]"

# Run directories (output_root=outputs, relative to the working directory) and the tokenized-data cache.
# `docker run --rm` deletes anonymous volumes with the container: mount a host folder (-v) to keep them.
VOLUME ["/opt/packfsdp/outputs", "/cache/packfsdp"]

ENTRYPOINT ["torchrun"]
CMD ["--nproc_per_node", "2", "-m", "trainer.train", "recipe=gpt2_dailydialog"]
