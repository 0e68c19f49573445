# packfsdp on NVIDIA GPUs: an official PyTorch CUDA image + flash-attn + packfsdp.
#   docker build -t packfsdp .
#   docker run --gpus all --rm --ipc=host -v /data:/data packfsdp \
#       --nproc_per_node 2 -m trainer.train recipe=gpt2_dailydialog data.path=/data/dailydialog
# torch must be in pyproject's range (>= 2.10: varlen_attn), else `pip install .` replaces it and breaks the
# flash-attn built against it.
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
    PACKFSDP_CACHE=/cache/packfsdp \
    MAX_JOBS=8

WORKDIR /opt/packfsdp
# flash-attn compiles against the image's torch; --no-build-isolation makes it see that torch.
RUN pip install --no-build-isolation "flash-attn>=2.6"
COPY pyproject.toml setup.py README.md ./
COPY trainer ./trainer
COPY configs ./configs
COPY recipes ./recipes
COPY launch ./launch
RUN pip install ".[flash]"

ENTRYPOINT ["torchrun"]
CMD ["--nproc_per_node", "2", "-m", "trainer.train", "recipe=gpt2_dailydialog"]
