"""Sphinx configuration of the documentation site.

Build it (warnings are errors) from the repository root:

    pip install -e ".[docs]" && sphinx-build -W --keep-going -b html docs docs/_build/html
"""

project = "jaxmp"
author = "the jaxmp authors"
copyright = "the jaxmp authors"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_parser",  # the pages are Markdown (MyST)
    "sphinx.ext.autodoc",  # the API reference, from the docstrings
    "sphinx.ext.napoleon",  # which are Google style
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Markdown: GitHub-style heading anchors (`page.md#a-heading`) for links between pages.
myst_heading_anchors = 3

# API reference: the public names as users write them (`jaxmp.mp_value_and_grad`),
# parameters described in the docstrings.
add_module_names = True
autodoc_typehints = "none"  # the docstrings describe each argument
autodoc_preserve_defaults = True  # `compute_dtype=jnp.float16`, as in the source
autodoc_member_order = "bysource"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "jaxmp"
