"""mkdocs hooks (mkdocs.yml `hooks:`): the generated parts of the site, made at build time by docgen.py.

on_files adds the plots and every file of benchmarks/results to the site; on_page_markdown replaces each
`<!-- generated: NAME -->` marker of a page with what docgen.GENERATED[NAME] makes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import docgen  # noqa: E402
from mkdocs.structure.files import File  # noqa: E402


def on_files(files, config):
    for name, png in docgen.plots().items():
        files.append(File.generated(config, f"plots/{name}", content=png))
    for path in sorted(docgen.RESULTS.rglob("*")):
        if path.is_file():
            files.append(File.generated(config, f"results/{path.relative_to(docgen.RESULTS).as_posix()}",
                                        abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    return docgen.render(markdown)
