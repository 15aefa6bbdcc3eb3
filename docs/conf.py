"""Sphinx configuration of the gradaccum_jax documentation site.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``
(``pip install -e ".[dev]"`` installs sphinx and myst-nb). The notebooks in
``notebooks/`` are rendered with their committed outputs and never executed;
``tests/test_docs.py`` builds the site with warnings as errors.
"""

from __future__ import annotations

import pathlib
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
# Document the source tree next to this file, not an installed copy.
sys.path.insert(0, str(ROOT))

import gradaccum_jax  # noqa: E402

project = "gradaccum_jax"
author = "gradaccum_jax authors"
copyright = "the gradaccum_jax authors"
release = gradaccum_jax.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []

# Docstrings cross-reference public names with single backticks (`MultiSteps`):
# resolve them as Python objects; a name with no page renders as code.
default_role = "py:obj"

# Docstrings are Google style (Args / Returns / Raises / Example).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Show defaults as written (`jnp.float32`, not "<class ...>").
autodoc_preserve_defaults = True
# Keep the package's alias names in signatures (bare names: Sphinx cannot
# render an alias inside a union or a Callable).
autodoc_type_aliases = {"Schedule": "Schedule"}
autosummary_generate = False

# The notebooks are committed executed (the tests run them: test_notebooks.py,
# and test_transformer_lm.py for the transformer notebook):
# render their saved outputs, never run them here.
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = f"gradaccum_jax {release}"
html_static_path: list[str] = []
# The notebooks open with a remote "Open in Colab" badge.
suppress_warnings = ["image.nonlocal_uri"]


def _copy_notebooks() -> None:
    """Copies ../notebooks/*.ipynb into docs/notebooks/ (git-ignored).

    Sphinx reads only files under its source directory; a copy is sturdier
    than symlinks (which break on Windows checkouts and in sdists). Unchanged
    files are not rewritten, so incremental builds stay incremental.
    """
    target = DOCS / "notebooks"
    target.mkdir(exist_ok=True)
    sources = sorted((ROOT / "notebooks").glob("*.ipynb"))
    for stale in set(target.glob("*.ipynb")) - {target / s.name for s in sources}:
        stale.unlink()
    for source in sources:
        copy = target / source.name
        if not copy.exists() or copy.read_bytes() != source.read_bytes():
            shutil.copyfile(source, copy)


_copy_notebooks()
