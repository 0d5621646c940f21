"""Makes ``tests/`` importable (``_compare``) from every test directory and from spawned ranks."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# Under pytest-xdist (the README's command: ``-n 2 --dist loadgroup``) a test file stays on one
# worker, so a module that spawns its ranks once (tests/distributed) spawns them once; the files
# below hold no module-wide fixture and many slow, independent tests (CLI subprocesses, compiles),
# so their tests spread over both workers instead.
_PER_TEST = ("tests/bench/test_cli.py", "tests/integrations/test_compile.py",
             "tests/bench/training/test_commands_train.py", "tests/bench/training/test_train_dist.py",
             "tests/test_docs_run.py")


def pytest_collection_modifyitems(config, items):
    import pytest
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path not in _PER_TEST:
            item.add_marker(pytest.mark.xdist_group(path))
