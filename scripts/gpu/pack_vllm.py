"""GPU vLLM for the lent GPU machine, which has no package registry: packed here, unpacked there.

The lent machine (docs/gpu.md) has Python 3.12, torch 2.11.0+cu130, Triton 3.6.0 and transformers, but no vLLM,
and each call to it carries at most 64 MiB of working tree. So this script, run where PyPI is reachable,
downloads the vLLM 0.32.0 GPU wheel and the dependency wheels that machine lacks, trims the vLLM wheel to what the
V1 engine needs on Hopper with FLASH_ATTN and TRITON_ATTN (:data:`DROP` says what goes and why), and packs the
result into ``tar.xz`` parts that each fit one call beside the working tree, with a manifest of every part's
size and sha256 and every file's. The same file unpacks them on the machine (``unpack``: one part per call,
cumulatively into one folder, each part checked before it is opened and each file after) and makes kvcompact's
entry point visible there (``kvcompact``). Standard library only, except that ``pack`` reads requirements with
pip's own copy of ``packaging`` (pip is what downloads, so it is there); ``unpack`` and ``kvcompact`` need
nothing but the standard library.

    python3 scripts/gpu/pack_vllm.py pack [--out .gpu-parts] [--part-mib N]       # here, with network
    python3 scripts/gpu/pack_vllm.py unpack --parts .gpu-parts --dest /tmp/vllm-gpu   # there (install_on_device.sh)
    python3 scripts/gpu/pack_vllm.py kvcompact --site /tmp/vllm-gpu/site             # there

Payload layout (inside the parts, and under ``--dest`` once unpacked): ``site/`` the trimmed vLLM package and
its dist-info (RECORD rewritten to the kept files), ``wheels/`` the dependency wheels, ``tokenizer/`` the bundled
model's tokenizer (the random prompts of ``vllm bench serve`` need one; docs/gpu.md).
"""

from __future__ import annotations

import argparse
import email.parser
import fnmatch
import functools
import hashlib
import io
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
VLLM_REQUIREMENT = "vllm==0.32.0"
MANIFEST = "manifest.json"
STATE = ".installed-parts.json"  # under --dest: which parts are unpacked there, and from which pack
FORMAT = 1
# One call carries the working tree and the carried paths, 64 MiB in all; aim for 60 and leave 2 for the tree to
# grow between packing and sending (and for the manifest, which travels with every part).
CALL_TARGET = 60 * MiB
TREE_MARGIN = 2 * MiB

# The machine's interpreter and platform, for which wheels are chosen and markers evaluated.
PYTHON_VERSION = "3.12"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
              "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}

# What the machine's image holds (the device notes' package list, read on a machine on 2026-11-17): never
# carried, whatever version vLLM pins (install_on_device.sh prints each pin the image does not meet).
DEVICE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())

# vLLM requirements not carried although the machine lacks them: kernel libraries of other attention backends,
# other GPUs or other model families, and optional loaders and media decoders. vLLM imports each of them only
# where that feature is used: no module on the dense-model, FLASH_ATTN / TRITON_ATTN path imports them at import
# time (read in vLLM 0.32.0's sources, and checked by importing vLLM's LLM, V1 GPU runner, both backends, OpenAI
# server and `vllm bench serve` on a CPU: docs/gpu.md). Together they are most of vLLM's download.
SKIPPED = {
    "flashinfer-python": "FLASHINFER attention and sampling kernels; imported by its backend module and MNNVL "
                         "all2all only (the checks select FLASH_ATTN or TRITON_ATTN)",
    "nvidia-cudnn-frontend": "cuDNN attention (flashinfer's prefill); not on the FLASH_ATTN / TRITON_ATTN path",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (FA4 on Blackwell, MLA / DSA / GDN / MoE-router kernels of other "
                          "model families); no importer on a dense model's path",
    "quack-kernels": "CuTe DSL kernels (GDN, DSA indexers); no importer on a dense model's path",
    "tilelang": "TileLang kernels of other model families (vllm.tilelang_utils, imported lazily)",
    "tokenspeed-mla": "MLA kernels (latent attention, which kvcompact refuses)",
    "humming-kernels": "quantized GEMM kernels (vllm.utils.humming, imported lazily); the checks run bf16",
    "torchcodec": "audio / video decoding for multimodal inputs",
    "pynvvideocodec": "NVDEC video decoding for multimodal inputs",
    "fastsafetensors": "--load-format fastsafetensors only; the checks load dummy weights",
    "instanttensor": "--load-format instanttensor only; the checks load dummy weights",
    "nvtx": "profiling ranges, only with VLLM_NVTX_SCOPES_FOR_PROFILING",
    "fastapi-cli": "the `fastapi` command (from fastapi[standard]), which vLLM never runs; its cloud client "
                   "would bring sentry-sdk, rignore and four more",
}

# Wheel members dropped from vLLM, each glob (fnmatch: '*' crosses '/') with the reason it is not needed.
DROP = {
    "vllm/vllm_flash_attn/_vllm_fa2_C*.so": "FlashAttention 2 (Ampere; imported under try, vLLM uses FA3 on "
                                           "Hopper)",
    "vllm/_qutlass_C*.so": "QuTLASS FP4 kernels (Blackwell), imported under contextlib.suppress(ImportError)",
    "vllm/third_party/deep_gemm/*": "DeepGEMM block-fp8 GEMMs; vllm.utils.deep_gemm falls back on ImportError",
    "vllm/third_party/fmha_sm100/*": "Blackwell FMHA of MiniMax-M3's sparse attention",
    "vllm/third_party/tml_fa4/*": "Blackwell FA4 of one model's relative attention",
    "vllm/_flashmla_C*.so": "FlashMLA (latent attention, which kvcompact refuses), imported lazily",
    "vllm/_flashmla_extension_C*.so": "FlashMLA extension, as above",
    "vllm/_deepselect_C*.so": "DeepSeek sparse-attention indexer top-k, imported lazily",
    "vllm/_flashkda_C*.so": "Kimi delta attention (hybrid models, which kvcompact refuses), imported lazily",
    "vllm/vllm-rs": "the Rust frontend binary, run only with VLLM_USE_RUST_FRONTEND or VLLM_USE_RUST_BENCH",
    "*/__pycache__/*": "bytecode, rebuilt on first import",
}
# Kept members the V1 engine cannot start without: a trim that loses one is a bug in DROP, caught here rather than
# on the machine.
REQUIRED = ("vllm/__init__.py", "vllm/_C_stable_libtorch*.so", "vllm/_moe_C_stable_libtorch*.so",
            "vllm/vllm_flash_attn/_vllm_fa3_C*.so", "vllm-*.dist-info/METADATA", "vllm-*.dist-info/entry_points.txt")
FILL = 0.97  # of a part's limit that grouping fills: a tar header's and xz's stream overhead stay outside
MEASURED = 4 * MiB  # members larger than this are compressed once to measure them
# The tokenizer's files (the bundled model's; any Hugging Face tokenizer folder works).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class PackError(RuntimeError):
    """Packing cannot produce what the machine needs; the message says what to change."""


class PartError(RuntimeError):
    """A part or an unpacked file is not what the manifest says: it is refused, nothing of it is used."""


# ------------------------------------------------------------------------------------------------ trimming
def trim(names: Iterable[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(kept members, dropped members by the :data:`DROP` glob that dropped them), directories left out.
    Raises PackError when a :data:`REQUIRED` member is missing from what is kept."""
    kept: list[str] = []
    dropped: dict[str, list[str]] = {pattern: [] for pattern in DROP}
    for name in names:
        if name.endswith("/"):
            continue
        pattern = next((p for p in DROP if fnmatch.fnmatchcase(name, p)), None)
        (dropped[pattern] if pattern is not None else kept).append(name)
    missing = [p for p in REQUIRED if not any(fnmatch.fnmatchcase(n, p) for n in kept)]
    if missing:
        raise PackError(f"the trimmed vLLM wheel lacks {', '.join(missing)}: check DROP against this wheel")
    return kept, dropped


def rewrite_record(record: str, kept: Iterable[str]) -> str:
    """The dist-info RECORD limited to the kept files (and itself), so the unpacked distribution describes
    exactly what is there."""
    keep = set(kept)
    lines = [line for line in record.splitlines() if line and line.split(",", 1)[0] in keep]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ payload
@dataclass
class Entry:
    """One file of the payload: its path in the parts, bytes, a guess at its compressed size (to fill parts
    without compressing twice), its Unix mode, and how to open it."""

    arcname: str
    size: int
    estimate: int
    mode: int
    open: Callable[[], IO[bytes]]


def xz_size(open_file: Callable[[], IO[bytes]], preset: int) -> int:
    """A large file's xz size, measured by compressing it once alone (the output is counted, not kept). Deflate's
    size is no guide there (FA3's library deflates to 41 MB, xz makes about 12 of it) and sampling misjudged
    vLLM's main library by 8%, which cost a recompression of a 52 MiB part per try; this costs one more pass
    over the large files (about half of the pack's xz time)."""
    compressor, n = lzma.LZMACompressor(preset=preset), 0
    with open_file() as f:
        for chunk in iter(lambda: f.read(MiB), b""):
            n += len(compressor.compress(chunk))
    return n + len(compressor.flush()) + 4096


def wheel_entries(wheel: Path, prefix: str = "site/", preset: int = 6) -> tuple[list[Entry], dict[str, list[str]]]:
    """The trimmed wheel's files as payload entries (RECORD rewritten), and what :func:`trim` dropped. A small
    member's deflated size in the wheel is its estimate (xz compresses no worse than deflate); a large one's is
    measured (:func:`xz_size`)."""
    zf = zipfile.ZipFile(wheel)
    infos = {i.filename: i for i in zf.infolist()}
    kept, dropped = trim(infos)
    entries = []
    for name in kept:
        info = infos[name]
        mode = (info.external_attr >> 16) & 0o777 or 0o644
        if name.endswith(".dist-info/RECORD"):
            data = rewrite_record(zf.read(name).decode(), kept).encode()
            entries.append(Entry(prefix + name, len(data), len(data), mode, lambda d=data: io.BytesIO(d)))
        else:
            opener = functools.partial(zf.open, name)
            estimate = info.compress_size if info.file_size <= MEASURED else xz_size(opener, preset)
            entries.append(Entry(prefix + name, info.file_size, estimate, mode, opener))
    return entries, dropped


def file_entries(paths: Iterable[Path], prefix: str) -> list[Entry]:
    """Files from disk under ``prefix``; their size is the estimate (wheels are compressed already)."""
    return [Entry(prefix + p.name, p.stat().st_size, p.stat().st_size, 0o644, lambda p=p: open(p, "rb"))
            for p in sorted(paths)]


# ------------------------------------------------------------------------------------------------ parts
class _Hashing:
    """A reader that hashes what passes through it, so a file's sha256 is taken while it is packed."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw, self.sha, self.n = raw, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.sha.update(data)
        self.n += len(data)
        return data


def sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MiB), b""):
            sha.update(chunk)
    return sha.hexdigest()


def group_entries(entries: list[Entry], limit: int) -> list[list[Entry]]:
    """Groups whose estimates fit ``limit``, first fit: the large entries first, largest first, then the small
    ones in their order (neighbours in a folder compress together); every call carries one part, so fewer parts
    is less device time. An entry that alone exceeds the limit cannot travel in any part."""
    limit = int(limit * FILL)
    large = sorted((e for e in entries if e.estimate > MiB), key=lambda e: -e.estimate)
    groups: list[list[Entry]] = []
    filled: list[int] = []
    for e in large + [e for e in entries if e.estimate <= MiB]:
        if e.estimate > limit:
            raise PackError(f"{e.arcname} ({e.estimate / MiB:.1f} MiB compressed, estimated) is larger than a "
                            f"part ({limit / MiB:.1f} MiB): raise --part-mib")
        i = next((i for i, f in enumerate(filled) if f + e.estimate <= limit), len(groups))
        if i == len(groups):
            groups.append([])
            filled.append(0)
        groups[i].append(e)
        filled[i] += e.estimate
    return groups


def write_part(path: Path, entries: list[Entry], preset: int) -> list[list[Any]]:
    """One ``tar.xz`` of ``entries`` (owner root, mtime 0: the same inputs give the same bytes); returns
    [arcname, size, sha256] per file."""
    files = []
    with tarfile.open(path, "w:xz", preset=preset, format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.arcname)
            info.size, info.mode, info.mtime = e.size, e.mode, 0
            with e.open() as raw:
                reader = _Hashing(raw)
                tar.addfile(info, reader)
            if reader.n != e.size:
                raise PackError(f"{e.arcname}: read {reader.n} bytes, expected {e.size}")
            files.append([e.arcname, e.size, reader.sha.hexdigest()])
    return files


@dataclass
class _Written:
    path: Path
    group: list[Entry]
    files: list[list[Any]]

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def write_parts(entries: list[Entry], out: Path, limit: int, preset: int = 6,
                log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Pack ``entries`` into ``out/part-NN.tar.xz``, each at most ``limit`` bytes. Groups are cut by estimate;
    a part that still comes out too large is split in two and written again. Then, since each part costs a
    device call and the estimates of small files are deflate's (xz packs text files together much tighter),
    the two smallest parts are written as one while their sizes add up to no more than the limit."""
    pending = group_entries(entries, limit)
    done: list[_Written] = []
    serial = 0
    while pending:
        group = pending.pop(0)
        serial += 1
        path = out / f".part-{serial:02d}.tmp"
        files = write_part(path, group, preset)
        size = path.stat().st_size
        if size > limit:
            path.unlink()
            if len(group) == 1:
                raise PackError(f"{group[0].arcname} compresses to {size / MiB:.1f} MiB, more than a part "
                                f"({limit / MiB:.1f} MiB): raise --part-mib")
            half = len(group) // 2
            pending[:0] = [group[:half], group[half:]]
            log(f"  part of {len(group)} files came out at {size / MiB:.1f} MiB > limit: split in two")
            continue
        done.append(_Written(path, group, files))
        log(f"  part {len(done)}: {len(files)} files, {size / MiB:.2f} MiB")
    while len(done) > 1:
        a, b = sorted(done, key=lambda w: w.size)[:2]
        if a.size + b.size > limit:
            break
        serial += 1
        merged = _Written(out / f".part-{serial:02d}.tmp", a.group + b.group, [])
        merged.files = write_part(merged.path, merged.group, preset)
        if merged.size > limit:
            merged.path.unlink()
            break
        log(f"  merged parts of {a.size / MiB:.2f} and {b.size / MiB:.2f} MiB into {merged.size / MiB:.2f} MiB")
        for w in (a, b):
            w.path.unlink()
            done.remove(w)
        done.append(merged)
    parts = []
    for i, w in enumerate(done, 1):
        final = out / f"part-{i:02d}.tar.xz"
        w.path.replace(final)
        parts.append({"name": final.name, "size": final.stat().st_size, "sha256": sha256_file(final),
                      "raw_bytes": sum(f[1] for f in w.files), "files": w.files})
    return parts


# ------------------------------------------------------------------------------------------------ unpacking
@dataclass
class UnpackReport:
    installed: list[str] = field(default_factory=list)   # parts unpacked by this call
    present: list[str] = field(default_factory=list)     # parts unpacked by this or an earlier call
    missing: list[str] = field(default_factory=list)     # parts not yet seen

    @property
    def complete(self) -> bool:
        return not self.missing


def pack_id(manifest: dict[str, Any]) -> str:
    """What identifies one pack: the parts' hashes. Parts of two packs never mix in one folder."""
    return hashlib.sha256("".join(p["sha256"] for p in manifest["parts"]).encode()).hexdigest()


def verify_part(path: Path, part: dict[str, Any]) -> None:
    """Refuse a part whose size or sha256 differs from the manifest's, before a byte of it is unpacked."""
    size = path.stat().st_size
    if size != part["size"]:
        raise PartError(f"{path}: {size} bytes, the manifest says {part['size']}: refused")
    digest = sha256_file(path)
    if digest != part["sha256"]:
        raise PartError(f"{path}: sha256 {digest}, the manifest says {part['sha256']}: refused")


def unpack(parts_dir: Path, dest: Path, log: Callable[[str], None] = print) -> UnpackReport:
    """Unpack every part of ``parts_dir``'s manifest found in ``parts_dir`` and not yet unpacked into ``dest``
    (earlier calls may have brought the others): the part is checked against the manifest first, its members
    must be exactly the manifest's files, and each file's size and sha256 are checked after it is written."""
    manifest = json.loads((parts_dir / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise PartError(f"{parts_dir / MANIFEST}: format {manifest.get('format')}, expected {FORMAT}")
    dest.mkdir(parents=True, exist_ok=True)
    state_path = dest / STATE
    state = json.loads(state_path.read_text()) if state_path.exists() else {"pack": pack_id(manifest), "parts": []}
    if state["pack"] != pack_id(manifest):
        raise PartError(f"{dest} holds parts of another pack ({state['pack'][:12]}, this manifest's is "
                        f"{pack_id(manifest)[:12]}): remove it, or unpack into another --dest")
    report = UnpackReport()
    for part in manifest["parts"]:
        name = part["name"]
        if name in state["parts"]:
            report.present.append(name)
            continue
        path = parts_dir / name
        if not path.exists():
            report.missing.append(name)
            continue
        verify_part(path, part)
        expected = {f[0]: f for f in part["files"]}
        with tarfile.open(path, "r:xz") as tar:
            members = tar.getmembers()
            names = {m.name for m in members}
            if names != set(expected) or len(members) != len(expected):
                raise PartError(f"{path}: its members are not the manifest's files "
                                f"({len(names ^ set(expected))} differ): refused")
            tar.extractall(dest, filter="data")
        for arcname, size, digest in expected.values():
            target = dest / arcname
            if target.stat().st_size != size or sha256_file(target) != digest:
                raise PartError(f"{target}: unpacked file differs from the manifest")
        state["parts"].append(name)
        state_path.write_text(json.dumps(state))
        report.installed.append(name)
        report.present.append(name)
        log(f"unpacked {name}: {len(expected)} files, sha256 verified")
    return report


# ------------------------------------------------------------------------------------------------ kvcompact
def install_kvcompact(site: Path, root: Path = ROOT) -> Path:
    """A dist-info for the checkout's kvcompact in ``site``, so vLLM finds its ``vllm.general_plugins`` entry point
    (importlib.metadata reads dist-infos on sys.path). The code itself is imported from ``root/src`` (put it on
    PYTHONPATH: a .pth is not read from a PYTHONPATH folder), so each call runs the checkout it carried, with no
    build step and no setuptools needed."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    text = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
                   for group, eps in groups.items())
    (info / "entry_points.txt").write_text(text)
    (info / "INSTALLER").write_text("scripts/gpu/pack_vllm.py\n")
    (info / "RECORD").write_text("")
    return info


# ------------------------------------------------------------------------------------------------ downloading
def pip_download(requirements: list[str], dest: Path) -> None:
    """Wheels for the machine's Python and platform, never an sdist, no dependencies (resolved here)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           PYTHON_VERSION, "--implementation", "cp", "-d", str(dest), "--quiet"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + requirements, check=True)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return canonical(name), version


def requires_dist(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return email.parser.Parser().parsestr(zf.read(meta).decode()).get_all("Requires-Dist") or []


@dataclass
class Want:
    specifiers: set[str] = field(default_factory=set)
    extras: set[str] = field(default_factory=set)
    required_by: set[str] = field(default_factory=set)


def wanted(wheels: dict[str, Path], root: str, extras: dict[str, set[str]]) -> dict[str, Want]:
    """Every distribution the downloaded wheels require, transitively from ``root``, for the machine's markers,
    less what the machine has (:data:`DEVICE_PACKAGES`) and what is :data:`SKIPPED`."""
    from pip._vendor.packaging.requirements import Requirement  # pip's own copy: the one thing pack needs

    wants: dict[str, Want] = {}
    todo, seen = [root], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in wheels:
            continue
        seen.add(name)
        for line in requires_dist(wheels[name]):
            req = Requirement(line)
            env_extras = [""] + sorted(extras.get(name, ()))
            if req.marker is not None and not any(req.marker.evaluate({**MARKER_ENV, "extra": e})
                                                  for e in env_extras):
                continue
            dep = canonical(req.name)
            if dep in DEVICE_PACKAGES or dep in SKIPPED:
                continue
            want = wants.setdefault(dep, Want())
            if str(req.specifier):
                want.specifiers.add(str(req.specifier))
            want.extras |= set(req.extras)
            want.required_by.add(name)
            todo.append(dep)
    return wants


def resolve(cache: Path, log: Callable[[str], None] = print) -> tuple[Path, dict[str, Path], dict[str, Want]]:
    """Download vLLM and, round by round, every wheel its requirements reach that the machine lacks, until
    nothing new is wanted; a wheel whose version a later requirement excludes is fetched again."""
    from pip._vendor.packaging.specifiers import SpecifierSet

    cache.mkdir(parents=True, exist_ok=True)
    pip_download([VLLM_REQUIREMENT], cache)
    extras: dict[str, set[str]] = {}
    for _ in range(20):
        wheels = {wheel_name_version(p)[0]: p for p in sorted(cache.glob("*.whl"))}
        wants = wanted(wheels, "vllm", extras)
        requested = {n: w.extras for n, w in wants.items() if w.extras}
        if requested != extras:  # a newly requested extra may add requirements: walk again first
            extras = requested
            continue
        todo = []
        for name, want in sorted(wants.items()):
            spec = SpecifierSet(",".join(sorted(want.specifiers)))
            have = wheels.get(name)
            if have is not None and spec.contains(wheel_name_version(have)[1], prereleases=True):
                continue
            if have is not None:
                have.unlink()
            todo.append(f"{name}{spec}")
        if not todo:
            return wheels["vllm"], {n: wheels[n] for n in wants}, wants
        log(f"downloading {len(todo)}: {' '.join(todo)}")
        pip_download(todo, cache)
    raise PackError("dependency resolution did not settle in 20 rounds")


# ------------------------------------------------------------------------------------------------ pack
def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the checkout's tracked files: what travels with every call besides the carried part."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    return sum((root / n).stat().st_size for n in names.decode().split("\0") if n and (root / n).is_file())


def default_part_limit(tree: int) -> int:
    """Tree + part within :data:`CALL_TARGET`, with :data:`TREE_MARGIN` left, in whole MiB."""
    return (CALL_TARGET - tree - TREE_MARGIN) // MiB * MiB


def build(vllm_wheel: Path, dep_wheels: list[Path], tokenizer: Path | None, out: Path, limit: int,
          preset: int = 6, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Trim, pack and write the manifest: the part of ``pack`` that needs no network (the unit test runs it on
    a stand-in wheel)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*.tar.xz"):
        old.unlink()
    entries, dropped = wheel_entries(vllm_wheel, preset=preset)
    kept_bytes = sum(e.size for e in entries)
    entries += file_entries(dep_wheels, "wheels/")
    if tokenizer is not None:
        entries += file_entries([tokenizer / n for n in TOKENIZER_FILES if (tokenizer / n).exists()], "tokenizer/")
    started = time.monotonic()
    parts = write_parts(entries, out, limit, preset, log)
    seconds = time.monotonic() - started
    with zipfile.ZipFile(vllm_wheel) as zf:
        infos = {i.filename: i for i in zf.infolist()}
    manifest = {
        "format": FORMAT,
        "vllm": {"wheel": vllm_wheel.name, "wheel_sha256": sha256_file(vllm_wheel),
                 "files": len([n for n in infos if not n.endswith("/")]),
                 "bytes": sum(i.file_size for i in infos.values()),
                 "kept_files": len([e for e in entries if e.arcname.startswith("site/")]), "kept_bytes": kept_bytes,
                 "dropped": [{"pattern": p, "reason": DROP[p], "files": len(names),
                              "bytes": sum(infos[n].file_size for n in names)}
                             for p, names in dropped.items() if names]},
        "wheels": [{"name": p.name, "size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(dep_wheels)],
        "part_limit": limit,
        "xz": {"preset": preset, "seconds": round(seconds, 1)},
        "parts": parts,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def cmd_pack(args: argparse.Namespace) -> int:
    tree = tree_bytes()
    limit = args.part_mib * MiB if args.part_mib else default_part_limit(tree)
    if tree + limit > CALL_TARGET:
        print(f"warning: tree {tree / MiB:.1f} MiB + part {limit / MiB:.0f} MiB exceeds "
              f"{CALL_TARGET / MiB:.0f} MiB; one call carries at most 64 MiB")
    print(f"tree {tree / MiB:.2f} MiB (git ls-files), part limit {limit / MiB:.0f} MiB")
    vllm_wheel, deps, wants = resolve(args.cache)
    for name, want in sorted(wants.items()):
        print(f"  carry {deps[name].name}  (for {', '.join(sorted(want.required_by))})")
    tokenizer = args.tokenizer
    if tokenizer is not None and not (tokenizer / "tokenizer.json").exists():
        raise PackError(f"{tokenizer} holds no tokenizer.json (`kvcompact prepare` builds the bundled model)")
    manifest = build(vllm_wheel, sorted(deps.values()), tokenizer, args.out, limit, args.xz_preset)
    total = sum(p["size"] for p in manifest["parts"])
    print(f"{len(manifest['parts'])} parts, {total / MiB:.2f} MiB in all, xz {manifest['xz']['seconds']} s; "
          f"vLLM kept {manifest['vllm']['kept_files']} of {manifest['vllm']['files']} files, "
          f"{manifest['vllm']['kept_bytes'] / MiB:.1f} of {manifest['vllm']['bytes'] / MiB:.1f} MiB")
    for p in manifest["parts"]:
        print(f"  {p['name']}  {p['size']:>10} bytes  {p['sha256']}")
    return 0


def cmd_unpack(args: argparse.Namespace) -> int:
    report = unpack(args.parts, args.dest)
    print(f"parts unpacked in {args.dest}: {', '.join(report.present) or 'none'}")
    if not report.complete:
        print(f"waiting for: {', '.join(report.missing)} (carry each in a later call)")
        return 3
    return 0


def cmd_kvcompact(args: argparse.Namespace) -> int:
    print(f"wrote {install_kvcompact(args.site)}")
    return 0


def default_tokenizer() -> Path | None:
    """The bundled model's folder, where `kvcompact prepare` (or the test setup) built it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "kvcompact" / "models" / "SmolLM2-135M-Instruct"
    return path if (path / "tokenizer.json").exists() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="download, trim and pack (needs PyPI)")
    pk.add_argument("--out", type=Path, default=ROOT / ".gpu-parts", help="parts and manifest (git-ignored)")
    pk.add_argument("--cache", type=Path, default=ROOT / ".gpu-parts" / "cache", help="downloaded wheels")
    pk.add_argument("--part-mib", type=int, default=None,
                    help=f"largest part in MiB (default: {CALL_TARGET // MiB} MiB less the tracked tree, less "
                         f"{TREE_MARGIN // MiB} MiB)")
    pk.add_argument("--xz-preset", type=int, default=6, choices=range(10))
    pk.add_argument("--tokenizer", type=Path, default=default_tokenizer(),
                    help="tokenizer folder to carry (default: the bundled model's, if built)")
    pk.set_defaults(fn=cmd_pack)
    up = sub.add_parser("unpack", help="verify and unpack the parts that are here (on the GPU machine)")
    up.add_argument("--parts", type=Path, default=ROOT / ".gpu-parts")
    up.add_argument("--dest", type=Path, default=Path("/tmp/vllm-gpu"))
    up.set_defaults(fn=cmd_unpack)
    kv = sub.add_parser("kvcompact", help="make the checkout's kvcompact entry point visible in --site")
    kv.add_argument("--site", type=Path, default=Path("/tmp/vllm-gpu/site"))
    kv.set_defaults(fn=cmd_kvcompact)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (PackError, PartError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
