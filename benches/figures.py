#!/usr/bin/env python3
"""The performance figures of README.md and docs/, rendered from the stored bench records.

    python3 benches/figures.py --check    # exit 1 where a page's figures differ from the records (CI)
    python3 benches/figures.py --write    # rewrite every figure block from the records

A page holds a figure as a block that this script fills:

    <!-- figures:NAME -->
    (rendered text)
    <!-- /figures -->

NAME is a figure of benches/figure_catalog.py (FIGURES). Each reads named records under benches/results/
(any kind benches/records.py reads) and prints every number beside the baseline measured in
the same run, citing the run: [n] links to the record, and the block ends with the list of
its runs (GPU, commit, date, command). Nothing in a block is written by hand: --check
renders every block and compares. It also refuses a number with a unit (µs, ms, TF/s, GB/s,
×) outside the blocks of the sections that only hold figures (FIGURES_ONLY).
"""
import argparse
import difflib
import glob
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import records  # noqa: E402
from figure_catalog import FIGURES  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "benches/results"
PAGES = ("README.md", "benches/results/README.md", "docs/*.md", "docs/ops/*.md")
BLOCK = re.compile(r"<!-- figures:([a-z0-9_]+) -->(.*?)<!-- /figures -->", re.S)
# Sections whose every figure is rendered: (page, heading); a unit figure outside a block
# there is one written by hand.
FIGURES_ONLY = (("README.md", "## Status"), ("benches/results/README.md", "## Latest figures, by op"))
UNIT_FIGURE = re.compile(r"\d\s*(µs|ms\b|TF/s|GB/s|×)")


class Page:
    """One block being rendered: the records it reads and the runs it cites, numbered in
    order of first citation."""

    def __init__(self, store, page_path):
        self.store = store
        self.dir = os.path.dirname(page_path)
        self.cited = []

    def record(self, path):
        if path not in self.store:
            raise KeyError(f"no record {RESULTS}/{path}")
        return self.store[path]

    def link(self, path):
        return os.path.relpath(os.path.join(RESULTS, path), self.dir or ".")

    def cite(self, *paths):
        """"[1]", "[1][2]": the runs' numbers in this block, each a link to its record."""
        marks = []
        for path in paths:
            self.record(path)
            if path not in self.cited:
                self.cited.append(path)
            marks.append(f"[[{self.cited.index(path) + 1}]]({self.link(path)})")
        return "".join(marks)

    def run(self, i, path):
        """The run's GPU, commit, date and command, then its record (and the note it was
        transcribed from)."""
        p = records.provenance(self.store[path])
        via = self.store[path].get("transcribed_from")
        note = f"; transcribed from [{via}]({self.link(via)})" if via else ""
        return (f"{p['gpu']}, commit {p['commit']}, {p['date']}: `{short(p['command'])}` "
                f"([{os.path.basename(path)}]({self.link(path)}){note})")

    def sources(self):
        """The runs cited, as the numbered lines that end a block."""
        return ["", "Runs:", ""] + [f"{i}. {self.run(i, path)}" for i, path in enumerate(self.cited, 1)]

    def sources_inline(self):
        """The runs cited, in one parenthesis (a block inside a table cell or a sentence)."""
        return "(" + "; ".join(f"[{i}] {self.run(i, path)}" for i, path in enumerate(self.cited, 1)) + ")"


def short(command, keep=2):
    """`command` with an option given more than `keep` + 1 times shown as its first `keep`
    values, "…" and the count (`mkbench gemm --shape A --shape B … (17 --shape)`); the
    record holds it whole."""
    words = command.split()
    counts = {}
    for w in words:
        if w.startswith("--"):
            counts[w] = counts.get(w, 0) + 1
    out, seen = [], {}
    i = 0
    while i < len(words):
        w = words[i]
        if counts.get(w, 0) > keep + 1 and i + 1 < len(words):
            seen[w] = seen.get(w, 0) + 1
            if seen[w] <= keep:
                out += [w, words[i + 1]]
            elif seen[w] == counts[w]:
                out.append(f"… ({counts[w]} {w})")
            i += 2
            continue
        out.append(w)
        i += 1
    return " ".join(out)


def render(name, store, page_path, inline):
    """The text of block `name` on `page_path`: whole lines ending with its runs, or (inline)
    one line that names its runs in the text."""
    if name not in FIGURES:
        raise KeyError(f"{page_path}: no figure named {name!r} (known: {', '.join(sorted(FIGURES))})")
    page = Page(store, page_path)
    text = FIGURES[name](page)
    if inline:
        return f"{text} {page.sources_inline()}"
    return "\n" + "\n".join([text, *page.sources()]) + "\n"


def render_page(text, store, page_path):
    """`text` with every block rendered; (new text, names of the blocks)."""
    names = []

    def fill(m):
        names.append(m.group(1))
        inline = "\n" not in m.group(2)
        return f"<!-- figures:{m.group(1)} -->{render(m.group(1), store, page_path, inline)}<!-- /figures -->"

    return BLOCK.sub(fill, text), names


def hand_written(text, heading):
    """Lines with a unit figure outside the blocks of the section under `heading`."""
    start = text.find(f"\n{heading}\n")
    if start < 0:
        return [f"no section {heading!r}"]
    end = text.find("\n## ", start + len(heading) + 2)
    section = BLOCK.sub("", text[start:end if end > 0 else len(text)])
    return [line for line in section.splitlines() if UNIT_FIGURE.search(line)]


def pages(root):
    out = []
    for pattern in PAGES:
        out += sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, pattern)))
    return out


def run(root, write):
    """Checks (or rewrites) every page under `root`; returns the problems found."""
    store = records.stored(os.path.join(root, RESULTS))
    problems, used = [], set()
    for path in pages(root):
        with open(os.path.join(root, path)) as f:
            text = f.read()
        try:
            new, names = render_page(text, store, path)
        except (KeyError, ValueError) as e:  # a block or record that does not exist, a figure refusing its records
            problems.append(f"{path}: {e}")
            continue
        used.update(names)
        if new != text:
            if write:
                with open(os.path.join(root, path), "w") as f:
                    f.write(new)
            else:
                diff = difflib.unified_diff(text.splitlines(), new.splitlines(), path, f"{path} (rendered)", lineterm="", n=0)
                problems.append(f"{path}: figures differ from the records:\n" + "\n".join(list(diff)[:40]))
    for path, heading in FIGURES_ONLY:
        full = os.path.join(root, path)
        if os.path.exists(full):
            for line in hand_written(open(full).read(), heading):
                problems.append(f"{path}, {heading}: a figure outside a figures block: {line.strip()[:120]}")
    for name in sorted(set(FIGURES) - used):
        problems.append(f"figure {name!r} appears on no page")
    return problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 where a page differs from its records")
    mode.add_argument("--write", action="store_true", help="rewrite every figure block")
    ap.add_argument("--root", default=ROOT, help="the repository (default: this script's)")
    a = ap.parse_args(argv)
    try:
        problems = run(a.root, a.write)
    except (OSError, ValueError) as e:  # a record that is unreadable or breaks its kind's rules
        print(f"figures.py: {e}", file=sys.stderr)
        return 1
    for p in problems:
        print(f"figures.py: {p}", file=sys.stderr)
    if problems:
        if not a.write:
            print("figures.py: run `python3 benches/figures.py --write` and commit the pages", file=sys.stderr)
        return 1
    print(f"figures.py: {'figure blocks written' if a.write else 'every figure block matches its records'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
