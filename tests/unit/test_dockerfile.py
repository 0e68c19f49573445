"""The Dockerfile, read as text (no Docker daemon here): what a first GPU user depends on (issue 12, defect 8).

The package index has flash-attn only as an sdist, so it is compiled in an opt-in builder stage and the
default image goes without it (``auto`` then picks ``torch_varlen``); the images' torch is in pyproject's
range; run directories are a volume and the documented ``docker run`` lines mount them.
"""

from __future__ import annotations

import re

from packaging.requirements import Requirement

from tests.conftest import REPO
from trainer.config import JobConfig


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` per instruction, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    return [(line.split()[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """Instructions per build stage, by ``AS`` name (the last, unnamed stage is ``final``); ``global`` holds
    the ARGs before the first FROM."""
    out: dict[str, list[tuple[str, str]]] = {"global": []}
    current = "global"
    for op, args in instructions(text):
        if op == "FROM":
            words = args.split()
            current = words[2] if len(words) == 3 and words[1].upper() == "AS" else "final"
            out[current] = []
        out[current].append((op, args))
    return out


DOCKERFILE = stages((REPO / "Dockerfile").read_text())


def args_of(stage: str) -> dict[str, str]:
    return dict(a.split("=", 1) if "=" in a else (a, "") for op, a in DOCKERFILE[stage] if op == "ARG")


def lines(stage: str, op: str) -> list[str]:
    return [a for o, a in DOCKERFILE[stage] if o == op]


def test_the_images_torch_is_in_pyprojects_range():
    image = args_of("global")["TORCH_IMAGE"]
    torch_version = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+", image).group(1)
    torch_req = Requirement(
        re.search(r'^\s*"(torch[<>=!~][^"]*)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    )
    assert torch_version in torch_req.specifier, (image, str(torch_req))


def test_flash_attn_is_an_opt_in_builder_stage():
    assert args_of("global")["FLASH_ATTN"] == "0"  # default: no CUDA compilation, auto -> torch_varlen
    assert lines("flash-attn-1", "FROM") == ["${TORCH_IMAGE}-devel AS flash-attn-1"]  # nvcc lives there
    builder_args = args_of("flash-attn-1")
    assert {"MAX_JOBS", "FLASH_ATTN_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST", "FLASH_ATTN_VERSION"} <= builder_args.keys()
    env = " ".join(lines("flash-attn-1", "ENV"))
    for name in ("MAX_JOBS", "FLASH_ATTN_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST"):
        assert f"{name}=${{{name}}}" in env  # the build args reach the build
    assert "FLASH_ATTENTION_FORCE_BUILD=TRUE" in env
    build = " ".join(lines("flash-attn-1", "RUN"))
    assert "pip wheel --no-build-isolation" in build and "flash-attn==${FLASH_ATTN_VERSION}" in build
    assert lines("flash-attn-wheels", "FROM") == ["flash-attn-${FLASH_ATTN} AS flash-attn-wheels"]
    assert "flash-attn-0" in DOCKERFILE


def test_the_final_image_installs_only_the_built_wheel():
    assert lines("final", "FROM") == ["${TORCH_IMAGE}-runtime"]
    assert "--from=flash-attn-wheels /wheels /wheels" in lines("final", "COPY")
    installs = " ".join(lines("final", "RUN"))
    # `.[flash]` or a bare flash-attn requirement would compile flash-attn from the sdist in this stage.
    assert "[flash]" not in installs and "flash-attn" not in installs and 'pip install ".[chitchat]"' in installs


def test_outputs_are_a_volume_and_the_docs_mount_them():
    workdir = lines("final", "WORKDIR")[-1]
    outputs = f"{workdir}/{JobConfig.output_root}"
    volumes = " ".join(lines("final", "VOLUME"))
    assert f'"{outputs}"' in volumes and '"/cache/packfsdp"' in volumes
    # --rm deletes anonymous volumes: every documented run line mounts a host folder on the outputs.
    for doc in ("Dockerfile", "README.md", "docs/distributed.md"):
        text = (REPO / doc).read_text()
        runs = re.findall(r"docker run --gpus[^\n]*(?:\\\n[^\n]*)*", text)
        assert runs or doc == "README.md", doc
        for run in runs:
            assert f":{outputs}" in run, (doc, run)
    assert f'-v "$PWD/outputs:{outputs}"' in (REPO / "README.md").read_text()


def test_the_build_context_leaves_outputs_and_caches_out():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {"outputs", ".venv", ".cache", ".git"} <= set(ignored)
