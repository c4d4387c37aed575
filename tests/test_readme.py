"""Every Python block in README.md runs as written, or is marked as a fragment.

A block is a fragment when its first line is a comment starting with
``# Fragment``; it must still be valid Python. Every other block is run, as
it is, in a fresh interpreter.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BLOCK = re.compile(r'^```python\n(.*?)^```', re.S | re.M)


def _blocks():
    with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
        text = f.read()
    blocks = []
    for match in _BLOCK.finditer(text):
        line = text.count('\n', 0, match.start()) + 1
        blocks.append((line, match.group(1)))
    return blocks


def _is_fragment(code):
    return code.lstrip().startswith('# Fragment')


COMPLETE = [(line, code) for line, code in _blocks() if not _is_fragment(code)]


def test_the_readme_has_runnable_blocks_and_every_block_parses():
    assert len(COMPLETE) >= 3, 'README.md lost its runnable examples'
    for line, code in _blocks():
        compile(code, 'README.md:%d' % line, 'exec')


@pytest.mark.parametrize('line,code', COMPLETE, ids=['README.md:%d' % l for l, _ in COMPLETE])
def test_complete_block_runs(line, code, tmp_path):
    script = tmp_path / 'block.py'
    script.write_text(code)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3',
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, 'README.md:%d failed:\n%s\n%s' % (
        line, proc.stdout[-2000:], proc.stderr[-4000:])
