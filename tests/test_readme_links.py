"""Every relative link and every file or folder of this repository that README.md (and the
benchmark report, BENCHMARKS.md) names exists.

Checked, from the repository root:
- markdown links and images whose target is not a URL; a ``#fragment`` must name a heading of the
  markdown file it points into (GitHub's anchors);
- paths, in backticks or in plain text, that look like this repository's: a first component that is
  a top-level entry (``kernels/fa4.py``, ``.ci/run``), or a name ending in a file extension
  (``tests/test_faults.py``), or, in backticks, in ``/`` (``passes/``). What follows a colon is a
  module attribute or a line number, not part of the path (``kernels/aten.py: FlashVarlen``);
- bare file names (``sdpa.py``, ``BENCHMARKS.md``) must exist somewhere in the repository.

Not checked: fenced code blocks (commands and their output), URLs, absolute paths and paths outside
the repository (``../shared/BASELINES.md``), and code with spaces in it (``scores /= c``).
"""
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

EXTENSIONS = ("py", "md", "png", "toml", "txt", "json", "yml", "yaml", "cfg", "sh")
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)
LINK = re.compile(r"!?\[((?:[^\]\\]|\\.)*)\]\(\s*<?([^()\s<>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"(`+)(.+?)\1", re.S)
URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S+")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
EXTENSION = re.compile(r"\.(?:%s)$" % "|".join(EXTENSIONS))
PLAIN_PATH = re.compile(r"(?<![\w./-])(?:(?:[\w.-]+/)+[\w.-]+|[\w-]+(?:\.[\w-]+)*\.(?:%s)\b)" % "|".join(EXTENSIONS))


def _blank(match):
    """The match replaced by as many newlines, so that offsets after it keep their line numbers."""
    return "\n" * match.group(0).count("\n")


def _link_text(match):
    """A link replaced by its text, which is prose, keeping the lines of its target."""
    return match.group(1) + "\n" * (match.group(0).count("\n") - match.group(1).count("\n"))


def _line(text, offset):
    return text.count("\n", 0, offset) + 1


def references(markdown):
    """(line, kind, name) for each link target ("link"), each code span that could be a path
    ("path": one word, slashes allowed, what follows a colon dropped) and each plain-text word with a
    slash inside or a file extension ("path"). ``missing`` decides which name this repository's."""
    text = FENCE.sub(_blank, markdown)
    found = []
    for match in LINK.finditer(text):
        found.append((_line(text, match.start()), "link", match.group(2)))
    text = LINK.sub(_link_text, text)
    for match in CODE.finditer(text):
        name = match.group(2).strip().split(":")[0].strip()
        if PATH.fullmatch(name):
            found.append((_line(text, match.start()), "path", name))
    text = URL.sub("", CODE.sub(_blank, text))
    for match in PLAIN_PATH.finditer(text):
        found.append((_line(text, match.start()), "path", match.group(0).rstrip(".")))
    return sorted(found)


def _is_repository_path(name, root):
    """A relative name whose first component is a top-level entry of ``root`` (with more after it),
    or that ends in ``/`` or a file extension."""
    if name.startswith(("../", "/", "~")) or not re.search(r"\w", name):
        return False
    first, _, rest = name.partition("/")
    return bool(rest) and (root / first).exists() or name.endswith("/") or EXTENSION.search(name) is not None


def _file_names(root):
    names = set()
    for _, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d != ".git" and d != "__pycache__"]
        names.update(files)
    return names


def heading_anchors(markdown):
    """GitHub's anchors for the ATX headings of ``markdown``: lower case, punctuation dropped, spaces
    as hyphens, a repeated anchor numbered."""
    anchors = []
    for match in re.finditer(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", FENCE.sub(_blank, markdown), re.M):
        title = LINK.sub(lambda m: m.group(1), match.group(1)).lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        repeats = sum(1 for anchor in anchors if re.fullmatch(re.escape(slug) + r"(-\d+)?", anchor))
        anchors.append(f"{slug}-{repeats}" if repeats else slug)
    return set(anchors)


def missing(markdown, root=ROOT, document="README.md"):
    """What ``markdown`` (``document``, at ``root``) names that does not exist, one line each."""
    problems, file_names = [], None
    for line, kind, name in references(markdown):
        if kind == "link":
            if not name or SCHEME.match(name) or name.startswith(("../", "/")):
                continue
            path, _, fragment = name.partition("#")
            target = root / path
            if path and not target.exists():
                problems.append(f"line {line}: link to {name}: {path} does not exist")
            elif fragment and (not path or target.suffix == ".md") \
                    and fragment not in heading_anchors(target.read_text() if path else markdown):
                problems.append(f"line {line}: link to {name}: no heading #{fragment} in {path or document}")
        elif not _is_repository_path(name, root):
            continue
        elif "/" in name:
            if not (root / name).exists():
                problems.append(f"line {line}: {name} does not exist")
        else:
            file_names = _file_names(root) if file_names is None else file_names
            if name not in file_names:
                problems.append(f"line {line}: no file named {name} in the repository")
    return problems


@pytest.mark.parametrize("document", ["README.md", "BENCHMARKS.md"])
def test_every_link_and_path_the_document_names_exists(document):
    problems = missing((ROOT / document).read_text(), document=document)
    assert not problems, f"{document} names what does not exist:\n" + "\n".join(problems)


EXAMPLE = """# Title

## The `op` and its kernels

See [the report](BENCHMARKS.md), [a kernel](kernels/nope.py) and [a heading](#the-op-and-its-kernels).
Figures: [kernels](BENCHMARKS.md#no-such-heading), ![plot](missing-plot.png).
The layout: `kernels/fa4.py`, `kernels/gone.py`, `passes/`, `nowhere/`, `kernels/aten.py: FlashVarlen`,
`kernels/vanished.py: Thing`, `sdpa.py`, `renamed_pass.py`.
Plain text names tests/test_faults.py and tests/test_lost.py, then README.md and LOST.md.

```
python tests/not_checked_in_a_code_block.py
  [0] blocks.0.attn @ demo_script.py:24
```
"""

NOT_PATHS = """Prose with and/or, isend/irecv, 192/128, d_qk/d_v, S/√2 and GB/s; `h_q/h_kv`, `/`, `scores /= c`,
`i // C == j // C`, `torch.compile`, `attn_compile.bench`, version 4.0.0b36, 1.9e-3.
Outside the repository: `../shared/BASELINES.md`, [baselines](../shared/BASELINES.md), `/tmp/x.py`.
URLs: [docs](https://pytorch.org/docs/stable/a.py), https://github.com/x/y/blob/main/z.py, <mailto:a@b.c>.
"""


def test_each_kind_of_missing_name_is_reported():
    assert missing(EXAMPLE) == [
        "line 5: link to kernels/nope.py: kernels/nope.py does not exist",
        "line 6: link to BENCHMARKS.md#no-such-heading: no heading #no-such-heading in BENCHMARKS.md",
        "line 6: link to missing-plot.png: missing-plot.png does not exist",
        "line 7: kernels/gone.py does not exist",
        "line 7: nowhere/ does not exist",
        "line 8: kernels/vanished.py does not exist",
        "line 8: no file named renamed_pass.py in the repository",
        "line 9: no file named LOST.md in the repository",
        "line 9: tests/test_lost.py does not exist",
    ]


def test_names_that_are_not_repository_paths_are_left_alone():
    assert missing(NOT_PATHS) == []


def test_heading_anchors_follow_github():
    assert heading_anchors("# A `code` title: (x)\n## A `code` title: (x)\n### 2× H200, ≥ 95%\n") == {
        "a-code-title-x", "a-code-title-x-1", "2-h200--95"}
