"""The GPU trainer image's dependencies resolve: checked offline against the metadata at hand.

``constraints-gpu.txt`` pins what the GPU image installs (images/trainer.Dockerfile uses it in
place of ``constraints.txt`` with the gpu extra). Every pin must satisfy every Requires-Dist of
the pinned sglang wheel (read from the wheel ``make install`` caches; no network) and of the
installed megatron-core, and every requirement of the trainer and gpu extras; a package sglang
pins exactly that the extras also require must be pinned here, to sglang's version. (The image
used to pin torch 2.13.0 while sglang 0.5.23 requires torch==2.14.1: no resolution.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
# the image's platform: CPython 3.11 (Ubuntu 24.04's is 3.12; the marker values that matter
# here, platform and machine, are the same) on linux x86_64
ENV = {
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def pins(name: str) -> dict[str, Version]:
    out = {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            pkg, version = line.split("==")
            out[canonicalize_name(pkg)] = Version(version)
    return out


def applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(ENV)


def sglang_requirements() -> list[Requirement]:
    text = (REPO / "pyproject.toml").read_text()
    version = re.search(r'"sglang==([^"]+)"', text).group(1)
    env = os.environ.get("PPOJOB_SGLANG_CACHE")
    folder = Path(env) if env else Path(sys.prefix) / "test-cache" / "sglang"
    wheels = sorted(folder.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"no sglang {version} wheel in {folder} (make install fills it)")
        pytest.skip(f"no sglang {version} wheel in {folder}: fill it with `make install`")
    with zipfile.ZipFile(wheels[-1]) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        text = whl.read(meta).decode()
    return [
        Requirement(line.split(":", 1)[1].strip())
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]


def extras_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in extras["trainer"] + extras["gpu"]]


def test_gpu_pins_satisfy_sglang_megatron_and_the_extras():
    gpu = pins("constraints-gpu.txt")
    megatron = [Requirement(r) for r in metadata.requires("megatron-core") or []]
    sources = {
        "sglang": sglang_requirements(),
        "megatron-core": megatron,
        "ppojob[trainer,gpu]": extras_requirements(),
    }
    bad = [
        f"{pkg}=={gpu[canonicalize_name(r.name)]} breaks {who}'s {r}"
        for who, reqs in sources.items()
        for r in reqs
        if applies(r) and (pkg := canonicalize_name(r.name)) in gpu
        if not r.specifier.contains(gpu[pkg], prereleases=True)
    ]
    assert not bad, bad


def test_what_sglang_pins_and_the_extras_require_is_pinned_to_sglangs_version():
    gpu = pins("constraints-gpu.txt")
    ours = {canonicalize_name(r.name) for r in extras_requirements()}
    exact = {
        canonicalize_name(r.name): Version(next(iter(r.specifier)).version)
        for r in sglang_requirements()
        if applies(r) and len(r.specifier) == 1 and next(iter(r.specifier)).operator == "=="
    }
    missing = {pkg: str(v) for pkg, v in exact.items() if pkg in ours and gpu.get(pkg) != v}
    assert not missing, f"constraints-gpu.txt must pin {missing}"
    assert {"torch", "transformers"} <= set(exact) & ours  # the check has something to bite on


def test_the_gpu_image_uses_the_gpu_lock_with_the_same_ray():
    """The trainer image picks its lock by ${EXTRAS} (run as the image's shell runs it), each
    lock for the Python its base image has, and both locks hold the same Ray."""
    from hack import lock

    assert pins("constraints-gpu.txt")["ray"] == pins("constraints.txt")["ray"]
    assert lock.read_lock("trainer-gpu")["ray"] == lock.read_lock("trainer-cpu")["ray"]
    dockerfile = (REPO / "images" / "trainer.Dockerfile").read_text()
    (line,) = [x for x in dockerfile.splitlines() if "lock=locks/trainer-gpu.txt" in x]
    step = line.removeprefix("RUN ").split("esac;")[0] + "esac"
    for extras, wanted in (("trainer,trackers,gpu", "trainer-gpu"), ("trainer", "trainer-cpu")):
        out = subprocess.run(
            ["bash", "-c", step + '; echo "$lock $py"'],
            env={"EXTRAS": extras, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert out == [f"locks/{wanted}.txt", lock.SPECS[wanted].python], extras


def test_the_gpu_base_images_cuda_is_the_one_sglang_is_built_for():
    """The GPU image's CUDA toolkit (its base image) has the CUDA major version sglang's wheel
    requires (``cuda-python>=13``, its ``[cu13]`` kernels; torch 2.14.1's wheels are CUDA 13
    builds): extensions built in the image (sglang's, megatron's) compile with that nvcc, and
    torch's extension builder refuses an nvcc of another major version."""
    dockerfile = (REPO / "images" / "trainer.Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", dockerfile, re.M).group(1)
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-devel-ubuntu\d+\.\d+", base)
    assert match, f"the GPU base image {base} is not a CUDA devel image with cuDNN"
    cuda = next(r for r in sglang_requirements() if canonicalize_name(r.name) == "cuda-python")
    floor = min(Version(s.version) for s in cuda.specifier if s.operator in (">=", "=="))
    assert int(match.group(1)) == floor.major, (base, str(cuda))
    kernels = {r.name for r in sglang_requirements() if f"cu{floor.major}" in r.extras}
    assert kernels, "sglang's CUDA kernels name no CUDA major version"


def test_the_gpu_image_installs_the_transformer_engine_megatron_builds_against():
    """Transformer Engine is pinned within the range megatron-core's own `dev` extra names
    (its fused layers and the `thd` varlen attention of packing), every TE package at one
    version, and the image installs it with the gpu extra only, without build isolation (its
    torch extension compiles against the image's torch)."""
    gpu = pins("constraints-gpu.txt")
    te = [
        Requirement(r)
        for r in metadata.requires("megatron-core") or []
        if canonicalize_name(Requirement(r).name) == "transformer-engine"
    ]
    assert te, "megatron-core names no Transformer Engine version"
    assert all(gpu["transformer-engine"] in r.specifier for r in te), (gpu, [str(r) for r in te])
    versions = {v for k, v in gpu.items() if k.startswith("transformer-engine")}
    assert (
        versions == {gpu["transformer-engine"]}
        and len([k for k in gpu if k.startswith("transformer-engine")]) == 3
    )
    dockerfile = (REPO / "images" / "trainer.Dockerfile").read_text()
    (step,) = [
        block
        for block in dockerfile.split("\nRUN ")
        if "only locks/trainer-gpu.txt transformer-engine-torch" in block
    ]
    assert "--no-build-isolation" in step and "--require-hashes" in step
    assert "*,gpu,*)" in step  # the CPU variant does not build it
    # the lock holds the pinned Transformer Engine, and the metadata uv resolved its torch
    # extension with (an sdist) is stated for that version
    from hack import lock

    locked = lock.read_lock("trainer-gpu")
    assert {k: Version(v) for k, v in locked.items() if k.startswith("transformer-engine")} == {
        k: v for k, v in gpu.items() if k.startswith("transformer-engine")
    }
    config = tomllib.loads((REPO / "locks" / "uv-gpu.toml").read_text())
    (meta,) = config["dependency-metadata"]
    assert meta["name"] == "transformer-engine-torch"
    assert Version(meta["version"]) == gpu["transformer-engine-torch"]
