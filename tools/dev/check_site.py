"""Check a built HTML site offline: every local link and image resolves.

    python tools/check_site.py docs/_build/html

Every ``href`` and ``src`` of every page that is not an external URL must
name a file of the site (and, with ``#anchor``, an ``id`` in that file).
Exit 0 when all resolve, 1 with one line per broken reference otherwise.
Sphinx's own linkcheck needs the network; this needs none.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

EXTERNAL = ("http", "https", "mailto", "javascript", "data", "ftp", "tel")


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.refs: list[tuple[str, str]] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("id", "name") and value:
                self.ids.add(value)
            if value is not None and ((name == "href" and tag in ("a", "link", "area"))
                                      or (name == "src" and tag in ("img", "script", "source", "iframe"))):
                self.refs.append((tag, value))


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def broken_links(site: Path) -> list[str]:
    """One line ``page: tag -> target (why)`` for each local reference of a
    page under ``site`` that names no file, or no anchor in its file."""
    site = Path(site).resolve()
    pages = sorted(site.rglob("*.html"))
    if not pages:
        return [f"{site}: no HTML page found"]
    parsed = {p: _parse(p) for p in pages}
    problems = []
    for page, info in parsed.items():
        for tag, ref in info.refs:
            parts = urlsplit(ref)
            if parts.scheme in EXTERNAL or parts.netloc or ref.startswith("//"):
                continue
            if parts.scheme:
                problems.append(f"{page.relative_to(site)}: {tag} -> {ref} (unknown scheme)")
                continue
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_relative_to(site):
                problems.append(f"{page.relative_to(site)}: {tag} -> {ref} (outside the site)")
            elif not target.is_file():
                problems.append(f"{page.relative_to(site)}: {tag} -> {ref} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    problems.append(f"{page.relative_to(site)}: {tag} -> {ref} (no such anchor)")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python tools/check_site.py SITE_DIR", file=sys.stderr)
        return 2
    problems = broken_links(Path(args[0]))
    for line in problems:
        print(line)
    print(f"check_site: {len(problems)} broken local reference(s) in {args[0]}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
