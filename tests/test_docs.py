"""The README and docs/ stay true: their shell and Python snippets run, and their links resolve.

Every ```` ```bash ````, ```` ```sh ```` and ```` ```python ```` block carries a marker on the
line before it (an HTML comment, invisible on the rendered page):

- ``<!-- run -->``: run as written, without a server;
- ``<!-- run: server=NAME; sub OLD => NEW; ... -->``: run against a test server, ``default``
  (``omnistep serve``: the embedded voice) or ``toy`` (``--model toy``), after replacing each
  ``OLD`` by ``NEW`` (a snippet written for a real checkpoint runs on the toy card);
- ``weights=FAMILY`` in a ``run`` marker writes ``/tmp/FAMILY`` first (``omnistep weights``: a
  tiny checkpoint), and ``slow`` marks the snippet ``slow`` (run with ``-m slow``, not in CI);
- ``<!-- skip: REASON -->``: not run; the reason says why and which test covers it.

A snippet runs in a fresh temporary folder holding a small ``book.txt``, with ``.venv/bin/``
read as this interpreter's bin folder, ``/tmp/`` as that folder, ``127.0.0.1:8000`` and
``localhost:8000`` as the test server's address. Shell runs under ``bash -euo pipefail`` with
``curl`` failing on an HTTP error status (``--fail-with-body``); Python in a new interpreter.
A snippet fails the test when it exits with a non-zero status.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from omnistep.models.registry import write_weights
from tests.serving import running_server

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
MARKER = re.compile(r"^<!--\s*(run|skip)\s*(?::\s*(.*?))?\s*-->$")
SERVERS = {"default": (), "toy": ("--model", "toy"), "toy_hear": ("--model", "toy_hear")}
SNIPPET_TIMEOUT_S = 120
BOOK = "The first sentence of the book. A second one, shorter.\n"
CURL = 'curl() { command curl --fail-with-body -sS "$@"; }\n'


@dataclass(frozen=True)
class Snippet:
    """One fenced block: its page, first line (1-based), language ("bash" or "python"), code,
    and its marker: ``run`` (with ``server`` and ``subs``), or ``skip`` with a reason."""

    page: Path
    line: int
    language: str
    code: str
    action: str | None
    reason: str = ""
    server: str | None = None
    subs: tuple[tuple[str, str], ...] = field(default=())
    weights: str | None = None
    slow: bool = False

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _parse_marker(line: str) -> dict | None:
    """The marker on ``line`` as ``Snippet`` fields (action, reason, server, subs, weights,
    slow); None when the line is no marker.

    Raises:
        ValueError: a ``run`` marker with a part it does not know.
    """
    match = MARKER.match(line.strip())
    if match is None:
        return None
    action, rest = match.group(1), (match.group(2) or "")
    if action == "skip":
        return {"action": action, "reason": rest}
    fields: dict = {"action": action, "subs": []}
    for part in filter(None, (p.strip() for p in rest.split(";"))):
        if part.startswith(("server=", "weights=")):
            key, _, value = part.partition("=")
            fields[key] = value
        elif part == "slow":
            fields["slow"] = True
        elif part.startswith("sub ") and "=>" in part:
            old, new = part.removeprefix("sub ").split("=>", 1)
            fields["subs"].append((old.strip(), new.strip()))
        else:
            raise ValueError(f"unknown marker part {part!r} in {line!r}")
    fields["subs"] = tuple(fields["subs"])
    return fields


def _snippets(page: Path) -> list[Snippet]:
    """The shell and Python blocks of ``page`` with the marker on the line before each."""
    lines = page.read_text().splitlines()
    found = []
    for token in MarkdownIt().parse("\n".join(lines)):
        if token.type != "fence" or token.info.split(" ")[0] not in LANGUAGES:
            continue
        language = LANGUAGES[token.info.split(" ")[0]]
        start = token.map[0]
        marker = lines[start - 1] if start else ""
        fields = _parse_marker(marker) or {"action": None}
        found.append(Snippet(page, start + 1, language, token.content, **fields))
    return found


SNIPPETS = [s for page in PAGES for s in _snippets(page)]
RUN = [s for s in SNIPPETS if s.action == "run"]


def test_every_snippet_is_marked_run_or_skip_with_a_reason():
    unmarked = [s.name for s in SNIPPETS if s.action is None]
    assert not unmarked, f"snippets without <!-- run --> or <!-- skip: reason -->: {unmarked}"
    no_reason = [s.name for s in SNIPPETS if s.action == "skip" and len(s.reason.split()) < 3]
    assert not no_reason, f"skipped snippets without a reason: {no_reason}"
    unknown = [s.name for s in RUN if s.server is not None and s.server not in SERVERS]
    assert not unknown, f"unknown servers (known: {sorted(SERVERS)}): {unknown}"
    stale = [s.name for s in RUN for old, _ in s.subs if old not in s.code]
    assert not stale, f"a 'sub' whose text is not in its snippet: {stale}"


def test_the_marker_parser_reads_servers_and_substitutions():
    assert _parse_marker("<!-- run -->") == {"action": "run", "subs": ()}
    assert _parse_marker("<!-- skip: needs a GPU -->") == {
        "action": "skip",
        "reason": "needs a GPU",
    }
    assert _parse_marker('<!-- run: server=toy; sub "a" => "b"; sub x, => -->') == {
        "action": "run",
        "server": "toy",
        "subs": (('"a"', '"b"'), ("x,", "")),
    }
    assert _parse_marker("<!-- run: slow; weights=chattts; sub n=5 => n=1 -->") == {
        "action": "run",
        "slow": True,
        "weights": "chattts",
        "subs": (("n=5", "n=1"),),
    }
    assert _parse_marker("some text") is None
    with pytest.raises(ValueError, match="unknown marker part"):
        _parse_marker("<!-- run: servr=toy -->")


# ---------------------------------------------------------------------------------- running
@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``servers(name)`` -> the base URL of that test server, started on first use (each with
    its own voices database) and stopped after this module."""
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}

        def get(name: str) -> str:
            if name not in urls:
                db = tmp_path_factory.mktemp(f"voices-{name}") / "voices.db"
                args = (*SERVERS[name], "--voices-db", str(db))
                urls[name] = stack.enter_context(running_server(*args))
            return urls[name]

        yield get


def _prepared(snippet: Snippet, folder: Path, url: str | None) -> str:
    """The snippet's code as it runs: its substitutions, then the paths and the address."""
    code = snippet.code
    for old, new in snippet.subs:
        code = code.replace(old, new)
    # /tmp/ first: the interpreter's own path may lie under /tmp (a clone there, as CI's)
    code = code.replace("/tmp/", f"{folder}/")
    code = code.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    if url is not None:
        address = url.removeprefix("http://")
        code = code.replace("127.0.0.1:8000", address).replace("localhost:8000", address)
    return code


@pytest.mark.parametrize(
    "snippet",
    [pytest.param(s, id=s.name, marks=[pytest.mark.slow] if s.slow else []) for s in RUN],
)
def test_snippet_runs(snippet, servers, tmp_path):
    url = servers(snippet.server) if snippet.server else None
    (tmp_path / "book.txt").write_text(BOOK)
    if snippet.weights:
        write_weights(snippet.weights, tmp_path / snippet.weights)
    code = _prepared(snippet, tmp_path, url)
    if snippet.language == "bash":
        command = ["bash", "-euo", "pipefail", "-c", CURL + code]
    else:
        command = [sys.executable, "-c", code]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "OMNISTEP_API_KEY": "",
    }
    done = subprocess.run(
        command,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=SNIPPET_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, (
        f"{snippet.name} exited {done.returncode}\n--- code\n{code}\n"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    )


# ------------------------------------------------------------------------------------ links
def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    tokens = MarkdownIt().parse(page.read_text())
    return {_slug(tokens[i + 1].content) for i, t in enumerate(tokens) if t.type == "heading_open"}


def _links(page: Path) -> list[str]:
    """Every link target of ``page`` (inline links, images included)."""
    targets = []
    for token in MarkdownIt().parse(page.read_text()):
        for child in token.children or ():
            href = child.attrGet("href") or child.attrGet("src")
            if href:
                targets.append(str(href))
    return targets


def test_slugs_follow_github():
    assert _slug("`POST /v1/audio/speech`") == "post-v1audiospeech"
    assert _slug("Cloned voices (Base)") == "cloned-voices-base"
    assert _slug("`omnistep bench`: benchmarking a running server") == (
        "omnistep-bench-benchmarking-a-running-server"
    )


def test_links_between_pages_resolve_and_no_page_is_orphaned():
    broken, linked = [], set()
    for page in PAGES:
        for target in _links(page):
            if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                continue
            linked.add(dest)
            if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    orphans = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"pages no other page links to: {orphans}"
