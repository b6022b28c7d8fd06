"""mkdocs hooks: the reference's navigation file, which docs/gen_reference.py writes and
mkdocs-literate-nav reads, is not a page of the site."""
from mkdocs.structure.files import InclusionLevel


def on_files(files, config):
    for f in files:
        if f.src_uri == "reference/SUMMARY.md":
            f.inclusion = InclusionLevel.EXCLUDED
    return files
