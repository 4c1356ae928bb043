"""The merge's output file: direct I/O through an aligned block, and the buffered fallback, write the same bytes."""

from __future__ import annotations

import errno
import os

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("torch")
from finetune.weights import safetensors_io  # noqa: E402
from finetune.weights.safetensors_io import OutputFile  # noqa: E402

# Pieces of odd sizes around the block size (shrunk to 64 KiB below), like a header and tensors.
SIZES = [8, 1234, 65536, 65536 * 3 + 17, 5, 70000, 4096]


@pytest.fixture(autouse=True)
def small_block(monkeypatch):
    monkeypatch.setattr(safetensors_io, "_DIRECT_BLOCK", 1 << 16)


def write_pieces(path, direct: bool) -> bytes:
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in SIZES]
    out = OutputFile(path, direct=direct)
    for piece in pieces:
        out.write(piece)
    out.finish(sync=True)
    return b"".join(p.tobytes() for p in pieces)


@pytest.mark.parametrize("direct", [True, False])
def test_output_file_holds_exactly_the_bytes_written(tmp_path, direct):
    expected = write_pieces(tmp_path / "f", direct)
    assert (tmp_path / "f").read_bytes() == expected


def test_direct_io_is_used_where_the_file_system_takes_it(tmp_path):
    out = OutputFile(tmp_path / "f", direct=True)
    try:
        if not out.direct:
            pytest.skip("this file system refuses O_DIRECT")
    finally:
        out.close()


def test_refused_at_open_falls_back_to_buffered_writes(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    expected = write_pieces(tmp_path / "f", direct=True)
    assert (tmp_path / "f").read_bytes() == expected


@pytest.mark.parametrize("refused_write", [1, 3])
def test_refused_write_falls_back_with_nothing_lost(tmp_path, monkeypatch, refused_write):
    # A device that takes the O_DIRECT open but not the alignment: the first (or a later) block write fails.
    real_write = os.write
    calls = []

    def write(fd, data):
        calls.append(1)
        if len(calls) == refused_write:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    probe = OutputFile(tmp_path / "probe", direct=True)
    direct = probe.direct
    probe.close()
    if not direct:
        pytest.skip("this file system refuses O_DIRECT")
    calls.clear()
    expected = write_pieces(tmp_path / "f", direct=True)
    assert (tmp_path / "f").read_bytes() == expected


def test_other_write_errors_are_raised(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as info:
        write_pieces(tmp_path / "f", direct=True)
    assert info.value.errno == errno.ENOSPC


def test_a_full_disk_names_the_file_and_the_block_still_closes(tmp_path, monkeypatch):
    """Issue 34: ENOSPC in a direct write, then close() while that error was being handled (merge's `finally:
    writer.abort()`) raised BufferError, and the one line became a traceback."""
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = OutputFile(tmp_path / "f", direct=True)
    if not out.direct:
        out.close()
        pytest.skip("this file system refuses O_DIRECT")
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as info:
        try:
            out.write(np.zeros(1 << 17, dtype=np.uint8))
        finally:
            out.close()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "f")


@pytest.mark.parametrize("direct", [True, False])
def test_shard_writer_files_load_with_safetensors(tmp_path, direct):
    # convert writes buffered, merge direct: both must give safetensors the same file.
    import math

    import torch
    from safetensors.torch import load_file

    from finetune.weights.safetensors_io import BaseTensor, OutTensor, ShardWriter

    generator = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=generator).bfloat16(), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(300, 257, generator=generator)}  # c crosses the 64 KiB test block
    plan = [OutTensor(name, BaseTensor(name, tmp_path, "", tuple(t.shape)), safetensors_io.TORCH_TO_ST[t.dtype],
                      math.prod(t.shape) * t.element_size()) for name, t in tensors.items()]
    writer = ShardWriter(tmp_path / "model.safetensors", plan, direct=direct)
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())
