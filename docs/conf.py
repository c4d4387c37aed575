"""Sphinx configuration: ``make docs`` builds docs/ into docs/_build/html, offline.

Why Sphinx: the TensorFlow-ecosystem libraries this one replaces or sits
next to (tensorpack, Horovod) document themselves with Sphinx, and users know
its layout; napoleon reads the library's Google-style docstrings as they are,
autodoc imports the real objects (so a signature is the one users call),
MyST keeps the pages in Markdown that GitHub also renders, and nothing needs
the network (no intersphinx). See docs/testing.md.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)                       # tf1_syncbn, tower: this checkout's
sys.path.insert(0, os.path.join(HERE, '_ext'))
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import tf1_syncbn  # noqa: E402 - after the path and TF's log level

project = 'tf1-syncbn'
author = 'tf1-syncbn developers'
copyright = author
release = version = tf1_syncbn.__version__

extensions = [
    'myst_parser',
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
    'public_api',
]
source_suffix = {'.md': 'markdown'}
root_doc = 'index'
exclude_patterns = ['_build', '_ext', 'README.md']
templates_path = []

# Markdown: `#anchor` links to headings (the README's style), ::: fences.
myst_heading_anchors = 3
myst_enable_extensions = ['colon_fence', 'deflist']

# The library's docstrings are Google style.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = 'bysource'
autodoc_typehints = 'none'
autodoc_default_options = {'show-inheritance': True}
add_module_names = False
# Every name in these modules' __all__ must be on a page of the API reference.
public_api_modules = ['tf1_syncbn', 'tower', 'tf1_syncbn.nn', 'tf1_syncbn.layers',
                      'tf1_syncbn.keras', 'tf1_syncbn.export', 'tf1_syncbn.distributed',
                      'tf1_syncbn.timeouts', 'tf1_syncbn.kernel_sets']

html_theme = 'furo'
html_title = 'tf1-syncbn %s' % release
html_static_path = []
html_show_sourcelink = False
pygments_style = 'sphinx'
