"""Check that every link inside the built site resolves (no network: outside links are not followed).

    python -P docs/check_links.py docs/_build/html

Reads every HTML file under the folder; for each ``href`` and ``src`` that is not an outside
address (``http:``, ``https:``, ``mailto:``), checks that the file exists and, for a ``#fragment``,
that the page has an element with that ``id``. Prints each broken link; exit status 1 if any.
"""
from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if key == "id" or (key == "name" and tag == "a"):
                self.ids.add(value)
            if key in ("href", "src") and value:
                self.links.append(value)


def check(site: Path):
    pages = {}
    for path in site.rglob("*.html"):
        page = _Page()
        page.feed(path.read_text(encoding="utf-8", errors="replace"))
        pages[path.resolve()] = page
    broken = []
    for path, page in pages.items():
        if "_modules" in path.parts:  # viewcode's source pages: generated, linked both ways by Sphinx
            continue
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith("//"):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.relative_to(site.resolve())}: {link} (no such file)")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else set()
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{path.relative_to(site.resolve())}: {link} (no such anchor)")
    return broken


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    site = Path(argv[0] if argv else "docs/_build/html")
    if not (site / "index.html").exists():
        print(f"{site}: no built site here (python -P -m sphinx -b html docs {site})", file=sys.stderr)
        return 2
    broken = check(site)
    for line in broken:
        print(line)
    print(f"{len(broken)} broken link(s) in {site}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
