"""The conformance matrix: every front-end x harness x option, against one oracle.

What each module holds, in the order they build on each other:

* ``options.py``: the option axis (one deviation from the baseline each) and
  each option's data;
* ``front_ends.py``: the rows, each front-end as users call it, and the layer
  it replaces (the oracle's side), built from the same arguments;
* ``harnesses.py``: the columns, what builds the towers and whose update ops
  a step runs;
* ``matrix.py``: the cells, their expected outcomes (``matrix.expect``), which
  cells ``make test`` and its TF1-behaviour pass run, and what the
  completeness test reads;
* ``run.py``: a harness's cells in one graph, the step, the variables read
  back, saved and restored;
* ``oracle.py``: the replaced layer on one device with each sync group's
  concatenated batch, in a legacy-Keras subprocess.

The tests are ``tests/conformance/``; the page, docs/conformance.md, is
written by ``tools/conformance_page.py``.

To add a front-end, a harness or an option: a class (or an ``Option``) in
its module, and, where some cell of it is refused, the rule in
``matrix.expect``. The completeness test fails until every argument of a
new front-end's signature, and every harness docs/harnesses.md lists, has
its entry.
"""
