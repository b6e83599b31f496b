"""Locates include/mkernel.h: the repository's copy (the source of truth) when the tests
run from a checkout, else the copy bundled in the installed package."""

from pathlib import Path

from mkernel import _lib

_REPO_HEADER = Path(__file__).resolve().parents[2] / "include" / "mkernel.h"
HEADER = _REPO_HEADER if _REPO_HEADER.is_file() else _lib.bundled_header_path()


def header_text() -> str:
    return HEADER.read_text()
