"""The build cache of runtime/native.py: a library is rebuilt when any file it is compiled from changes, the local
headers it includes among them (runtime/csrc/cpu_kernel.c is a list of such sections, and pool.h is shared)."""

from __future__ import annotations

import shutil

import pytest

from runtime import native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _write(tmp_path, value: int) -> None:
    (tmp_path / "part").mkdir(exist_ok=True)
    (tmp_path / "part" / "value.h").write_text(f"static int value(void) {{ return {value}; }}\n")
    (tmp_path / "shared.h").write_text('#include "part/value.h"\n')
    (tmp_path / "lib.c").write_text('#include "shared.h"\nint vlm_value(void) { return value(); }\n')


def test_a_changed_header_rebuilds_the_library(tmp_path, monkeypatch):
    monkeypatch.setenv("VLMSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    _write(src, 7)
    assert native.load_library(src / "lib.c").vlm_value() == 7
    _write(src, 11)  # only a header two includes down changes
    assert native.load_library(src / "lib.c").vlm_value() == 11
    assert len(list((tmp_path / "cache").glob("lib-*.so"))) == 2


def test_the_key_reads_each_included_file_once(tmp_path):
    _write(tmp_path, 3)
    (tmp_path / "lib.c").write_text('#include "shared.h"\n#include "shared.h"\n#include <stdint.h>\n')
    got = native.source_bytes(tmp_path / "lib.c")
    assert got.count(b"return 3") == 1 and got.count(b'#include "part/value.h"') == 1
