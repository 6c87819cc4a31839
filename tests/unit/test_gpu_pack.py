"""scripts/gpu/pack_vllm.py without the network or a GPU: a stand-in vLLM wheel (a few KB of fake kernels, a
dist-info) is trimmed and packed into parts under a tiny limit, and the same unpack code the GPU machine runs
(install_on_device.sh) puts back exactly the kept files, one part per "call"; a corrupted part is refused."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("pack_vllm", ROOT / "scripts" / "gpu" / "pack_vllm.py")
assert _spec is not None and _spec.loader is not None
pack = importlib.util.module_from_spec(_spec)
sys.modules["pack_vllm"] = pack  # dataclasses resolve their module by name
_spec.loader.exec_module(pack)

LIMIT = 12 * 1024  # a part of at most 12 KiB: the stand-in's 17 KiB of kernels need at least two
KEPT = ["vllm/__init__.py", "vllm/v1/engine/core.py", "vllm/_C_stable_libtorch.abi3.so",
        "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
        "vllm/vllm_flash_attn/flash_attn_interface.py", "vllm/cumem_allocator.abi3.so",
        "vllm-0.32.0.dist-info/METADATA", "vllm-0.32.0.dist-info/entry_points.txt"]
DROPPED = ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_qutlass_C.abi3.so", "vllm/vllm-rs",
           "vllm/third_party/deep_gemm/_C_extension.abi3.so", "vllm/third_party/deep_gemm/include/cute/mma.hpp",
           "vllm/_flashmla_C.abi3.so"]
RECORD = "vllm-0.32.0.dist-info/RECORD"


def member_bytes(name: str) -> bytes:
    """Incompressible bytes for a fake kernel (so parts fill up as real ones do), text for the rest."""
    if name.endswith(".so") or name.endswith("vllm-rs"):
        return hashlib.shake_256(name.encode()).digest(3 * 1024)
    return f"# {name}\n".encode() * 8


def record_line(name: str, data: bytes) -> str:
    return f"{name},sha256={hashlib.sha256(data).hexdigest()},{len(data)}"


@pytest.fixture
def wheel(tmp_path: Path) -> Path:
    path = tmp_path / "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in KEPT + DROPPED:
            data = member_bytes(name)
            zf.writestr(name, data)
            record.append(record_line(name, data))
        zf.writestr(RECORD, "\n".join([*record, f"{RECORD},,"]) + "\n")
    return path


@pytest.fixture
def deps(tmp_path: Path) -> list[Path]:
    folder = tmp_path / "deps"
    folder.mkdir()
    paths = []
    for name in ("cachetools-8.0.2-py3-none-any.whl", "blake3-1.0.11-cp312-cp312-manylinux_2_17_x86_64.whl"):
        (folder / name).write_bytes(hashlib.shake_256(name.encode()).digest(2 * 1024))
        paths.append(folder / name)
    return paths


def packed(tmp_path: Path, wheel: Path, deps: list[Path]) -> tuple[Path, dict]:
    out = tmp_path / "parts"
    manifest = pack.build(wheel, deps, None, out, LIMIT, preset=1, log=lambda _: None)
    return out, manifest


def test_pack_trims_splits_and_unpack_reassembles_exactly_the_kept_files(tmp_path, wheel, deps):
    out, manifest = packed(tmp_path, wheel, deps)
    parts = manifest["parts"]
    assert len(parts) >= 2
    for part in parts:
        path = out / part["name"]
        assert path.stat().st_size == part["size"] <= LIMIT
        assert hashlib.sha256(path.read_bytes()).hexdigest() == part["sha256"]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    packed_names = [f[0] for p in parts for f in p["files"]]
    assert sorted(packed_names) == sorted([f"site/{n}" for n in [*KEPT, RECORD]]
                                          + [f"wheels/{d.name}" for d in deps])
    assert {d["pattern"] for d in manifest["vllm"]["dropped"]} == {
        "vllm/vllm_flash_attn/_vllm_fa2_C*.so", "vllm/_qutlass_C*.so", "vllm/vllm-rs",
        "vllm/third_party/deep_gemm/*", "vllm/_flashmla_C*.so"}

    # The GPU machine gets one part per call: unpack what is there, then the rest a call later.
    carried, dest = tmp_path / "carried", tmp_path / "dest"
    carried.mkdir()
    shutil.copy(out / "manifest.json", carried)
    shutil.copy(out / parts[0]["name"], carried)
    first = pack.unpack(carried, dest, log=lambda _: None)
    assert first.installed == [parts[0]["name"]] and not first.complete
    (carried / parts[0]["name"]).unlink()  # a later call carries only its own part
    for part in parts[1:]:
        shutil.copy(out / part["name"], carried)
    second = pack.unpack(carried, dest, log=lambda _: None)
    assert second.complete and second.installed == [p["name"] for p in parts[1:]]

    files = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()} - {pack.STATE}
    assert files == set(packed_names)
    with zipfile.ZipFile(wheel) as zf:
        for name in KEPT:
            assert (dest / "site" / name).read_bytes() == zf.read(name)
    for name in DROPPED:
        assert not (dest / "site" / name).exists()
    assert os.access(dest / "site" / "vllm/_C_stable_libtorch.abi3.so", os.R_OK)
    for d in deps:
        assert (dest / "wheels" / d.name).read_bytes() == d.read_bytes()
    record = (dest / "site" / RECORD).read_text().splitlines()
    assert sorted(r.split(",")[0] for r in record) == sorted([*KEPT, RECORD])


def test_a_corrupted_part_is_refused_and_nothing_of_it_unpacked(tmp_path, wheel, deps):
    out, manifest = packed(tmp_path, wheel, deps)
    part = out / manifest["parts"][0]["name"]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    part.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    with pytest.raises(pack.PartError, match="sha256"):
        pack.unpack(out, dest, log=lambda _: None)
    assert not (dest / "site").exists() and not (dest / pack.STATE).exists()


def test_parts_of_another_pack_are_not_mixed_in(tmp_path, wheel, deps):
    out, _ = packed(tmp_path, wheel, deps)
    dest = tmp_path / "dest"
    pack.unpack(out, dest, log=lambda _: None)
    other = pack.build(wheel, deps[:1], None, tmp_path / "other", LIMIT, preset=1, log=lambda _: None)
    assert pack.pack_id(other) != json.loads((dest / pack.STATE).read_text())["pack"]
    with pytest.raises(pack.PartError, match="another pack"):
        pack.unpack(tmp_path / "other", dest, log=lambda _: None)


def test_parts_whose_estimates_were_too_high_are_merged(tmp_path):
    """Three 4 KiB files estimated at 10 KiB each get a part each by estimate; the two smallest parts are then
    written as one, and the third no longer fits beside them."""
    data = {f"site/f{i}": hashlib.shake_256(bytes([i])).digest(4 * 1024) for i in range(3)}
    entries = [pack.Entry(name, len(d), 10 * 1024, 0o644, lambda d=d: io.BytesIO(d)) for name, d in data.items()]
    assert len(pack.group_entries(entries, LIMIT)) == 3
    out = tmp_path / "out"
    out.mkdir()
    parts = pack.write_parts(entries, out, LIMIT, preset=1, log=lambda _: None)
    assert sorted(len(p["files"]) for p in parts) == [1, 2]
    assert all((out / p["name"]).stat().st_size <= LIMIT for p in parts)
    assert sorted(p.name for p in out.iterdir()) == ["part-01.tar.xz", "part-02.tar.xz"]


def test_a_trim_that_would_lose_a_required_kernel_stops_the_pack():
    with pytest.raises(pack.PackError, match="_vllm_fa3_C"):
        pack.trim([n for n in KEPT if "fa3" not in n])


def test_kvcompact_entry_point_is_visible_from_the_site_folder(tmp_path):
    site = tmp_path / "site"
    pack.install_kvcompact(site)
    (ep,) = [e for d in importlib.metadata.distributions(path=[str(site)])
             for e in d.entry_points if e.group == "vllm.general_plugins"]
    assert (ep.name, ep.value) == ("kvcompact", "kvcompact.vllm.plugin:register")
