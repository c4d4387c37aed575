"""Every public name and command keeps working under its documented path.

The names are listed here as they were before the package layout of issue 34
(``tf1_syncbn/*.py`` side by side), so that a move that drops one from a
public module fails. ``docs/api/*.md`` are read too: every module, class and
name the API reference renders must resolve. The commands run with
``--help`` (cheap: argument parsing only).
"""

import importlib
import os
import re
import subprocess
import sys

import pytest

#: The source tree, whatever the TF behaviour: the TF2-behaviour pass only.
pytestmark = pytest.mark.once

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: module -> the names users reach in it (each module's __all__ before the layout change,
#: and the other names the docs and tests use).
PUBLIC = {
    'tf1_syncbn': [
        'sync_batch_norm', 'BatchNorm', 'BatchRenorm', 'start_finetuning', 'SyncBackend',
        'SyncKey', 'CollectiveBackend', 'NcclBackend', 'HorovodBackend', 'sync_arg_scope',
        'convert_arg_scope', 'patch_tensorpack', 'SyncBNWarning', 'PatchError', 'layers',
        'patch_tf_layers', 'setup_cluster', 'Cluster', 'DistributedOptimizer',
        'all_reduce_gradients', 'average_across_workers', 'broadcast_variables', 'WorkerSession',
        'ClusterError', 'PeerMissingError', 'WorkerLostError', 'audit_graph', 'export',
        'keras', 'patch_keras', 'audit', 'distributed', 'backends', 'timeouts', 'kernel_sets',
        'kernels', 'moments', 'weighted_moments', '__version__', 'patch_slim'],
    'tf1_syncbn.slim': ['sync_batch_norm', 'sync_arg_scope', 'convert_arg_scope',
                        'patch_slim_batch_norm', 'is_slim_batch_norm', 'patch_slim'],
    'tf1_syncbn.run': ['ENVIRONMENT_VARIABLE', 'STRICT_EXIT_STATUS', 'BACKENDS', 'build_parser'],
    'tf1_syncbn.layers': ['BatchNormalization', 'batch_normalization', 'patch_tf_layers'],
    # Hand-written batch norm's front-end (issue 44: was the private tf1_syncbn._core.moments).
    'tf1_syncbn.nn': ['moments', 'weighted_moments'],
    'tf1_syncbn.keras': ['BatchNormalization', 'BatchNormalizationV1', 'patch_keras',
                         'KERAS_PACKAGE', 'KERAS_BATCH_NORMALIZATION',
                         'KERAS_BATCH_NORMALIZATION_V1'],
    'tf1_syncbn.export': ['inference_graph_def', 'export_saved_model', 'FORBIDDEN_OP_PREFIXES'],
    'tf1_syncbn.audit': ['audit_graph', 'read_meta_graph', 'main', 'AuditReport', 'LayerAudit'],
    'tf1_syncbn.distributed': [
        'Cluster', 'setup_cluster', 'session_config', 'local_rank', 'unreachable_peers',
        'all_reduce_gradients', 'DistributedOptimizer', 'broadcast_variables',
        'average_across_workers', 'WorkerSession', 'wait_for_peers', 'ClusterError',
        'PeerMissingError', 'WorkerLostError', 'hard_exit', 'DEFAULT_BUCKET_BYTES',
        'DEFAULT_STARTUP_TIMEOUT', 'DEFAULT_RESTORE_TIMEOUT', 'EXIT_STARTUP_HANG',
        'COMMUNICATION_HINTS'],
    # The path before issue 44's launch package: an alias of the moved module.
    'tf1_syncbn.restarts': [
        'RestartLoop', 'Restart', 'restart_env', 'restart_count', 'start_line',
        'parse_start_line', 'exit_status', 'describe_exit', 'RESTART_COUNT_ENV',
        'MAX_RESTARTS_ENV'],
    'tf1_syncbn.launch.restarts': [
        'RestartLoop', 'Restart', 'restart_env', 'restart_count', 'start_line',
        'parse_start_line', 'exit_status', 'describe_exit', 'RESTART_COUNT_ENV',
        'MAX_RESTARTS_ENV', 'WorkerExit'],
    # The path docs/api/tf1_syncbn.md named before the layout: an alias of the moved module.
    'tf1_syncbn.audit_report': ['AuditReport', 'LayerAudit'],
    'tf1_syncbn.backends': ['SyncBackend', 'SyncKey', 'CollectiveBackend', 'NcclBackend',
                            'HorovodBackend', 'stable_hash', 'DEFAULT_TIMEOUT', 'op_timeout',
                            'resolve', 'local_gpu_count', 'check_local_gpu',
                            'physical_gpu_count', 'stall_shutdown_seconds'],
    'tf1_syncbn.timeouts': ['DEFAULT_TIMEOUT', 'MAX_TIMEOUT', 'validate_timeout',
                            'timeout_from_environment', 'watched', 'op_timeout'],
    'tf1_syncbn.kernel_sets': ['CompiledCpuKernels', 'PortableKernels', 'kernels_for',
                               'register_kernel_set', 'kernel_set_factories'],
    'tf1_syncbn.kernels': ['load', 'library', 'build', 'enabled', 'use_custom_kernels',
                           'status', 'cache_path', 'register_cached'],
    'tf1_syncbn.launch': ['Launcher', 'launch', 'free_ports', 'tf_config', 'gpu_assignment',
                          'main'],
    'tf1_syncbn.selftest': ['run_check', 'main', 'CheckResult', 'format_table', 'QUANTITIES',
                            'BACKENDS'],
    'tower': ['TowerContext', 'get_current_tower_context', 'strip_tower_prefix',
              'tower_index_from_name', 'call_for_each_tower', 'average_gradients',
              'virtual_cpu_config', 'register_tower_pattern', 'unregister_tower_pattern',
              'tower_patterns', 'graph_state', 'harness', 'context', 'training'],
    'tower.graph_state': ['GraphState', 'get_graph_state', 'root_graph', 'full_name_scope',
                          'root_graph_attribute'],
}

#: ``python -m <module> --help`` for each command of the docs.
COMMANDS = ['tf1_syncbn.audit', 'tf1_syncbn.selftest', 'tf1_syncbn.kernels',
            'tf1_syncbn.launch', 'tf1_syncbn.run']


@pytest.mark.parametrize('module', sorted(PUBLIC))
def test_every_public_name_resolves(module):
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(imported, name)]
    assert missing == [], '%s lost %s' % (module, missing)
    for name in getattr(imported, '__all__', ()):
        assert hasattr(imported, name), '%s.__all__ names %r, which it lacks' % (module, name)


def test_the_old_paths_are_the_moved_modules():
    import tf1_syncbn.audit.report
    import tf1_syncbn.audit_report
    import tf1_syncbn.launch.restarts
    import tf1_syncbn.restarts
    from tf1_syncbn import restarts
    assert tf1_syncbn.audit_report is tf1_syncbn.audit.report
    assert tf1_syncbn.restarts is restarts is tf1_syncbn.launch.restarts


def test_the_lazy_keras_names_are_the_keras_package():
    import tf1_syncbn
    import tf1_syncbn.keras
    assert tf1_syncbn.keras is sys.modules['tf1_syncbn.keras']
    assert tf1_syncbn.patch_keras is tf1_syncbn.keras.patch_keras


def _documented():
    """``[(page, dotted name)]`` that docs/api/*.md render (directives and public-api names)."""
    found = []
    folder = os.path.join(ROOT, 'docs', 'api')
    for page in sorted(os.listdir(folder)):
        with open(os.path.join(folder, page)) as f:
            text = f.read()
        for match in re.finditer(r'\.\. auto(?:module|class|function|data|exception):: (\S+)',
                                 text):
            found.append((page, match.group(1)))
        for match in re.finditer(r'```\{public-api\} (\S+)\n((?::\w+:[^\n]*\n)*)```', text):
            module, options = match.group(1), match.group(2)
            names = re.search(r':names: ([^\n]*)', options)
            found.append((page, module))
            if names:
                found.extend((page, '%s.%s' % (module, n)) for n in names.group(1).split())
    return found


def _resolve(dotted):
    parts = dotted.split('.')
    for i in range(len(parts), 0, -1):
        try:
            value = importlib.import_module('.'.join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            value = getattr(value, part)
        return value
    raise ImportError(dotted)


def test_every_name_the_api_reference_renders_resolves():
    documented = _documented()
    assert len(documented) > 20, documented       # the pages were read
    broken = []
    for page, dotted in documented:
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as e:
            broken.append('%s: %s (%s)' % (page, dotted, e))
    assert broken == []


#: Runs ``python -m <module> --help`` for each module of argv in this one interpreter (as
#: ``python -m`` does: runpy, a package's ``__main__``), printing each exit status.
HELP = """
import runpy, sys
for module in sys.argv[1:]:
    sys.argv = [module, '--help']
    try:
        runpy.run_module(module, run_name='__main__', alter_sys=True)
        status = 'no exit'
    except SystemExit as e:
        status = e.code
    print('EXIT %s %s' % (module, status), flush=True)
"""


def test_every_command_answers_help():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    # One interpreter for the four (one TensorFlow import, not four).
    modules = subprocess.Popen([sys.executable, '-c', HELP] + COMMANDS, cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The launcher also runs by its path, without the package (its docstring says so): its
    # folder, whose __main__.py python runs, or that file.
    for path in ('launch', os.path.join('launch', '__main__.py')):
        script = subprocess.run([sys.executable, '-X', 'importtime',
                                 os.path.join(ROOT, 'tf1_syncbn', path), '--help'], cwd='/',
                                env=dict(env, PYTHONPATH=''), capture_output=True, text=True,
                                timeout=60)
        assert script.returncode == 0 and 'usage: ' in script.stdout, script.stderr[-2000:]
        imported = [line.rsplit('|', 1)[-1].strip() for line in script.stderr.splitlines()
                    if line.startswith('import time:')]
        assert 'restarts' in imported and not [m for m in imported if m.startswith(
            ('tf1_syncbn', 'tensorflow'))], imported
    out, err = modules.communicate(timeout=180)
    assert modules.returncode == 0, err[-3000:]
    for module in COMMANDS:
        assert 'EXIT %s 0' % module in out, (module, out[-3000:], err[-3000:])
        assert 'usage: python -m %s' % module in out, (module, out[-3000:])
