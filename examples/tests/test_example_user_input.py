"""What the user gives, read as they mean it: a --max-norm below 0 refused at once, GNU info
files read as text while images, archives and libraries are still skipped, and an
--out-dir where no directory can be made refused in one line."""

import gzip
import io
import os
import struct
import tarfile
import zlib

import pytest

from gpt import config, flags
from gpt.data import corpus
import train_gpt


# --- --max-norm ------------------------------------------------------------------------


@pytest.mark.parametrize("value, message", [
    ("-1", "--max-norm must be >= 0, got -1.0"), ("-1e-9", "--max-norm must be >= 0, got -1e-09"),
    ("-inf", "--max-norm must be a finite number, got -inf")])
def test_a_negative_max_norm_is_refused_at_parse_time(value, message):
  cfg = flags.parse_args([f"--max-norm={value}"])[1]
  with pytest.raises(config.ConfigError, match=f"^{message}$"):
    config.check(cfg)


def test_max_norm_0_turns_clipping_off_and_the_help_says_so(capsys):
  assert config.check(flags.parse_args(["--max-norm", "0"])[1]).max_norm == 0.0
  with pytest.raises(SystemExit):
    flags.parse_args(["--help"])
  assert "0 turns clipping off" in " ".join(capsys.readouterr().out.split())


# --- Text and binary files --------------------------------------------------------------


def info_index_file(nodes: int = 300) -> bytes:
  """The index file of a split GNU info manual (what `find.info.gz` holds): a header, the
  table of the manual's parts, and a tag table of every node's offset, the tables set off
  by 0x1f and each node's name from its offset by 0x7f."""
  header = (b"This is find.info, produced by makeinfo version 7.1 from find.texi.\n\n"
            b"INFO-DIR-SECTION Basics\nSTART-INFO-DIR-ENTRY\n"
            b"* Finding files: (find).        Operating on files matching criteria.\n"
            b"END-INFO-DIR-ENTRY\n\n")
  indirect = b"\x1f\nIndirect:\nfind.info-1: 1273\nfind.info-2: 302031\n"
  tags = b"\x1f\nTag Table:\n(Indirect)\n" + b"".join(
      b"Node: Section %d\x7f%d\n" % (i, 1273 + 977 * i) for i in range(nodes))
  end = b"\x1f\nEnd Tag Table\n\n\x1f\nLocal Variables:\ncoding: utf-8\nEnd:\n"
  return header + indirect + tags + end


def _control_share(data: bytes) -> float:
  return (len(data) - len(data.translate(None, corpus._CONTROL_BYTES))) / len(data)


def _png() -> bytes:
  pixels = bytes(range(256)) * 64
  chunk = lambda kind, body: (struct.pack(">I", len(body)) + kind + body
                              + struct.pack(">I", zlib.crc32(kind + body)))
  return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 128, 128, 8, 0, 0, 0, 0))
          + chunk(b"IDAT", zlib.compress(pixels)) + chunk(b"IEND", b""))


def _tar_of_text() -> bytes:
  out = io.BytesIO()
  with tarfile.open(fileobj=out, mode="w") as tar:
    for i in range(3):
      body = b"Plain text in an archive.\n" * 40
      info = tarfile.TarInfo(f"doc{i}.txt")
      info.size = len(body)
      tar.addfile(info, io.BytesIO(body))
  return out.getvalue()


def _shared_library() -> bytes:
  header = b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0x1040,
                                                          64, 8000, 0, 64, 56, 7, 64, 30, 29)
  return header + bytes(range(256)) * 8 + b"\x00GLIBC_2.2.5\x00libc.so.6\x00" * 20


BINARY = {"image.png": _png(), "docs.tar": _tar_of_text(), "docs.tar.gz": gzip.compress(
    _tar_of_text()), "libfoo.so": _shared_library(), "libfoo.so.gz": gzip.compress(
    _shared_library())}


def test_an_info_index_file_is_text_though_its_separators_are_control_bytes(tmp_path):
  data = info_index_file()
  assert _control_share(data) > corpus.MAX_BINARY_SHARE  # binary, by the plain count
  (tmp_path / "find.info").write_bytes(data)
  (tmp_path / "find.info.gz").write_bytes(gzip.compress(data))
  for name in ("find.info", "find.info.gz"):
    text, problem = corpus.read_text(str(tmp_path / name))
    assert (text, problem) == (data.decode(), None)


@pytest.mark.parametrize("name", sorted(BINARY))
def test_images_archives_and_libraries_are_still_binary(tmp_path, name):
  (tmp_path / name).write_bytes(BINARY[name])
  text, problem = corpus.read_text(str(tmp_path / name))
  assert text is None and problem.startswith("binary ("), problem


def test_a_source_of_info_files_keeps_them_and_skips_the_binaries(tmp_path):
  (tmp_path / "find.info.gz").write_bytes(gzip.compress(info_index_file()))
  (tmp_path / "find.info-1.gz").write_bytes(gzip.compress(
      b"\x1f\nFile: find.info,  Node: Top,  Next: Introduction,  Up: (dir)\n\n"
      b"Finding Files\n*************\n\nThis file documents the GNU utilities.\n"))
  for name, data in BINARY.items():
    (tmp_path / name).write_bytes(data)
  warnings = []
  docs = list(corpus.read_source_files("repo-docs", str(tmp_path), warnings.append))
  part = gzip.decompress((tmp_path / "find.info-1.gz").read_bytes()).decode()
  assert docs == [part, info_index_file().decode()]  # in sorted order
  assert sorted(w.split("skipping ")[1].split(":")[0] for w in warnings) == sorted(
      str(tmp_path / name) for name in BINARY)


# --- An --out-dir where no directory can be made ----------------------------------------


@pytest.mark.parametrize("out_dir", ["/proc/x", "/sys/x"])
def test_an_out_dir_on_a_filesystem_that_refuses_directories_is_one_line(
    out_dir, tiny, tmp_path, capsys):
  if not os.path.isdir(os.path.dirname(out_dir)):
    pytest.skip(f"{os.path.dirname(out_dir)} is not mounted here")
  cfg = tiny(tmp_path)
  with pytest.raises(SystemExit) as exit_info:
    train_gpt.main(["--config", "tiny", "--steps", "2", "--vocab-size", "512",
                    "--max-source-mb", "0.05", "--cache-dir", cfg.cache_dir, "--out-dir",
                    out_dir, "--no-progress"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f": error: --out-dir {out_dir}: " in err, err
  assert not os.path.exists(out_dir)
